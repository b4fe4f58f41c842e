package daemon

import (
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/tandem-llm/tandem/daemon/apierr"
	"github.com/tandem-llm/tandem/daemon/membership"
	"github.com/tandem-llm/tandem/daemon/placement"
	"github.com/tandem-llm/tandem/daemon/steptrace"
	"github.com/tandem-llm/tandem/daemon/supervise"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
	"github.com/tandem-llm/tandem/sched"
)

// adminServer implements tandem.v1.Admin.
type adminServer struct {
	tandemv1.UnimplementedAdminServer
	d *Daemon
}

var memberStates = map[membership.State]tandemv1.MemberState{
	membership.Alive: tandemv1.MemberState_MEMBER_STATE_ALIVE,
	membership.Dead:  tandemv1.MemberState_MEMBER_STATE_DEAD,
	membership.Left:  tandemv1.MemberState_MEMBER_STATE_LEFT,
}

// Status implements tandem.v1.Admin. It never carries a secret: members
// are described by their gossiped metadata only.
func (a *adminServer) Status(context.Context, *tandemv1.StatusRequest) (*tandemv1.StatusResponse, error) {
	d := a.d
	resp := &tandemv1.StatusResponse{Node: d.cfg.Name, ModelId: d.ckpt.Identity(), Version: Version}
	for _, m := range d.memb.Members() {
		resp.Members = append(resp.Members, &tandemv1.Member{
			Name:           m.Name,
			State:          memberStates[m.State],
			Backend:        m.Meta.Backend,
			Device:         m.Meta.Device,
			MemTotal:       m.Meta.MemTotal,
			MemFree:        m.Meta.MemFree,
			GrpcAddr:       m.Meta.GRPCAddr,
			GossipAddr:     m.Addr,
			Version:        m.Meta.Version,
			ModelId:        m.Meta.ModelID,
			LeaderEligible: m.Meta.LeaderEligible,
		})
	}
	snap := d.sup.Snapshot()
	d.mu.Lock()
	draining := d.draining
	d.mu.Unlock()
	resp.Leader, resp.LeaderAddr = snap.Leader.Name, snap.Leader.Meta.GRPCAddr
	resp.Reason = snap.Reason
	if !snap.Leading && snap.Leader.Name != "" {
		resp.Reason = d.followerReason(snap.Leader.Name)
	}
	if draining {
		resp.Reason = "draining"
	}
	if snap.Leading {
		resp.RequestsRunning = uint32(snap.Sched.Running)
		resp.RequestsWaiting = uint32(snap.Sched.Waiting)
		resp.Scheduler = schedulerStats(snap.Sched)
		resp.Drained = snap.Drained
		resp.LeftOut = leftOutStatus(snap.LeftOut)
		resp.LastChange = changeStatus(snap.Change)
	}
	resp.Recoveries = snap.Totals.Recoveries
	resp.Moves = snap.Totals.Moves + snap.Totals.Rebalances
	if p := snap.Pipeline; p != nil {
		resp.Epoch = p.Epoch
		resp.KvTokens = uint64(p.KVTokens)
		resp.Serving = !draining
		resp.GraphMode = p.Graphs.Dispatch.Mode().String()
		resp.Handoff = p.Handoff
		resp.MaxInFlight = uint32(p.MaxInFlight)
		epoch, busy := d.sup.Trace().Busy(time.Now())
		for i := range p.Stages {
			st := stageStatus(i, &p.Stages[i])
			if epoch == p.Epoch && i < len(busy) {
				b := busy[i]
				st.Busy, st.DeviceBusy = durationpb.New(b.Busy), durationpb.New(b.DeviceBusy)
				st.BusyFraction, st.DeviceBusyFraction = b.Recent, b.RecentDevice
			}
			resp.Stages = append(resp.Stages, st)
		}
	}
	return resp, nil
}

// leftOutStatus describes the stage nodes placement left out.
func leftOutStatus(l []placement.LeftOut) []*tandemv1.LeftOutNode {
	var out []*tandemv1.LeftOutNode
	for _, n := range l {
		out = append(out, &tandemv1.LeftOutNode{Node: n.Node, Reason: n.Why})
	}
	return out
}

// stageStatus describes one stage of the leader's pipeline.
func stageStatus(i int, s *supervise.Stage) *tandemv1.Stage {
	l := s.Load
	out := &tandemv1.Stage{
		Index:       uint32(i),
		Node:        s.Node,
		LayerLo:     uint32(s.Lo),
		LayerHi:     uint32(s.Hi),
		Backend:     l.GetBackend(),
		MemoryBytes: s.Member.Meta.MemFree,
		KvTokens:    uint64(s.KVTokens),
		Device:      l.GetDevice(),
		WeightBytes: l.GetWeightBytes(),
		KvBytes:     l.GetKvBytes(),
		GraphBytes:  l.GetGraphBytes(),
		NextLink:    s.NextLink,
		Reused:      s.Reused,
	}
	if c := s.Capture; c != nil {
		out.GraphBytes, out.Graphs, out.CaptureTime = c.GetGraphBytes(), c.GetGraphs(), c.GetCaptureTime()
	}
	return out
}

// Graphs implements tandem.v1.Admin.
func (a *adminServer) Graphs(context.Context, *tandemv1.GraphsRequest) (*tandemv1.GraphsResponse, error) {
	d := a.d
	p := d.sup.Snapshot().Pipeline
	if p == nil {
		return nil, apierr.GRPC(apierr.Preconditionf("node %s runs no pipeline: ask the leader", d.cfg.Name))
	}
	g := p.Graphs
	resp := &tandemv1.GraphsResponse{Mode: g.Dispatch.Mode().String(), ConfiguredMode: g.Configured.String(), Downgrades: g.Downgrades}
	for _, s := range g.Dispatch.CaptureSizes() {
		resp.CaptureSizes = append(resp.CaptureSizes, uint32(s))
	}
	for _, r := range p.Steps.Snapshot() {
		resp.Steps = append(resp.Steps, &tandemv1.GraphStepCount{Unpadded: uint32(r.Unpadded), Padded: uint32(r.Padded), Mode: r.Mode.String(), Count: r.Count})
	}
	return resp, nil
}

// defaultTraceTimeout bounds a Trace call that sets no timeout.
const defaultTraceTimeout = 30 * time.Second

// Trace implements tandem.v1.Admin.
func (a *adminServer) Trace(ctx context.Context, in *tandemv1.TraceRequest) (*tandemv1.TraceResponse, error) {
	d := a.d
	if d.sup.Snapshot().Pipeline == nil {
		return nil, apierr.GRPC(apierr.Preconditionf("node %s runs no pipeline: ask the leader", d.cfg.Name))
	}
	n := int(in.GetSteps())
	if n < 1 || n > steptrace.MaxSteps {
		return nil, apierr.GRPC(apierr.Invalidf("steps %d: want 1 to %d", n, steptrace.MaxSteps))
	}
	timeout := in.GetTimeout().AsDuration()
	if timeout <= 0 {
		timeout = defaultTraceTimeout
	}
	rctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	tr, err := d.sup.Trace().Record(rctx, n)
	switch {
	case errors.Is(err, steptrace.ErrBusy):
		return nil, apierr.GRPC(apierr.Preconditionf("%v", err))
	case err != nil && ctx.Err() == nil && rctx.Err() != nil:
		return nil, apierr.GRPC(apierr.Unavailablef("trace of %d steps: %v within %v: is the cluster serving requests?", n, err, timeout))
	case err != nil:
		return nil, apierr.GRPC(err)
	}
	js, err := tr.JSON()
	if err != nil {
		return nil, apierr.GRPC(err)
	}
	return &tandemv1.TraceResponse{TraceJson: js}, nil
}

// schedulerStats describes the leader's scheduler.
func schedulerStats(st sched.Stats) *tandemv1.SchedulerStats {
	return &tandemv1.SchedulerStats{
		Running:           uint32(st.Running),
		Waiting:           uint32(st.Waiting),
		InFlight:          uint32(st.InFlight),
		KvBlocksUsed:      uint64(st.KVBlocksUsed),
		KvBlocks:          uint64(st.KVBlocks),
		BlockSize:         uint32(st.BlockSize),
		Preemptions:       st.Preemptions,
		DiscardedTokens:   st.Discarded,
		Finished:          st.Finished,
		Cancelled:         st.Cancelled,
		Steps:             st.Steps,
		LastStepTime:      durationpb.New(st.LastStepTime),
		MeanStepTime:      durationpb.New(st.StepTime),
		Failed:            st.Failed,
		Reprefilled:       st.Reprefilled,
		ReprefilledTokens: st.ReprefilledTokens,
	}
}

// followerReason is the status of a node that does not lead: who does,
// and whether this node serves a stage of its pipeline.
func (d *Daemon) followerReason(leader string) string {
	d.mu.Lock()
	stage := d.stageReady
	d.mu.Unlock()
	if stage {
		return fmt.Sprintf("led by %s; this node serves a stage of its pipeline", leader)
	}
	return fmt.Sprintf("led by %s; this node holds no stage of its pipeline", leader)
}

// changeStatus describes the pipeline's last change (nil: none yet).
func changeStatus(c supervise.ChangeReport) *tandemv1.PipelineChange {
	if c.Kind == "" {
		return nil
	}
	out := &tandemv1.PipelineChange{Kind: c.Kind, Why: c.Why, Start: timestamppb.New(c.Start), Epoch: c.Epoch,
		RequestsReprefilled: uint32(c.Requests), TokensReprefilled: c.Tokens, InProgress: c.End.IsZero(), Error: c.Err}
	if !c.End.IsZero() {
		out.Took = durationpb.New(c.End.Sub(c.Start))
	}
	return out
}
