package supervise

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"strconv"
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
	"github.com/tandem-llm/tandem/linkauth"
	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/pipeline"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
	"github.com/tandem-llm/tandem/sched"
)

// releaseTimeout bounds the Release calls to the stages of a pipeline
// given up.
const releaseTimeout = 5 * time.Second

// NodeDialer reaches the Node service of a stage node.
type NodeDialer interface {
	// DialNode returns a client of the Node service at addr and a function
	// that closes its connection.
	DialNode(addr string) (tandemv1.NodeClient, io.Closer, error)
}

// BuilderConfig is what a Builder builds pipelines with.
type BuilderConfig struct {
	// Leader is this node's name, sent with Load.
	Leader  string
	Model   *model.Config
	ModelID string
	// The batch bounds and KV block size every stage is loaded with.
	MaxBatchTokens, MaxSeqs, BlockSize int
	// Handoff asks for on-device hand-off when the first stage takes it.
	Handoff bool
	// Admission is the scheduler's admission policy for every pipeline:
	// its MaxNumWaiting, GrowthReserve and MaxPreemptions (zero: the
	// scheduler's defaults); its other fields are ignored.
	Admission sched.Config
	// GraphMode is the configured CUDA-graph mode, reduced to what every
	// stage supports; NewDispatcher builds the dispatcher of the resolved
	// mode.
	GraphMode     graphs.Mode
	NewDispatcher func(graphs.Mode) (*graphs.Dispatcher, error)
	Nodes         NodeDialer
	// Credential is the cluster credential: the control links prove they
	// come from the leader with it (nil: none, on loopback or with
	// --insecure).
	Credential *linkauth.Credential
	// DialLink dials a stage's control link as cfg says (nil: cfg.Dial).
	DialLink func(ctx context.Context, cfg pipeline.ControlConfig, addr string) (pipeline.Link, error)
	// StepTimeout fails a step whose result does not come within it (0:
	// none); see pipeline.DriverOptions.
	StepTimeout time.Duration
	// Counters are given to every pipeline's scheduler configuration
	// (sched.Config.Counters): counts for the life of the process.
	Counters *sched.Counters
	// GraphSteps, when set, counts the CUDA-graph dispatches of every
	// pipeline, for the life of the process (each Pipeline's Steps counts
	// its own).
	GraphSteps *graphs.Stats
	// Observer returns the observer of the driver of the pipeline of
	// epoch over nodes, in stage order (nil: none); see
	// pipeline.DriverOptions.
	Observer func(epoch uint64, nodes []string) pipeline.Observer
	Log      *slog.Logger
}

// Builder builds pipelines: it has every stage node of a plan load its
// layers, capture the CUDA graphs the leader will dispatch and connect to
// its neighbours, and dials the stages' control links.
type Builder struct{ cfg BuilderConfig }

// NewBuilder returns a builder; it starts nothing.
func NewBuilder(cfg BuilderConfig) *Builder {
	if cfg.DialLink == nil {
		cfg.DialLink = func(ctx context.Context, c pipeline.ControlConfig, addr string) (pipeline.Link, error) {
			return c.Dial(ctx, addr)
		}
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	return &Builder{cfg: cfg}
}

// Pipeline is a built pipeline: its stages, wired, and the leader's driver
// over their control links.
type Pipeline struct {
	Epoch   uint64
	Stages  []Stage
	Graphs  *Graphs
	Handoff bool // on-device hand-off is on
	// MaxInFlight is the steps the scheduler keeps in flight; Sched the
	// scheduler's configuration for this pipeline.
	MaxInFlight int
	Sched       sched.Config
	// KVTokens is the pipeline's KV capacity: blocks × block size.
	KVTokens int
	// Steps counts the CUDA-graph dispatches of its steps.
	Steps *graphs.Stats

	drv *pipeline.Driver
	ex  *stepExecutor
}

// Stage is one stage of a built pipeline.
type Stage struct {
	placement.Stage
	Member   membership.Member
	Load     *tandemv1.LoadResponse    // what the stage reported loading
	Capture  *tandemv1.CaptureResponse // its CUDA graphs (nil: none)
	NextLink string                    // transport to the next stage
	KVTokens int                       // the stage's KV capacity as it reported it
	// Reused: the node kept this stage from the pipeline before (same
	// layers): nothing was reloaded.
	Reused bool
}

// Graphs is how the leader dispatches CUDA graphs on a pipeline.
type Graphs struct {
	Configured graphs.Mode
	Downgrades []string // why the mode was reduced
	Dispatch   *graphs.Dispatcher
}

// BuildError is why a build failed.
type BuildError struct {
	// Nodes are the nodes whose calls failed.
	Nodes []string
	// RefusedEpoch is the newest epoch a node said it had accepted when it
	// refused the build's as stale (0: none).
	RefusedEpoch uint64
	Err          error
}

func (e *BuildError) Error() string { return e.Err.Error() }
func (e *BuildError) Unwrap() error { return e.Err }

// build is one build under way.
type build struct {
	*Builder
	epoch     uint64
	plan      placement.Plan
	alongside bool
	nodes     []tandemv1.NodeClient
	mu        sync.Mutex
	failed    map[string]bool
	refused   uint64
}

// fail records that stage i's node failed a call, and returns err. A
// node that refused our epoch as stale (naming the epoch it accepted) is
// not at fault: the next build uses a newer epoch.
func (b *build) fail(i int, err error, trailer metadata.MD) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if status.Code(err) == codes.PermissionDenied {
		// The node's membership does not (yet) name this leader: the
		// views converge, and the next build retries.
		return err
	}
	if status.Code(err) == codes.FailedPrecondition {
		for _, v := range trailer.Get(nodewire.EpochTrailer) {
			if e, perr := strconv.ParseUint(v, 10, 64); perr == nil {
				b.refused = max(b.refused, e)
				return err
			}
		}
	}
	b.failed[b.plan.Stages[i].Node] = true
	return err
}

// Build builds the pipeline of a.Plan at a.Epoch over a.Members (the
// plan's nodes, for their addresses), alongside the serving pipeline when
// a.Alongside says so. On failure it releases what was loaded and returns
// a *BuildError naming the nodes that failed.
func (bl *Builder) Build(ctx context.Context, a Build) (*Pipeline, error) {
	b := &build{Builder: bl, epoch: a.Epoch, plan: a.Plan, alongside: a.Alongside, failed: map[string]bool{}}
	p, err := b.run(ctx, a.Members)
	if err != nil {
		be := &BuildError{Err: err, RefusedEpoch: b.refused}
		for _, s := range a.Plan.Stages {
			if b.failed[s.Node] {
				be.Nodes = append(be.Nodes, s.Node)
			}
		}
		return nil, be
	}
	return p, nil
}

func (b *build) run(ctx context.Context, members []membership.Member) (*Pipeline, error) {
	cfg := &b.cfg
	byName := map[string]membership.Member{}
	for _, m := range members {
		byName[m.Name] = m
	}
	p := &Pipeline{Epoch: b.epoch, Steps: &graphs.Stats{}}
	closers := make([]io.Closer, len(b.plan.Stages))
	defer func() {
		for _, c := range closers {
			if c != nil {
				c.Close()
			}
		}
	}()
	b.nodes = make([]tandemv1.NodeClient, len(b.plan.Stages))
	for i, s := range b.plan.Stages {
		m, ok := byName[s.Node]
		if !ok {
			return nil, b.fail(i, fmt.Errorf("stage %d on %s: not a member", i, s.Node), nil)
		}
		p.Stages = append(p.Stages, Stage{Stage: s, Member: m})
		var err error
		if b.nodes[i], closers[i], err = cfg.Nodes.DialNode(m.Meta.GRPCAddr); err != nil {
			return nil, b.fail(i, fmt.Errorf("stage %d on %s: %w", i, s.Node, err), nil)
		}
	}
	wired := false
	defer func() {
		if !wired {
			b.release(context.WithoutCancel(ctx))
		}
	}()
	// A stage's max seqs bounds both a step's sequences and the first
	// stage's hand-off slots, one per running request: with hand-off over
	// p stages, p groups of up to MaxSeqs requests take turns, so the
	// stages hold p·MaxSeqs (the scheduler still puts at most MaxSeqs in a
	// step).
	loadSeqs := cfg.MaxSeqs
	if cfg.Handoff && len(b.nodes) > 1 {
		loadSeqs *= len(b.nodes)
	}
	loads := make([]*tandemv1.LoadResponse, len(b.nodes))
	err := forEach(len(b.nodes), func(i int) error {
		s := b.plan.Stages[i]
		var trailer metadata.MD
		resp, err := b.nodes[i].Load(ctx, &tandemv1.LoadRequest{
			Epoch: b.epoch, Leader: cfg.Leader, ModelId: cfg.ModelID, Index: uint32(i),
			LayerLo: uint32(s.Lo), LayerHi: uint32(s.Hi),
			MaxBatchTokens: uint32(cfg.MaxBatchTokens), MaxSeqs: uint32(loadSeqs), BlockSize: uint32(cfg.BlockSize),
			Handoff: cfg.Handoff, Alongside: b.alongside,
		}, grpc.Trailer(&trailer))
		if err != nil {
			return b.fail(i, fmt.Errorf("stage %d on %s: load layers [%d, %d): %w", i, s.Node, s.Lo, s.Hi, err), trailer)
		}
		if resp.GetModelId() != cfg.ModelID {
			return b.fail(i, fmt.Errorf("stage %d on %s: loaded model %s, want %s", i, s.Node, nodewire.Short(resp.GetModelId()), nodewire.Short(cfg.ModelID)), nil)
		}
		loads[i] = resp
		return nil
	})
	if err != nil {
		return nil, err
	}
	if err := checkActivations(b.plan.Stages, loads); err != nil {
		return nil, err
	}
	maxSeqLen, blocks := cfg.Model.MaxPositions, math.MaxInt32
	for i, l := range loads {
		p.Stages[i].Load = l
		p.Stages[i].KVTokens = int(l.GetKvBlocks()) * cfg.BlockSize
		p.Stages[i].Reused = l.GetReused()
		blocks = min(blocks, int(l.GetKvBlocks()))
		if int(l.GetMaxSeqLen()) < p.Stages[i].KVTokens {
			// A bound of the stage's besides its KV cache, which the
			// scheduler checks on its own, naming it.
			maxSeqLen = min(maxSeqLen, int(l.GetMaxSeqLen()))
		}
	}
	if p.Graphs, err = b.resolveGraphs(loads); err != nil {
		return nil, err
	}
	if keys := p.Graphs.Dispatch.Keys(); len(keys) > 0 {
		req := &tandemv1.CaptureRequest{Epoch: b.epoch, Keys: nodewire.EncodeGraphKeys(keys)}
		err = forEach(len(b.nodes), func(i int) error {
			r, err := b.nodes[i].Capture(ctx, req)
			if err != nil {
				return b.fail(i, fmt.Errorf("stage %d on %s: capture %d CUDA graph keys: %w", i, b.plan.Stages[i].Node, len(keys), err), nil)
			}
			p.Stages[i].Capture = r
			return nil
		})
		if err != nil {
			return nil, err
		}
	}
	p.Handoff = cfg.Handoff && loads[0].GetHandoffReceiver()
	wiring := planLinks(loads, p.Handoff)
	conn := make([]*tandemv1.ConnectResponse, len(b.nodes))
	err = forEach(len(b.nodes), func(i int) error {
		req := wiring[i]
		req.Epoch = b.epoch
		r, err := b.nodes[i].Connect(ctx, req)
		if err != nil {
			return b.fail(i, fmt.Errorf("stage %d on %s: connect its links: %w", i, b.plan.Stages[i].Node, err), nil)
		}
		conn[i] = r
		return nil
	})
	if err != nil {
		return nil, err
	}
	last := len(b.nodes) - 1
	err = forEach(len(b.nodes), func(i int) error {
		req := &tandemv1.JoinRequest{Epoch: b.epoch}
		if i > 0 {
			req.PrevNcclId = conn[i-1].GetNextNcclId()
		}
		if i == 0 && last > 0 {
			req.HandoffNcclId = conn[last].GetHandoffNcclId()
		}
		if len(req.PrevNcclId) == 0 && len(req.HandoffNcclId) == 0 {
			return nil
		}
		if _, err := b.nodes[i].Join(ctx, req); err != nil {
			return b.fail(i, fmt.Errorf("stage %d on %s: join its NCCL links: %w", i, b.plan.Stages[i].Node, err), nil)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	for i := range p.Stages {
		p.Stages[i].NextLink = transportName(wiring[i].GetNext())
	}
	links := make([]pipeline.Link, len(loads))
	for i, l := range loads {
		ctl := pipeline.ControlConfig{Link: nodewire.ControlLink(b.plan.Stages[i].Node), Epoch: b.epoch, Credential: cfg.Credential, Logger: cfg.Log}
		if links[i], err = cfg.DialLink(ctx, ctl, l.GetControlAddr()); err != nil {
			for _, l := range links[:i] {
				l.Close()
			}
			return nil, b.fail(i, fmt.Errorf("stage %d on %s: %w", i, b.plan.Stages[i].Node, err), nil)
		}
	}
	dopts := pipeline.DriverOptions{StepTimeout: cfg.StepTimeout}
	if cfg.Observer != nil {
		nodes := make([]string, len(p.Stages))
		for i := range p.Stages {
			nodes[i] = p.Stages[i].Node
		}
		dopts.Observer = cfg.Observer(b.epoch, nodes)
	}
	if p.drv, err = dopts.New(links); err != nil {
		return nil, err
	}
	p.MaxInFlight = len(loads)
	if p.Handoff {
		p.MaxInFlight++
	}
	p.KVTokens = blocks * cfg.BlockSize
	p.Sched = sched.Config{
		MaxNumBatchedTokens:  cfg.MaxBatchTokens,
		MaxNumSeqs:           cfg.MaxSeqs,
		BlockSize:            cfg.BlockSize,
		NumBlocks:            blocks,
		MaxConcurrentBatches: p.MaxInFlight,
		MaxModelLen:          maxSeqLen,
		OnDeviceHandoff:      p.Handoff,
		Counters:             cfg.Counters,
		MaxNumWaiting:        cfg.Admission.MaxNumWaiting,
		GrowthReserve:        cfg.Admission.GrowthReserve,
		MaxPreemptions:       cfg.Admission.MaxPreemptions,
	}
	if p.Handoff {
		p.Sched.HandoffSlots = loadSeqs
	}
	p.ex = &stepExecutor{Driver: p.drv, epoch: b.epoch, dispatch: p.Graphs.Dispatch, stats: p.Steps, total: cfg.GraphSteps}
	wired = true
	return p, nil
}

// release releases every stage of the build, concurrently, each within
// releaseTimeout.
func (b *build) release(ctx context.Context) {
	forEach(len(b.nodes), func(i int) error {
		if b.nodes[i] == nil {
			return nil
		}
		rctx, cancel := context.WithTimeout(ctx, releaseTimeout)
		defer cancel()
		if _, err := b.nodes[i].Release(rctx, &tandemv1.ReleaseRequest{Epoch: b.epoch}); err != nil {
			b.cfg.Log.Debug("release a stage", "stage", i, "node", b.plan.Stages[i].Node, "epoch", b.epoch, "err", err)
		}
		return nil
	})
}

// Release releases the stages of a pipeline that stopped, concurrently,
// so that a stage still waiting on a link (an NCCL transfer whose peer is
// gone) gives its assignment up now rather than when the next pipeline
// replaces it. A stage already on a newer epoch refuses: nothing to do.
func (bl *Builder) Release(ctx context.Context, p *Pipeline) {
	b := &build{Builder: bl, epoch: p.Epoch, nodes: make([]tandemv1.NodeClient, len(p.Stages))}
	for _, s := range p.Stages {
		b.plan.Stages = append(b.plan.Stages, s.Stage)
	}
	var closers []io.Closer
	for i, s := range p.Stages {
		n, c, err := bl.cfg.Nodes.DialNode(s.Member.Meta.GRPCAddr)
		if err != nil {
			bl.cfg.Log.Debug("release a stage", "stage", i, "node", s.Node, "epoch", p.Epoch, "err", err)
			continue
		}
		b.nodes[i] = n
		closers = append(closers, c)
	}
	b.release(ctx)
	for _, c := range closers {
		c.Close()
	}
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

// linkTransport is the transport of a link between two stages of the
// given backends.
func linkTransport(from, to string) tandemv1.Transport {
	if from == membership.BackendCUDA && to == membership.BackendCUDA {
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

// resolveGraphs reduces the configured CUDA-graph mode to what every stage
// supports, logging each reduction, and builds the dispatcher.
func (b *build) resolveGraphs(loads []*tandemv1.LoadResponse) (*Graphs, error) {
	sup := make([]graphs.StageSupport, len(loads))
	for i, l := range loads {
		s, err := graphs.ParseSupport(l.GetGraphSupport())
		if err != nil {
			return nil, fmt.Errorf("stage %d on %s: CUDA-graph support: %w", i, b.plan.Stages[i].Node, err)
		}
		sup[i] = graphs.StageSupport{Name: fmt.Sprintf("%d on %s (%s)", i, b.plan.Stages[i].Node, l.GetBackend()), Support: s}
	}
	g := &Graphs{Configured: b.cfg.GraphMode}
	mode, reasons, err := graphs.Resolve(g.Configured, 1, sup)
	if err != nil {
		return nil, err
	}
	for _, r := range reasons {
		b.cfg.Log.Info("CUDA-graph mode downgraded", "reason", r)
	}
	g.Downgrades = reasons
	if g.Dispatch, err = b.cfg.NewDispatcher(mode); err != nil {
		return nil, fmt.Errorf("CUDA-graph dispatcher: %w", err)
	}
	return g, nil
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
