package daemon

import (
	"context"
	"fmt"
	"slices"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/tandem-llm/tandem/daemon/apierr"
	"github.com/tandem-llm/tandem/daemon/frontend"
	"github.com/tandem-llm/tandem/daemon/placement"
	"github.com/tandem-llm/tandem/daemon/supervise"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// Drain implements tandem.v1.Admin: the node leaves placement, and the
// call returns once the pipeline has moved off it.
func (a *adminServer) Drain(ctx context.Context, in *tandemv1.DrainRequest) (*tandemv1.MoveResponse, error) {
	if in.GetNode() == "" {
		return nil, apierr.GRPC(apierr.Invalidf("drain: no node named"))
	}
	resp, err := a.move(ctx, supervise.Drain{Node: in.GetNode()})
	return resp, apierr.GRPC(err)
}

// Undrain implements tandem.v1.Admin: the node is back in placement; a
// rebalance that starts at once (auto_rebalance) is waited for.
func (a *adminServer) Undrain(ctx context.Context, in *tandemv1.UndrainRequest) (*tandemv1.MoveResponse, error) {
	if in.GetNode() == "" {
		return nil, apierr.GRPC(apierr.Invalidf("undrain: no node named"))
	}
	resp, err := a.move(ctx, supervise.Undrain{Node: in.GetNode()})
	return resp, apierr.GRPC(err)
}

// Rebalance implements tandem.v1.Admin: it moves the pipeline to the
// placement over the live, undrained stage nodes (or the plan given) and
// returns once it runs there; a dry run only computes it.
func (a *adminServer) Rebalance(ctx context.Context, in *tandemv1.RebalanceRequest) (*tandemv1.MoveResponse, error) {
	var ranges []placement.Range
	for i, r := range in.GetPlan() {
		if r.GetNode() == "" || r.GetLayerLo() >= r.GetLayerHi() {
			return nil, apierr.GRPC(apierr.Invalidf("rebalance: plan range %d (%s=%d-%d): want a node and layers lo < hi", i, r.GetNode(), r.GetLayerLo(), r.GetLayerHi()))
		}
		ranges = append(ranges, placement.Range{Node: r.GetNode(), Lo: int(r.GetLayerLo()), Hi: int(r.GetLayerHi())})
	}
	if !in.GetDryRun() {
		resp, err := a.move(ctx, supervise.Rebalance{Ranges: ranges})
		return resp, apierr.GRPC(err)
	}
	d := a.d
	if err := d.leading(); err != nil {
		return nil, apierr.GRPC(err)
	}
	resp := &tandemv1.MoveResponse{Note: "dry run: nothing moved"}
	snap := d.sup.Snapshot()
	resp.Before, resp.BeforeKvTokens = pipelineMap(snap.Pipeline)
	plan, err := d.sup.Plan(ctx, ranges)
	if err != nil {
		return nil, apierr.GRPC(apierr.Preconditionf("rebalance: %v", err))
	}
	resp.After, resp.AfterKvTokens = planMap(plan)
	resp.LeftOut = leftOutStatus(plan.LeftOut)
	if p := snap.Pipeline; p != nil && sameStages(p, plan) {
		resp.Note = fmt.Sprintf("dry run: the pipeline of epoch %d already has this placement", p.Epoch)
	}
	return resp, nil
}

// move applies an admin command on the leader and waits for the move it
// starts, if any: the requests then run on the new pipeline.
func (a *adminServer) move(ctx context.Context, ev supervise.Event) (*tandemv1.MoveResponse, error) {
	d := a.d
	if err := d.leading(); err != nil {
		return nil, err
	}
	snap := d.sup.Snapshot()
	resp := &tandemv1.MoveResponse{}
	resp.Before, resp.BeforeKvTokens = pipelineMap(snap.Pipeline)
	start := time.Now()
	mv, err := d.sup.Admin(ctx, ev)
	if err != nil {
		return nil, apierr.Preconditionf("%v", err)
	}
	if mv.Epoch == 0 {
		resp.After, resp.AfterKvTokens = resp.Before, resp.BeforeKvTokens
		resp.LeftOut = leftOutStatus(d.sup.Snapshot().LeftOut)
		resp.Note = a.stillNote(ctx, ev)
		return resp, nil
	}
	d.log.Info("admin command: moving the pipeline", "command", fmt.Sprintf("%T", ev), "epoch", mv.Epoch)
	if err := mv.Wait(ctx); err != nil {
		return nil, apierr.Unavailablef("the move to epoch %d did not happen: %v", mv.Epoch, err)
	}
	resp.MoveTime = durationpb.New(time.Since(start))
	snap = d.sup.Snapshot()
	resp.Moved, resp.Epoch = true, mv.Epoch
	resp.After, resp.AfterKvTokens = pipelineMap(snap.Pipeline)
	resp.LeftOut = leftOutStatus(snap.LeftOut)
	if c := snap.Change; c.Epoch == mv.Epoch {
		resp.RequestsReprefilled = uint32(c.Requests)
	}
	return resp, nil
}

// stillNote says why a command moved nothing.
func (a *adminServer) stillNote(ctx context.Context, ev supervise.Event) string {
	d := a.d
	snap := d.sup.Snapshot()
	under := ""
	if snap.Building != 0 {
		under = fmt.Sprintf("; the build of epoch %d is under way, a move follows it if needed", snap.Building)
	}
	switch ev := ev.(type) {
	case supervise.Drain:
		if p := snap.Pipeline; p == nil || !slices.ContainsFunc(p.Stages, func(s supervise.Stage) bool { return s.Node == ev.Node }) {
			return fmt.Sprintf("%s drained: out of placement; it holds no stage of the pipeline%s", ev.Node, under)
		}
		if under != "" {
			return fmt.Sprintf("%s drained: out of placement%s", ev.Node, under)
		}
		if _, err := d.sup.Plan(ctx, nil); err != nil {
			return fmt.Sprintf("%s drained, but no placement without it is possible (%v): it keeps serving until one is", ev.Node, err)
		}
		return fmt.Sprintf("%s drained: out of placement; the move off it is pending", ev.Node)
	case supervise.Undrain:
		if !*d.cfg.Cluster.AutoRebalance {
			return fmt.Sprintf("%s undrained: back in placement; cluster.auto_rebalance is off: `tandemctl rebalance` moves it in", ev.Node)
		}
		return fmt.Sprintf("%s undrained: back in placement; auto-rebalance moves it in once the membership has been stable for %v%s", ev.Node, supervise.DefaultStableFor, under)
	}
	return "nothing moved" + under
}

// leading refuses an admin command on a node that does not lead, naming
// the leader (UNAVAILABLE).
func (d *Daemon) leading() error {
	snap := d.sup.Snapshot()
	if !snap.Leading {
		return frontend.NotLeader(snap.Leader.Name, snap.Leader.Meta.GRPCAddr)
	}
	return nil
}

// pipelineMap is the layer map of a built pipeline, with each stage's KV
// capacity as it reported it.
func pipelineMap(p *supervise.Pipeline) ([]*tandemv1.PlannedStage, uint64) {
	if p == nil {
		return nil, 0
	}
	out := make([]*tandemv1.PlannedStage, len(p.Stages))
	for i, s := range p.Stages {
		out[i] = &tandemv1.PlannedStage{Node: s.Node, LayerLo: uint32(s.Lo), LayerHi: uint32(s.Hi), Backend: s.Load.GetBackend(),
			KvTokens: uint64(s.KVTokens), Reused: s.Reused}
	}
	return out, uint64(p.KVTokens)
}

// planMap is the layer map of a placement, with its estimates of KV
// capacity.
func planMap(p placement.Plan) ([]*tandemv1.PlannedStage, uint64) {
	out := make([]*tandemv1.PlannedStage, len(p.Stages))
	for i, s := range p.Stages {
		out[i] = &tandemv1.PlannedStage{Node: s.Node, LayerLo: uint32(s.Lo), LayerHi: uint32(s.Hi), Backend: s.Backend,
			KvTokens: uint64(s.KVTokens), Estimate: true}
	}
	return out, uint64(max(p.KVTokens, 0))
}

// sameStages reports whether a pipeline has a plan's layers on the same
// nodes.
func sameStages(p *supervise.Pipeline, plan placement.Plan) bool {
	return slices.EqualFunc(p.Stages, plan.Stages, func(s supervise.Stage, t placement.Stage) bool {
		return s.Node == t.Node && s.Lo == t.Lo && s.Hi == t.Hi
	})
}
