package daemon

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/daemon/membership"
	"github.com/tandem-llm/tandem/daemon/nodewire"
	"github.com/tandem-llm/tandem/daemon/placement"
	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/pipeline"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
	"github.com/tandem-llm/tandem/sched"
)

// cpuDTypeBytes is the size of a weight element on the CPU backend (it
// computes in float32).
const cpuDTypeBytes = 4

// pipelineState is the leader's running pipeline.
type pipelineState struct {
	epoch       uint64
	stages      []stageState
	graphs      *pipelineGraphs
	handoff     bool // on-device hand-off is on
	maxInFlight int  // steps the scheduler keeps in flight
	eng         *engine
	ended       chan struct{} // closed when the engine's goroutine has returned
}

// stageState is one stage of the leader's pipeline.
type stageState struct {
	placement.Stage
	member   membership.Member
	load     *tandemv1.LoadResponse    // what the stage reported loading
	capture  *tandemv1.CaptureResponse // its CUDA graphs (nil: none)
	nextLink string                    // transport to the next stage
	kvTokens int                       // the stage's KV capacity as it reported it
}

// buildResult is what an attempt to build the pipeline ends with.
type buildResult struct {
	pipe *pipelineState
	err  error
}

// supervise runs the node's control loop until ctx is done: it follows the
// membership, chooses the leader and, on the leader, builds the pipeline
// when enough stages are up, and stops it when one of them goes away.
func (d *Daemon) supervise(ctx context.Context) {
	tick := time.NewTicker(superviseTick)
	defer tick.Stop()
	var (
		building  bool
		buildDone = make(chan buildResult, 1)
		nextTry   time.Time
	)
	bctx, cancelBuilds := context.WithCancel(ctx)
	defer func() {
		cancelBuilds()
		if building {
			if r := <-buildDone; r.pipe != nil {
				// Built too late: close its links, the stages end.
				r.pipe.eng.drv.Close()
			}
		}
		// A pipeline still running is drained by Run.
	}()
	for {
		d.lastTick.Store(time.Now().UnixNano())
		members := d.memb.Members()
		leader := chooseLeader(d.cfg.Cluster.Leader, members)
		d.mu.Lock()
		d.leader = leader
		pipe := d.pipe
		d.mu.Unlock()
		me := leader.Name == d.cfg.Name

		switch {
		case pipe != nil && !me:
			if pipe.eng.drain() {
				d.log.Warn("no longer the leader: draining the pipeline", "leader", leader.Name)
			}
		case pipe != nil:
			d.checkPipeline(pipe, members)
		case me && !building && time.Now().After(nextTry):
			stages := stageCandidates(members, d.ckpt.Identity())
			if len(stages) >= d.cfg.Cluster.ExpectStages {
				building = true
				go func() {
					p, err := d.build(bctx, stages)
					buildDone <- buildResult{p, err}
				}()
			} else {
				d.setReason(waitingReason(members, d.ckpt.Identity(), len(stages), d.cfg.Cluster.ExpectStages))
			}
		case !me && !building:
			d.setReason(fmt.Sprintf("not the leader (the leader is %q)", leader.Name))
		}

		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		case <-d.memb.Events():
			// Level-triggered: the loop re-reads Members.
		case r := <-buildDone:
			building = false
			if r.err != nil {
				nextTry = time.Now().Add(buildRetry)
				d.setReason(fmt.Sprintf("building the pipeline failed: %v", r.err))
				d.log.Warn("build the pipeline", "err", r.err)
				continue
			}
			d.mu.Lock()
			d.pipe = r.pipe
			d.reason = ""
			d.mu.Unlock()
			d.runEngine(r.pipe)
			d.setHealth(true)
			d.notifyReady("leading a pipeline")
			d.log.Info("pipeline serving", "epoch", r.pipe.epoch, "stages", stageSummary(r.pipe.stages), "kv_tokens", r.pipe.eng.kvTokens)
		case <-d.endedPipeline():
			d.mu.Lock()
			p := d.pipe
			d.pipe = nil
			d.mu.Unlock()
			d.setHealth(false)
			err := p.eng.stopErr()
			d.setReason(fmt.Sprintf("pipeline of epoch %d stopped: %v", p.epoch, err))
			if errors.Is(err, errDrained) {
				d.log.Info("pipeline drained", "epoch", p.epoch)
			} else {
				d.log.Warn("pipeline stopped", "epoch", p.epoch, "err", err)
			}
			nextTry = time.Now().Add(buildRetry)
			d.background.Go(func() { d.releaseStages(p) })
		}
	}
}

// releaseStages releases the stages of a pipeline that stopped, so that a
// stage still waiting on a link (an NCCL transfer whose peer is gone)
// gives its assignment up now rather than when the next pipeline replaces
// it.
func (d *Daemon) releaseStages(p *pipelineState) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for i, s := range p.stages {
		c, err := grpc.NewClient(s.member.Meta.GRPCAddr, d.dialOpts...)
		if err == nil {
			_, err = tandemv1.NewNodeClient(c).Release(ctx, &tandemv1.ReleaseRequest{Epoch: p.epoch})
			c.Close()
		}
		if err != nil {
			d.log.Debug("release a stage of a stopped pipeline", "stage", i, "node", s.Node, "epoch", p.epoch, "err", err)
		}
	}
}

// runEngine starts the pipeline's engine goroutine; Run waits for it. The
// engine stops on drain or abort, not with the daemon's context: Run
// drains it first.
func (d *Daemon) runEngine(p *pipelineState) {
	d.engines.Add(1)
	go func() {
		defer d.engines.Done()
		defer close(p.ended)
		p.eng.run()
	}()
}

// endedPipeline is closed when the current pipeline's engine has returned
// (nil, blocking forever, while there is none).
func (d *Daemon) endedPipeline() <-chan struct{} {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.pipe == nil {
		return nil
	}
	return d.pipe.ended
}

func (d *Daemon) setReason(r string) {
	d.mu.Lock()
	d.reason = r
	d.mu.Unlock()
}

// checkPipeline stops the pipeline when one of its stages is gone: at once
// when it failed (its requests cannot finish), after the requests in flight
// when it left gracefully.
func (d *Daemon) checkPipeline(p *pipelineState, members []membership.Member) {
	for _, s := range p.stages {
		i := slices.IndexFunc(members, func(m membership.Member) bool { return m.Name == s.Node })
		switch {
		case i < 0 || members[i].State == membership.Dead:
			d.setHealth(false)
			if p.eng.abort(fmt.Errorf("stage node %s is dead", s.Node)) {
				d.log.Warn("stage node dead: stopping the pipeline", "stage", s.Node, "epoch", p.epoch)
			}
		case members[i].State == membership.Left:
			d.setHealth(false)
			if p.eng.drain() {
				d.log.Info("stage node leaving: draining the pipeline", "stage", s.Node, "epoch", p.epoch)
			}
		}
	}
}

// drainPipeline drains the pipeline and waits for its engine, aborting it
// once timeout has passed.
func (d *Daemon) drainPipeline(p *pipelineState, timeout time.Duration) {
	p.eng.drain()
	select {
	case <-p.ended:
		return
	case <-time.After(timeout):
		d.log.Warn("drain timed out: cancelling the requests left", "timeout", timeout)
		p.eng.abort(fmt.Errorf("the drain took longer than %v", timeout))
	}
	<-p.ended
}

// chooseLeader is the configured leader when it is alive, else (with no
// leader configured) the leader-eligible live member with the smallest
// name. Every member computes the same from the same view.
func chooseLeader(fixed string, members []membership.Member) membership.Member {
	for _, m := range members {
		if m.State != membership.Alive || m.MetaErr != nil {
			continue
		}
		if (fixed != "" && m.Name == fixed) || (fixed == "" && m.Meta.LeaderEligible) {
			return m // members are sorted by name
		}
	}
	return membership.Member{}
}

// stageCandidates are the live members offering a stage of the model.
func stageCandidates(members []membership.Member, modelID string) []membership.Member {
	var out []membership.Member
	for _, m := range members {
		if liveStageNode(m) && m.Meta.ModelID == modelID {
			out = append(out, m)
		}
	}
	return out
}

// liveStageNode reports whether m is alive and offers a stage.
func liveStageNode(m membership.Member) bool {
	return m.State == membership.Alive && m.MetaErr == nil && m.Meta.DataAddr != ""
}

// waitingReason says why the leader has too few stage candidates, naming
// the live stage nodes it left out because they serve another model (a
// model directory that differs from the leader's), which an operator
// would otherwise only find by comparing identities in the member table.
func waitingReason(members []membership.Member, modelID string, have, want int) string {
	reason := fmt.Sprintf("waiting for stage nodes: %d of %d up", have, want)
	var other []string
	for _, m := range members {
		if liveStageNode(m) && m.Meta.ModelID != modelID {
			other = append(other, fmt.Sprintf("%s has model %s", m.Name, nodewire.Short(m.Meta.ModelID)))
		}
	}
	if len(other) > 0 {
		reason += fmt.Sprintf(" (left out: %s; the leader has model %s)", strings.Join(other, ", "), nodewire.Short(modelID))
	}
	return reason
}

// plan places the model on the candidates: the configured plan, or layers
// balanced over their memory, costed for the CUDA backend when every
// candidate runs it, else (conservatively) for the CPU backend.
func (d *Daemon) plan(cands []membership.Member) (placement.Plan, error) {
	backend := BackendCUDA
	nodes := make([]placement.Node, len(cands))
	for i, m := range cands {
		nodes[i] = placement.Node{Name: m.Name, UsableBytes: m.Meta.MemFree, Backend: m.Meta.Backend}
		if m.Meta.Backend != BackendCUDA {
			backend = BackendCPU
		}
	}
	cost := backendCost(d.ckpt.Config(), backend, d.cfg.Stage.MaxBatchTokens, d.cfg.Stage.MaxSeqs)
	if len(d.cfg.Plan) == 0 {
		return placement.Balance(nodes, cost)
	}
	ranges := make([]placement.Range, len(d.cfg.Plan))
	for i, r := range d.cfg.Plan {
		ranges[i] = placement.Range{Node: r.Node, Lo: r.Layers[0], Hi: r.Layers[1]}
	}
	return placement.Explicit(nodes, ranges, cost)
}

// nextEpoch is a new leader epoch, newer than any this node used or saw
// refused: the clock in nanoseconds, so that a newly chosen leader's epoch
// supersedes its predecessor's.
func (d *Daemon) nextEpoch() uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	e := max(uint64(time.Now().UnixNano()), d.lastEpoch+1, d.seenEpoch+1)
	d.lastEpoch = e
	return e
}

// build places the model, has every stage node load its layers, capture
// the CUDA graphs the leader will dispatch and connect to its neighbours,
// and connects the leader's control links. On failure it releases what was
// loaded.
func (d *Daemon) build(ctx context.Context, cands []membership.Member) (*pipelineState, error) {
	plan, err := d.plan(cands)
	if err != nil {
		return nil, fmt.Errorf("place the model: %w", err)
	}
	epoch := d.nextEpoch()
	byName := map[string]membership.Member{}
	for _, m := range cands {
		byName[m.Name] = m
	}
	p := &pipelineState{epoch: epoch, ended: make(chan struct{})}
	conns := make([]*grpc.ClientConn, len(plan.Stages))
	defer func() {
		for _, c := range conns {
			if c != nil {
				c.Close()
			}
		}
	}()
	for i, s := range plan.Stages {
		p.stages = append(p.stages, stageState{Stage: s, member: byName[s.Node]})
		if conns[i], err = grpc.NewClient(byName[s.Node].Meta.GRPCAddr, d.dialOpts...); err != nil {
			return nil, fmt.Errorf("stage %d on %s: %w", i, s.Node, err)
		}
	}
	nodes := make([]tandemv1.NodeClient, len(conns))
	for i, c := range conns {
		nodes[i] = tandemv1.NewNodeClient(c)
	}
	release := func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		for i, n := range nodes {
			if _, err := n.Release(rctx, &tandemv1.ReleaseRequest{Epoch: epoch}); err != nil {
				d.log.Warn("release a stage", "stage", i, "node", plan.Stages[i].Node, "err", err)
			}
		}
	}
	wired := false
	defer func() {
		if !wired {
			release()
		}
	}()
	mcfg := d.ckpt.Config()
	loads := make([]*tandemv1.LoadResponse, len(conns))
	err = forEach(len(conns), func(i int) error {
		s := plan.Stages[i]
		var trailer metadata.MD
		resp, err := nodes[i].Load(ctx, &tandemv1.LoadRequest{
			Epoch: epoch, Leader: d.cfg.Name, ModelId: d.ckpt.Identity(), Index: uint32(i),
			LayerLo: uint32(s.Lo), LayerHi: uint32(s.Hi),
			MaxBatchTokens: uint32(d.cfg.Stage.MaxBatchTokens), MaxSeqs: uint32(d.cfg.Stage.MaxSeqs), BlockSize: uint32(d.cfg.Stage.BlockSize),
			Handoff: *d.cfg.Stage.Handoff,
		}, grpc.Trailer(&trailer))
		if err != nil {
			d.noteRefusedEpoch(err, trailer)
			return fmt.Errorf("stage %d on %s: load layers [%d, %d): %w", i, s.Node, s.Lo, s.Hi, err)
		}
		if resp.GetModelId() != d.ckpt.Identity() {
			return fmt.Errorf("stage %d on %s: loaded model %s, want %s", i, s.Node, nodewire.Short(resp.GetModelId()), nodewire.Short(d.ckpt.Identity()))
		}
		loads[i] = resp
		return nil
	})
	if err != nil {
		return nil, err
	}
	if err := checkActivations(plan.Stages, loads); err != nil {
		return nil, err
	}
	maxSeqLen, blocks := mcfg.MaxPositions, math.MaxInt32
	for i, l := range loads {
		p.stages[i].load = l
		p.stages[i].kvTokens = int(l.GetKvBlocks()) * d.cfg.Stage.BlockSize
		blocks = min(blocks, int(l.GetKvBlocks()))
		maxSeqLen = min(maxSeqLen, int(l.GetMaxSeqLen()))
	}
	if p.graphs, err = d.resolveGraphs(plan.Stages, loads); err != nil {
		return nil, err
	}
	if keys := p.graphs.dispatch.Keys(); len(keys) > 0 {
		req := &tandemv1.CaptureRequest{Epoch: epoch, Keys: nodewire.EncodeGraphKeys(keys)}
		err = forEach(len(nodes), func(i int) error {
			r, err := nodes[i].Capture(ctx, req)
			if err != nil {
				return fmt.Errorf("stage %d on %s: capture %d CUDA graph keys: %w", i, plan.Stages[i].Node, len(keys), err)
			}
			p.stages[i].capture = r
			return nil
		})
		if err != nil {
			return nil, err
		}
	}
	p.handoff = *d.cfg.Stage.Handoff && loads[0].GetHandoffReceiver()
	wiring := planLinks(loads, p.handoff)
	conn := make([]*tandemv1.ConnectResponse, len(nodes))
	err = forEach(len(nodes), func(i int) error {
		req := wiring[i]
		req.Epoch = epoch
		r, err := nodes[i].Connect(ctx, req)
		if err != nil {
			return fmt.Errorf("stage %d on %s: connect its links: %w", i, plan.Stages[i].Node, err)
		}
		conn[i] = r
		return nil
	})
	if err != nil {
		return nil, err
	}
	last := len(nodes) - 1
	err = forEach(len(nodes), func(i int) error {
		req := &tandemv1.JoinRequest{Epoch: epoch}
		if i > 0 {
			req.PrevNcclId = conn[i-1].GetNextNcclId()
		}
		if i == 0 && last > 0 {
			req.HandoffNcclId = conn[last].GetHandoffNcclId()
		}
		if len(req.PrevNcclId) == 0 && len(req.HandoffNcclId) == 0 {
			return nil
		}
		if _, err := nodes[i].Join(ctx, req); err != nil {
			return fmt.Errorf("stage %d on %s: join its NCCL links: %w", i, plan.Stages[i].Node, err)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	for i := range p.stages {
		p.stages[i].nextLink = transportName(wiring[i].GetNext())
	}
	links := make([]pipeline.Link, len(loads))
	for i, l := range loads {
		if links[i], err = pipeline.DialLink(ctx, l.GetControlAddr()); err != nil {
			for _, l := range links[:i] {
				l.Close()
			}
			return nil, fmt.Errorf("stage %d on %s: %w", i, plan.Stages[i].Node, err)
		}
	}
	drv, err := pipeline.NewDriver(links)
	if err != nil {
		return nil, err
	}
	p.maxInFlight = len(loads)
	if p.handoff {
		p.maxInFlight++
	}
	p.eng, err = newEngine(drv, epoch, sched.Config{
		MaxNumBatchedTokens:  d.cfg.Stage.MaxBatchTokens,
		MaxNumSeqs:           d.cfg.Stage.MaxSeqs,
		BlockSize:            d.cfg.Stage.BlockSize,
		NumBlocks:            blocks,
		MaxConcurrentBatches: p.maxInFlight,
		MaxModelLen:          maxSeqLen,
		OnDeviceHandoff:      p.handoff,
	}, p.graphs.dispatch)
	if err != nil {
		drv.Close()
		return nil, err
	}
	wired = true
	return p, nil
}

// checkActivations refuses a pipeline in which a stage sends activations
// of another element type than the next one receives.
func checkActivations(stages []placement.Stage, loads []*tandemv1.LoadResponse) error {
	for i := 1; i < len(loads); i++ {
		from, to := collective.DType(loads[i-1].GetActDtype()), collective.DType(loads[i].GetActDtype())
		if from != to {
			return fmt.Errorf("stage %d on %s (%s) sends %v activations, stage %d on %s (%s) receives %v: the backends cannot be neighbours",
				i-1, stages[i-1].Node, loads[i-1].GetBackend(), from, i, stages[i].Node, loads[i].GetBackend(), to)
		}
	}
	return nil
}

// planLinks says how every stage's links run: NCCL between two CUDA
// stages, TCP otherwise; with hand-off and several stages, a link from the
// last stage back to the first. The epochs are left to the caller.
func planLinks(loads []*tandemv1.LoadResponse, handoff bool) []*tandemv1.ConnectRequest {
	reqs := make([]*tandemv1.ConnectRequest, len(loads))
	for i := range loads {
		reqs[i] = &tandemv1.ConnectRequest{}
	}
	for i := 0; i+1 < len(loads); i++ {
		t := linkTransport(loads[i].GetBackend(), loads[i+1].GetBackend())
		reqs[i].Next, reqs[i+1].Prev = t, t
		if t == tandemv1.Transport_TRANSPORT_TCP {
			reqs[i].NextDataAddr = loads[i+1].GetDataAddr()
		}
	}
	if last := len(loads) - 1; handoff && last > 0 {
		t := linkTransport(loads[last].GetBackend(), loads[0].GetBackend())
		reqs[last].HandoffOut, reqs[0].HandoffIn = t, t
		if t == tandemv1.Transport_TRANSPORT_TCP {
			reqs[last].HandoffAddr = loads[0].GetHandoffAddr()
		}
	}
	return reqs
}

// pipelineGraphs is how the leader dispatches CUDA graphs on a pipeline.
type pipelineGraphs struct {
	configured graphs.Mode
	downgrades []string // why the mode was reduced
	dispatch   *graphs.Dispatcher
}

// resolveGraphs reduces the configured CUDA-graph mode to what every stage
// supports, logging each reduction, and builds the dispatcher.
func (d *Daemon) resolveGraphs(stages []placement.Stage, loads []*tandemv1.LoadResponse) (*pipelineGraphs, error) {
	sup := make([]graphs.StageSupport, len(loads))
	for i, l := range loads {
		s, err := graphs.ParseSupport(l.GetGraphSupport())
		if err != nil {
			return nil, fmt.Errorf("stage %d on %s: CUDA-graph support: %w", i, stages[i].Node, err)
		}
		sup[i] = graphs.StageSupport{Name: fmt.Sprintf("%d on %s (%s)", i, stages[i].Node, l.GetBackend()), Support: s}
	}
	g := &pipelineGraphs{configured: d.cfg.graphMode()}
	mode, reasons, err := graphs.Resolve(g.configured, 1, sup)
	if err != nil {
		return nil, err
	}
	for _, r := range reasons {
		d.log.Info("CUDA-graph mode downgraded", "reason", r)
	}
	g.downgrades = reasons
	if g.dispatch, err = d.cfg.newDispatcher(mode); err != nil {
		return nil, fmt.Errorf("CUDA-graph dispatcher: %w", err)
	}
	return g, nil
}

// noteRefusedEpoch remembers the epoch a node said it had accepted when it
// refused ours as stale, so the next attempt uses a newer one.
func (d *Daemon) noteRefusedEpoch(err error, trailer metadata.MD) {
	if status.Code(err) != codes.FailedPrecondition {
		return
	}
	for _, v := range trailer.Get(nodewire.EpochTrailer) {
		if e, perr := strconv.ParseUint(v, 10, 64); perr == nil {
			d.mu.Lock()
			d.seenEpoch = max(d.seenEpoch, e)
			d.mu.Unlock()
		}
	}
}

// forEach runs f(0..n-1) concurrently and joins their errors.
func forEach(n int, f func(i int) error) error {
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { errs[i] = f(i) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

func stageSummary(stages []stageState) string {
	s := ""
	for i, st := range stages {
		if i > 0 {
			s += " "
		}
		s += fmt.Sprintf("%s[%d,%d)", st.Node, st.Lo, st.Hi)
	}
	return s
}

// linkTransport is the transport of a link between two stages of the
// given backends.
func linkTransport(from, to string) tandemv1.Transport {
	if from == BackendCUDA && to == BackendCUDA {
		return tandemv1.Transport_TRANSPORT_NCCL
	}
	return tandemv1.Transport_TRANSPORT_TCP
}

// transportName names a transport in status and logs ("" for none).
func transportName(t tandemv1.Transport) string {
	switch t {
	case tandemv1.Transport_TRANSPORT_TCP:
		return "tcp"
	case tandemv1.Transport_TRANSPORT_NCCL:
		return "nccl"
	}
	return ""
}
