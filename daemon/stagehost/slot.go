package stagehost

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/collective/nccl"
	"github.com/tandem-llm/tandem/daemon/apierr"
	"github.com/tandem-llm/tandem/daemon/nodewire"
	"github.com/tandem-llm/tandem/daemon/placement"
	"github.com/tandem-llm/tandem/linkauth"
	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/pipeline"
	"github.com/tandem-llm/tandem/progress"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
	"github.com/tandem-llm/tandem/stage"
)

// wireTimeout bounds how long an assigned stage waits for its peers and
// the leader's control connection after Load.
const wireTimeout = time.Minute

// Config is what a Slot serves with.
type Config struct {
	// Name is the node's name, in messages and logs.
	Name       string
	Checkpoint *model.Checkpoint
	// Device is what stages run on; Usable the memory a stage may use
	// (weights, workspace, KV cache: besides GraphMemory).
	Device *Device
	Usable uint64
	// CacheDir, GraphMemory and CompensatedTokens configure CUDA stages:
	// the compiled kernel cache, the device memory held back for CUDA
	// graphs and cuda.Config.CompensatedTokens.
	CacheDir          string
	GraphMemory       int64
	CompensatedTokens int
	// ControlAddr and DataAddr are the listen addresses of a stage's
	// control link from the leader and of the TCP link coming in;
	// Advertise, when set, is the host other nodes reach them at.
	ControlAddr, DataAddr, Advertise string
	// Cost is what a stage of a backend holds for the batch bounds, as
	// placement counts it: Load sizes the KV cache with it.
	Cost func(backend string, maxBatchTokens, maxSeqs int) placement.Cost
	// Credential is the cluster credential the stage's links prove
	// themselves with (nil: none; see auth.go).
	Credential *linkauth.Credential
	// OnServing is called when a stage starts and stops serving (nil:
	// not called).
	OnServing func(serving bool)
	Log       *slog.Logger
	// Progress shows how loading a stage's weights, compiling its kernels
	// and capturing its graphs advance (nil: structured lines to Log).
	Progress *progress.Reporter
	// WrapStage, when set, wraps each stage before its pipeline worker
	// runs it (a test seam: an emulated device around a CPU stage).
	WrapStage func(stage.Stage) stage.Stage
}

// Slot is this node's place in a pipeline: it implements the Node
// service, loading the layer range the leader assigns and serving it as a
// pipeline worker until the leader closes the control link, a newer epoch
// replaces it, or the slot stops.
type Slot struct {
	tandemv1.UnimplementedNodeServer
	cfg Config
	log *slog.Logger

	ctx  context.Context // the slot's lifetime
	stop context.CancelFunc
	wg   sync.WaitGroup // assignment goroutines

	mu     sync.Mutex    // serializes the Node calls
	epoch  uint64        // newest accepted
	newest atomic.Uint64 // epoch, read without mu
	live   []*assignment // not released, oldest first: the newest, and the one serving kept beside it while the pipeline moves

	servingMu sync.Mutex
	serving   int // assignments whose worker runs
}

// New returns a slot that holds no stage yet; it starts nothing. Stop ends
// it.
func New(cfg Config) *Slot {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.OnServing == nil {
		cfg.OnServing = func(bool) {}
	}
	if cfg.Progress == nil {
		cfg.Progress = progress.New(progress.Config{Mode: progress.Log, Log: cfg.Log})
	}
	ctx, stop := context.WithCancel(context.Background())
	return &Slot{cfg: cfg, log: cfg.Log, ctx: ctx, stop: stop}
}

// assignment is this node's stage in the pipeline of one epoch.
type assignment struct {
	epoch  uint64
	index  int
	hs     *heldStage // the stage, which it may share with the assignment before
	st     stage.Stage
	info   stage.Info
	move   *progress.Task // the node's stage moving to this assignment (nil: its first)
	ctlLn  *pipeline.ControlListener
	dataLn *collective.Listener // the TCP link coming in: activations, or the hand-off into the first stage
	// The links, as Connect describes them. Connect sets next and
	// handoffOut (TCP) or the NCCL joins of the links this stage sends on;
	// Join sets prev and handoffIn when they are NCCL; the assignment's
	// goroutine accepts a TCP link coming in.
	prevT, nextT, hoInT, hoOutT tandemv1.Transport
	next, handoffOut            collective.Sender
	prev, handoffIn             collective.Receiver
	nextJoin, hoOutJoin         *ncclJoin
	connect                     chan struct{}   // closed by Connect
	joined                      chan struct{}   // closed by Join
	ctx                         context.Context // cancelled when the assignment ends
	cancel                      context.CancelFunc
	done                        chan struct{} // closed when the assignment's goroutine returns
	working                     atomic.Bool   // its worker runs: it serves a pipeline

	mu      sync.Mutex
	closers []io.Closer // the links, closed by closeAll
}

// checkEpoch refuses an epoch older than the newest accepted.
func (s *Slot) checkEpoch(ctx context.Context, epoch uint64) error {
	if epoch >= s.epoch {
		return nil
	}
	grpc.SetTrailer(ctx, metadata.Pairs(nodewire.EpochTrailer, fmt.Sprint(s.epoch)))
	return apierr.Preconditionf("stale leader epoch %d: node %s has accepted epoch %d", epoch, s.cfg.Name, s.epoch)
}

// Load implements tandem.v1.Node.
func (s *Slot) Load(ctx context.Context, in *tandemv1.LoadRequest) (*tandemv1.LoadResponse, error) {
	resp, err := s.load(ctx, in)
	return resp, apierr.GRPC(err)
}

func (s *Slot) load(ctx context.Context, in *tandemv1.LoadRequest) (*tandemv1.LoadResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.checkEpoch(ctx, in.GetEpoch()); err != nil {
		return nil, err
	}
	if in.GetModelId() != s.cfg.Checkpoint.Identity() {
		return nil, apierr.Preconditionf("node %s has model %s (%s), the leader %s serves %s", s.cfg.Name, nodewire.Short(s.cfg.Checkpoint.Identity()), s.cfg.Checkpoint.Dir(), in.GetLeader(), nodewire.Short(in.GetModelId()))
	}
	cfg := s.cfg.Checkpoint.Config()
	sp := stageSpec{lo: int(in.GetLayerLo()), hi: int(in.GetLayerHi()), maxTokens: int(in.GetMaxBatchTokens()), maxSeqs: int(in.GetMaxSeqs()), blockSize: int(in.GetBlockSize())}
	if sp.lo >= sp.hi || sp.hi > cfg.NumLayers {
		return nil, apierr.Invalidf("layers [%d, %d): the model has layers [0, %d)", sp.lo, sp.hi, cfg.NumLayers)
	}
	if sp.maxTokens == 0 || sp.maxSeqs == 0 || sp.blockSize == 0 {
		return nil, apierr.Invalidf("max_batch_tokens %d, max_seqs %d and block_size %d: want at least 1", sp.maxTokens, sp.maxSeqs, sp.blockSize)
	}
	cost := s.cfg.Cost(s.cfg.Device.Backend, sp.maxTokens, sp.maxSeqs)
	kv, err := cost.StageKVTokens(s.cfg.Usable, sp.lo, sp.hi)
	if err != nil {
		return nil, apierr.Preconditionf("node %s: %v", s.cfg.Name, err)
	}
	// The memory's worth of blocks, but no more than every sequence of a
	// full batch at the model's context length needs.
	estimate := kv / sp.blockSize
	sp.blocks = placement.UsableKVTokens(cfg, sp.maxSeqs, sp.blockSize) / sp.blockSize
	if min(estimate, sp.blocks) < 1 {
		return nil, apierr.Preconditionf("node %s: layers [%d, %d) leave room for %d tokens of KV cache, less than a block of %d", s.cfg.Name, sp.lo, sp.hi, kv, sp.blockSize)
	}
	if err := s.cfg.Checkpoint.CheckLayers(sp.lo, sp.hi, sp.lo == 0, sp.hi == cfg.NumLayers); err != nil {
		return nil, fmt.Errorf("node %s: %w", s.cfg.Name, err)
	}
	if s.cfg.Device.Backend != BackendCUDA {
		sp.blocks = min(sp.blocks, estimate)
	}
	hs, kept, prev := s.place(sp, in.GetAlongside(), cost)
	s.epoch = in.GetEpoch()
	s.newest.Store(s.epoch)
	move := s.startMove(prev, sp, hs != nil, kept != nil, in.GetEpoch())
	if hs == nil {
		steps := s.cfg.Progress.Steps(progress.Count, "node", s.cfg.Name, "layers", fmt.Sprintf("[%d,%d)", sp.lo, sp.hi))
		st, err := s.newStage(cfg, sp, estimate, steps)
		if err != nil {
			err = fmt.Errorf("node %s: load layers [%d, %d) on %s: %w", s.cfg.Name, sp.lo, sp.hi, s.cfg.Device.Backend, err)
			move.End(err)
			return nil, err
		}
		info := st.Info()
		if info.KVBlocks > 0 {
			sp.blocks = info.KVBlocks
		}
		hs = &heldStage{st: st, info: info, spec: sp, epoch: in.GetEpoch(), steps: steps}
		hs.hold()
		if s.cfg.Device.Backend != BackendCUDA {
			hs.bytes = cost.StageBytes(sp.lo, sp.hi, sp.blocks*sp.blockSize)
		}
		hs.resp = &tandemv1.LoadResponse{
			Backend: info.Backend, ModelId: s.cfg.Checkpoint.Identity(),
			KvBlocks: uint64(sp.blocks), MaxSeqLen: uint32(sp.maxSeqLen(cfg)), GraphSupport: info.Graphs.String(), ActDtype: uint32(info.ActDType),
			Device: s.cfg.Device.Name,
		}
		hs.resp.WeightBytes, hs.resp.WorkspaceBytes, hs.resp.KvBytes, hs.resp.GraphBytes = stageMemory(st)
	}
	move.Set(1, moveSteps)
	info := hs.info
	a := &assignment{epoch: in.GetEpoch(), index: int(in.GetIndex()), hs: hs, st: hs.st, info: info, move: move, connect: make(chan struct{}), joined: make(chan struct{}), done: make(chan struct{})}
	a.ctx, a.cancel = context.WithCancel(s.ctx)
	hs.mu.Lock()
	if hs.active == nil {
		hs.active = a
	}
	hs.mu.Unlock()
	fail := func(err error) (*tandemv1.LoadResponse, error) {
		a.closeAll()
		move.End(err)
		return nil, err
	}
	if a.ctlLn, err = s.controlConfig(a.epoch).Listen(s.cfg.ControlAddr); err != nil {
		return fail(fmt.Errorf("node %s: %w", s.cfg.Name, err))
	}
	_, receiver := hs.st.(stage.HandoffReceiver)
	resp := proto.Clone(hs.resp).(*tandemv1.LoadResponse)
	resp.ControlAddr = nodewire.Advertised(a.ctlLn.Addr(), s.cfg.Advertise)
	resp.HandoffReceiver = info.First && receiver
	resp.Reused = hs.epoch != in.GetEpoch()
	resp.Alongside = kept != nil
	// The one TCP link that may come in: the previous stage's activations,
	// or, into a first stage of several, the last stage's hand-off.
	link := ""
	switch {
	case !info.First:
		link = dataLink(sp.lo)
	case !info.Last && in.GetHandoff() && resp.HandoffReceiver:
		link = handoffLink
	}
	if link != "" {
		if a.dataLn, err = s.listenConfig(link, a.epoch).Listen(s.cfg.DataAddr); err != nil {
			return fail(fmt.Errorf("node %s: %w", s.cfg.Name, err))
		}
		addr := nodewire.Advertised(a.dataLn.Addr().String(), s.cfg.Advertise)
		if info.First {
			resp.HandoffAddr = addr
		} else {
			resp.DataAddr = addr
		}
	}
	s.live = append(s.live, a)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.serve(a)
	}()
	s.log.Info("stage loaded", "epoch", a.epoch, "index", a.index, "layers", fmt.Sprintf("[%d,%d)", sp.lo, sp.hi), "backend", info.Backend,
		"leader", in.GetLeader(), "kv_blocks", resp.KvBlocks, "block_size", sp.blockSize, "graphs", info.Graphs, "weight_bytes", resp.WeightBytes,
		"workspace_bytes", resp.WorkspaceBytes, "reused", resp.Reused, "alongside", resp.Alongside)
	return resp, nil
}

// place decides, for a new assignment of sp, what this node keeps: a
// stage of the same layers and bounds to reuse (hs, nil: none; held for
// the new assignment), and with
// alongside the assignment serving the current pipeline, kept running
// until the new one takes over or is released (kept, nil: none). The
// serving one stays only when the node's memory holds it and the new
// stage both (a reused stage costs nothing more; a CUDA stage sizes its
// KV cache from the device's free memory, so a new one is never loaded
// beside another). Every other assignment is released. prev is the layer
// range the node held last ("" when none). s.mu is held.
func (s *Slot) place(sp stageSpec, alongside bool, cost placement.Cost) (hs *heldStage, kept *assignment, prev string) {
	var serving *assignment
	for _, a := range s.live {
		if a.ended() {
			continue
		}
		prev = fmt.Sprintf("[%d,%d)", a.info.Lo, a.info.Hi)
		if a.hs.reusable(sp) {
			hs = a.hs
		}
		if a.working.Load() {
			serving = a
		}
	}
	if alongside && serving != nil {
		switch {
		case hs == serving.hs:
			kept = serving
		case hs == nil && s.cfg.Device.Backend != BackendCUDA && serving.hs.bytes > 0 &&
			serving.hs.bytes+cost.StageBytes(sp.lo, sp.hi, sp.blocks*sp.blockSize) <= s.cfg.Usable:
			kept = serving
		}
	}
	if hs != nil {
		hs.hold() // the new assignment's, taken before the releases below
	}
	for _, a := range s.live {
		if a != kept {
			s.end(a)
		}
	}
	s.live = s.live[:0]
	if kept != nil {
		s.live = append(s.live, kept)
	}
	return hs, kept, prev
}

// startMove shows this node's stage moving to the assignment of epoch,
// from its range prev ("" when it held none: nothing to show): reusing its
// stage or loading the new one (beside the old, or after releasing it),
// wiring it, and switching at its first step. The task ends there.
func (s *Slot) startMove(prev string, sp stageSpec, reused, alongside bool, epoch uint64) *progress.Task {
	if prev == "" {
		return nil
	}
	to := fmt.Sprintf("[%d,%d)", sp.lo, sp.hi)
	how := "released the old stage first"
	switch {
	case reused:
		how = "weights reused"
	case alongside:
		how = "loading beside the old stage"
	}
	name := fmt.Sprintf("move layers %s -> %s", prev, to)
	if reused && prev == to {
		name = fmt.Sprintf("keep layers %s", to)
	}
	return s.cfg.Progress.Start(name, progress.Count, moveSteps, "node", s.cfg.Name, "epoch", epoch, "how", how)
}

// moveSteps are the steps of a stage's move: load (or reuse), wire,
// switch.
const moveSteps = 3

// current is the assignment of epoch, checked to be running. s.mu is held.
func (s *Slot) current(ctx context.Context, epoch uint64) (*assignment, error) {
	if err := s.checkEpoch(ctx, epoch); err != nil {
		return nil, err
	}
	a := s.find(epoch)
	if a == nil || a.ended() {
		return nil, apierr.Preconditionf("node %s has no stage of epoch %d", s.cfg.Name, epoch)
	}
	return a, nil
}

// find is the live assignment of epoch (nil: none). s.mu is held.
func (s *Slot) find(epoch uint64) *assignment {
	for _, a := range s.live {
		if a.epoch == epoch {
			return a
		}
	}
	return nil
}

// Capture implements tandem.v1.Node: the stage captures the CUDA graphs of
// the leader's dispatcher keys, before it is connected.
func (s *Slot) Capture(ctx context.Context, in *tandemv1.CaptureRequest) (*tandemv1.CaptureResponse, error) {
	resp, err := s.capture(ctx, in)
	return resp, apierr.GRPC(err)
}

func (s *Slot) capture(ctx context.Context, in *tandemv1.CaptureRequest) (*tandemv1.CaptureResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	a, err := s.current(ctx, in.GetEpoch())
	if err != nil {
		return nil, err
	}
	if a.connected() {
		return nil, apierr.Preconditionf("node %s: capture after Connect: the stage of epoch %d is already wired", s.cfg.Name, a.epoch)
	}
	keys, err := nodewire.DecodeGraphKeys(in.GetKeys())
	if err != nil {
		return nil, apierr.Invalidf("%v", err)
	}
	c, ok := a.st.(capturer)
	if !ok {
		return nil, apierr.Preconditionf("node %s: the %s stage captures no CUDA graphs (it supports %s)", s.cfg.Name, a.info.Backend, a.info.Graphs)
	}
	hs := a.hs
	switch {
	case hs.sameGraphs(keys):
		// A reused stage: its graphs are the ones asked for.
		return proto.Clone(hs.capture).(*tandemv1.CaptureResponse), nil
	case hs.captured != nil || hs.users.Load() > 1:
		// Graphs of other keys, or a stage the pipeline before still runs
		// steps on: it cannot capture now. Not reused again: the next
		// build loads a stage of its own.
		hs.noReuse = true
		return nil, apierr.Preconditionf("node %s: the stage of layers [%d, %d) reused from epoch %d cannot capture these %d CUDA graph keys (its graphs are for other keys, or it still serves); the next build loads a new stage",
			s.cfg.Name, a.info.Lo, a.info.Hi, hs.epoch, len(keys))
	}
	err = c.Capture(keys)
	hs.steps.End(err)
	if err != nil {
		hs.noReuse = true
		return nil, fmt.Errorf("node %s: capture %d CUDA graph keys: %w", s.cfg.Name, len(keys), err)
	}
	r := c.Graphs()
	s.log.Info("CUDA graphs captured", "epoch", a.epoch, "keys", r.Keys, "graphs", r.Graphs, "nodes", r.Nodes, "memory_bytes", max(r.Bytes, 0), "time", r.CaptureTime)
	hs.captured = slices.Clone(keys)
	hs.capture = &tandemv1.CaptureResponse{Graphs: uint32(r.Graphs), Nodes: uint64(r.Nodes), GraphBytes: uint64(max(r.Bytes, 0)), CaptureTime: durationpb.New(r.CaptureTime)}
	return proto.Clone(hs.capture).(*tandemv1.CaptureResponse), nil
}

// Connect implements tandem.v1.Node.
func (s *Slot) Connect(ctx context.Context, in *tandemv1.ConnectRequest) (*tandemv1.ConnectResponse, error) {
	resp, err := s.connectLinks(ctx, in)
	return resp, apierr.GRPC(err)
}

func (s *Slot) connectLinks(ctx context.Context, in *tandemv1.ConnectRequest) (*tandemv1.ConnectResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	a, err := s.current(ctx, in.GetEpoch())
	if err != nil {
		return nil, err
	}
	if a.connected() {
		return nil, apierr.Preconditionf("node %s: the stage of epoch %d is already connected", s.cfg.Name, a.epoch)
	}
	info := a.info
	none := tandemv1.Transport_TRANSPORT_NONE
	switch {
	case info.Last != (in.GetNext() == none):
		return nil, apierr.Invalidf("next link %s: stage %d is %s", in.GetNext(), a.index, position(info.Last, "the last", "not the last"))
	case info.First != (in.GetPrev() == none):
		return nil, apierr.Invalidf("previous link %s: stage %d is %s", in.GetPrev(), a.index, position(info.First, "the first", "not the first"))
	case in.GetHandoffOut() != none && (!info.Last || info.First):
		return nil, apierr.Invalidf("hand-off link out of stage %d, which is not the last of several", a.index)
	case in.GetHandoffIn() != none && (!info.First || info.Last):
		return nil, apierr.Invalidf("hand-off link into stage %d, which is not the first of several", a.index)
	case in.GetHandoffIn() == tandemv1.Transport_TRANSPORT_TCP && (a.dataLn == nil || info.Last):
		return nil, apierr.Invalidf("TCP hand-off link into stage %d, which was not loaded for hand-off", a.index)
	case (in.GetNext() == tandemv1.Transport_TRANSPORT_TCP) != (in.GetNextDataAddr() != ""):
		return nil, apierr.Invalidf("next link %s with data address %q: a TCP link needs the address, no other does", in.GetNext(), in.GetNextDataAddr())
	case (in.GetHandoffOut() == tandemv1.Transport_TRANSPORT_TCP) != (in.GetHandoffAddr() != ""):
		return nil, apierr.Invalidf("hand-off link %s with address %q: a TCP link needs the address, no other does", in.GetHandoffOut(), in.GetHandoffAddr())
	}
	for _, t := range []tandemv1.Transport{in.GetNext(), in.GetPrev(), in.GetHandoffOut(), in.GetHandoffIn()} {
		if t == tandemv1.Transport_TRANSPORT_NCCL {
			if _, ok := a.st.(gpuStage); !ok {
				return nil, apierr.Invalidf("NCCL link for the %s stage %d: NCCL links join CUDA stages", info.Backend, a.index)
			}
		}
	}
	a.prevT, a.nextT, a.hoInT, a.hoOutT = in.GetPrev(), in.GetNext(), in.GetHandoffIn(), in.GetHandoffOut()
	resp := &tandemv1.ConnectResponse{}
	dctx, cancel := context.WithTimeout(ctx, wireTimeout)
	defer cancel()
	// A failed Connect ends the assignment: its goroutine closes what was
	// made.
	fail := func(err error) (*tandemv1.ConnectResponse, error) {
		a.cancel()
		return nil, err
	}
	if a.nextT == tandemv1.Transport_TRANSPORT_TCP {
		next, err := s.dialConfig(dataLink(info.Hi), a.epoch).Dial(dctx, in.GetNextDataAddr())
		if err != nil {
			return fail(apierr.Unavailablef("node %s: connect stage %d to the next stage at %s: %v", s.cfg.Name, a.index, in.GetNextDataAddr(), err))
		}
		a.own(next)
		a.next = stageTCPSender(next, a.st, activationBytes(info))
	}
	if a.hoOutT == tandemv1.Transport_TRANSPORT_TCP {
		out, err := s.dialConfig(handoffLink, a.epoch).Dial(dctx, in.GetHandoffAddr())
		if err != nil {
			return fail(apierr.Unavailablef("node %s: connect the hand-off link of stage %d to the first stage at %s: %v", s.cfg.Name, a.index, in.GetHandoffAddr(), err))
		}
		a.own(out)
		a.handoffOut = stageTCPSender(out, a.st, handoffBytes(info))
	}
	// NCCL links this stage sends on: make each id and join as rank 0 in
	// the background; the receiver joins with the id (Join).
	for _, l := range []struct {
		t    tandemv1.Transport
		join **ncclJoin
		id   *[]byte
	}{{a.nextT, &a.nextJoin, &resp.NextNcclId}, {a.hoOutT, &a.hoOutJoin, &resp.HandoffNcclId}} {
		if l.t != tandemv1.Transport_TRANSPORT_NCCL {
			continue
		}
		id, err := nccl.NewUniqueID()
		if err != nil {
			return fail(fmt.Errorf("node %s: %w", s.cfg.Name, err))
		}
		*l.join = startNCCLJoin(a.ctx, a.st.(gpuStage).Device(), id, 0)
		*l.id = nccl.EncodeUniqueID(id)
	}
	close(a.connect)
	return resp, nil
}

// Join implements tandem.v1.Node: the stage joins the NCCL links it
// receives on, with the ids their senders made, and returns once joined.
func (s *Slot) Join(ctx context.Context, in *tandemv1.JoinRequest) (*tandemv1.JoinResponse, error) {
	return &tandemv1.JoinResponse{}, apierr.GRPC(s.join(ctx, in))
}

func (s *Slot) join(ctx context.Context, in *tandemv1.JoinRequest) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	a, err := s.current(ctx, in.GetEpoch())
	if err != nil {
		return err
	}
	if !a.connected() {
		return apierr.Preconditionf("node %s: Join before Connect for the stage of epoch %d", s.cfg.Name, a.epoch)
	}
	select {
	case <-a.joined:
		return apierr.Preconditionf("node %s: the stage of epoch %d has already joined its links", s.cfg.Name, a.epoch)
	default:
	}
	viaNCCL := tandemv1.Transport_TRANSPORT_NCCL
	links := []struct {
		name string
		t    tandemv1.Transport
		id   []byte
		dst  *collective.Receiver
	}{{"activations", a.prevT, in.GetPrevNcclId(), &a.prev}, {"hand-off", a.hoInT, in.GetHandoffNcclId(), &a.handoffIn}}
	var joins []*ncclJoin
	for _, l := range links {
		if (l.t == viaNCCL) != (len(l.id) > 0) {
			return apierr.Invalidf("%s link %s with an NCCL id of %d bytes: an NCCL link needs its id, no other link takes one", l.name, l.t, len(l.id))
		}
		if l.t != viaNCCL {
			joins = append(joins, nil)
			continue
		}
		id, err := nccl.DecodeUniqueID(l.id)
		if err != nil {
			return apierr.Invalidf("%s link: %v", l.name, err)
		}
		joins = append(joins, startNCCLJoin(ctx, a.st.(gpuStage).Device(), id, 1))
	}
	var errs []error
	for i, j := range joins {
		if j == nil {
			continue
		}
		comm, err := j.wait()
		if err == nil {
			var r ncclReceiver
			if r, err = newNCCLReceiver(a.ctx, a.st.(gpuStage), comm); err == nil {
				a.own(r)
				*links[i].dst = r
				wctx, cancel := context.WithTimeout(ctx, wireTimeout)
				err = warmUp(wctx, r.link, false)
				cancel()
			}
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("join the %s link: %w", links[i].name, err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		// The assignment ends: its goroutine closes what was joined.
		a.cancel()
		return apierr.Unavailablef("node %s, stage %d: %v", s.cfg.Name, a.index, err)
	}
	close(a.joined)
	return nil
}

// Release implements tandem.v1.Node.
func (s *Slot) Release(ctx context.Context, in *tandemv1.ReleaseRequest) (*tandemv1.ReleaseResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.find(in.GetEpoch()) == nil {
		// Nothing of that epoch to release; a stale leader hears so.
		if err := s.checkEpoch(ctx, in.GetEpoch()); err != nil {
			return nil, apierr.GRPC(err)
		}
	}
	if a := s.find(in.GetEpoch()); a != nil {
		s.end(a)
		s.live = slices.DeleteFunc(s.live, func(b *assignment) bool { return b == a })
	}
	return &tandemv1.ReleaseResponse{}, nil
}

// end stops an assignment and waits for it; its stage closes unless the
// next assignment shares it. s.mu is held.
func (s *Slot) end(a *assignment) {
	a.cancel()
	<-a.done
}

// Stop ends every assignment (daemon shutdown) and waits for them.
func (s *Slot) Stop() {
	s.stop()
	s.mu.Lock()
	for _, a := range s.live {
		s.end(a)
	}
	s.live = nil
	s.mu.Unlock()
	s.wg.Wait()
}

// Busy reports whether a stage serves a pipeline (its worker runs): what
// a draining node waits for, so the leader can move the requests off. A
// stage loaded and not yet wired holds no request: waiting for it would
// hold a node's shutdown for as long as its wiring may take (a leader that
// died mid-build never wires it).
func (s *Slot) Busy() bool {
	s.servingMu.Lock()
	defer s.servingMu.Unlock()
	return s.serving > 0
}

// serve wires the assignment to its peers, runs it as a pipeline worker
// and cleans up after it.
func (s *Slot) serve(a *assignment) {
	defer close(a.done)
	defer a.closeAll()
	err := s.work(a)
	switch {
	case err == nil:
		s.log.Info("stage finished", "epoch", a.epoch, "index", a.index)
	case a.ctx.Err() != nil:
		s.log.Info("stage released", "epoch", a.epoch, "index", a.index)
	case s.newest.Load() > a.epoch || pipeline.LinkFailure(err):
		// A newer pipeline replaced this one, or a neighbour ended first
		// (the leader closing the pipeline, or the neighbour failing,
		// which the leader hears from it): not this stage's failure.
		s.log.Info("stage finished: its pipeline ended", "epoch", a.epoch, "index", a.index, "newest_epoch", s.newest.Load(), "err", err)
	default:
		s.log.Warn("stage failed", "epoch", a.epoch, "index", a.index, "err", err)
	}
	if err == nil {
		err = errors.New("the pipeline ended before its first step")
	}
	a.move.End(err) // a no-op once the move is done
}

// accepted is the result of accepting the TCP link coming in.
type accepted struct {
	r   collective.Receiver
	err error
}

func (s *Slot) work(a *assignment) error {
	wctx, cancel := context.WithTimeout(a.ctx, wireTimeout)
	defer cancel()
	// Accept the TCP link coming in, if there may be one, without waiting
	// for Connect: the sender's Connect dials it, and the leader's Connects
	// run in any order.
	acc := make(chan accepted, 1)
	accDone := make(chan struct{})
	if a.dataLn != nil {
		go func() {
			defer close(accDone)
			r, err := a.dataLn.Accept(wctx)
			if err == nil {
				a.own(r)
			}
			acc <- accepted{r, err}
		}()
	} else {
		close(accDone)
	}
	err := s.wire(wctx, a, acc)
	if a.dataLn != nil {
		a.dataLn.Close() // ends an accept still waiting
	}
	<-accDone
	if err != nil {
		return err
	}
	ctl, err := a.ctlLn.Accept(wctx)
	// One control link per assignment: a fixed port is free again for the
	// next one, loaded beside this.
	a.ctlLn.Close()
	if err != nil {
		return fmt.Errorf("accept the leader's control link: %w", err)
	}
	a.own(ctl)
	a.move.Set(2, moveSteps)
	st := a.st
	if s.cfg.WrapStage != nil {
		st = s.cfg.WrapStage(st)
	}
	w := &pipeline.Worker{Index: a.index, Stage: st, Epoch: a.epoch, Ctl: &takeover{Control: ctl, s: s, a: a},
		Prev: a.prev, Next: a.next, HandoffIn: a.handoffIn, HandoffOut: a.handoffOut}
	a.working.Store(true)
	defer a.working.Store(false)
	s.setServing(+1)
	defer s.setServing(-1)
	return w.Serve(a.ctx)
}

// setServing counts the assignments whose worker runs (two while the
// pipeline moves) and tells OnServing when the first starts and the last
// stops.
func (s *Slot) setServing(delta int) {
	s.servingMu.Lock()
	defer s.servingMu.Unlock()
	was := s.serving > 0
	s.serving += delta
	if now := s.serving > 0; now != was {
		s.cfg.OnServing(now)
	}
}

// takeover is an assignment's control link: before the first step runs,
// the assignment takes its stage over from the pipeline before when it
// shares it (that one's worker ends), and the node's move is done.
type takeover struct {
	pipeline.Control
	s       *Slot
	a       *assignment
	started bool
}

func (t *takeover) Next(ctx context.Context) (*pipeline.Step, error) {
	st, err := t.Control.Next(ctx)
	if err != nil || t.started {
		return st, err
	}
	t.started = true
	a := t.a
	took, err := a.hs.acquire(a)
	if err != nil {
		return nil, err
	}
	a.move.End(nil)
	if took {
		t.s.log.Info("stage switched: the new pipeline's first step took the stage over, weights reused", "epoch", a.epoch, "from_epoch", a.hs.epoch,
			"layers", fmt.Sprintf("[%d,%d)", a.info.Lo, a.info.Hi))
	}
	return st, nil
}

// wire waits until every link of the assignment is up: Connect has run,
// the TCP link coming in is accepted, the NCCL links are joined.
func (s *Slot) wire(ctx context.Context, a *assignment, acc <-chan accepted) error {
	select {
	case <-a.connect:
	case <-ctx.Done():
		return fmt.Errorf("wait for Connect: %w", ctx.Err())
	}
	if a.prevT == tandemv1.Transport_TRANSPORT_TCP || a.hoInT == tandemv1.Transport_TRANSPORT_TCP {
		r := <-acc
		if r.err != nil {
			return fmt.Errorf("accept the %s link: %w", position(a.info.First, "hand-off", "previous stage's"), r.err)
		}
		if a.info.First {
			a.handoffIn = stageTCPReceiver(r.r, a.st, handoffBytes(a.info))
		} else {
			a.prev = stageTCPReceiver(r.r, a.st, activationBytes(a.info))
		}
	}
	for _, l := range []struct {
		name string
		j    *ncclJoin
		dst  *collective.Sender
	}{{"next stage's", a.nextJoin, &a.next}, {"hand-off", a.hoOutJoin, &a.handoffOut}} {
		if l.j == nil {
			continue
		}
		comm, err := l.j.wait()
		if err != nil {
			return fmt.Errorf("join the %s NCCL link: %w", l.name, err)
		}
		l.j.taken = true
		snd, err := newNCCLSender(a.ctx, a.st.(gpuStage), comm)
		if err != nil {
			return fmt.Errorf("the %s NCCL link: %w", l.name, err)
		}
		a.own(snd)
		*l.dst = snd
		if err := warmUp(ctx, snd.link, true); err != nil {
			return fmt.Errorf("the %s link: %w", l.name, err)
		}
	}
	if a.prevT == tandemv1.Transport_TRANSPORT_NCCL || a.hoInT == tandemv1.Transport_TRANSPORT_NCCL {
		select {
		case <-a.joined:
		case <-ctx.Done():
			return fmt.Errorf("wait for Join: %w", ctx.Err())
		}
	}
	return nil
}

// own registers a link for closeAll.
func (a *assignment) own(c io.Closer) {
	a.mu.Lock()
	a.closers = append(a.closers, c)
	a.mu.Unlock()
}

// connected reports whether Connect has run. s.mu is held.
func (a *assignment) connected() bool {
	select {
	case <-a.connect:
		return true
	default:
		return false
	}
}

// ended reports whether the assignment's goroutine has returned.
func (a *assignment) ended() bool {
	select {
	case <-a.done:
		return true
	default:
		return false
	}
}

// closeAll releases everything the assignment holds: it ends NCCL joins
// still running (aborting communicators no link took), closes the links
// and listeners, then the stage.
func (a *assignment) closeAll() {
	if a.cancel != nil {
		a.cancel()
	}
	for _, j := range []*ncclJoin{a.nextJoin, a.hoOutJoin} {
		if j == nil {
			continue
		}
		if comm, err := j.wait(); err == nil && !j.taken {
			comm.Abort()
		}
	}
	a.mu.Lock()
	for _, c := range a.closers {
		c.Close()
	}
	a.closers = nil
	a.mu.Unlock()
	if a.dataLn != nil {
		a.dataLn.Close()
	}
	if a.ctlLn != nil {
		a.ctlLn.Close()
	}
	a.hs.drop()
}

// dataLink names the activation link into the stage that starts at layer
// lo, so a stage only accepts activations from the one that ends there.
func dataLink(lo int) string { return fmt.Sprintf("activations->layer%d", lo) }
