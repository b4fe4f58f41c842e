package daemon

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/pipeline"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
	"github.com/tandem-llm/tandem/stage"
	"github.com/tandem-llm/tandem/stage/cpu"
)

// wireTimeout bounds how long an assigned stage waits for its peers and
// the leader's control connection after Load.
const wireTimeout = time.Minute

// epochTrailer is the trailer in which a node refusing a stale epoch says
// the newest epoch it has accepted.
const epochTrailer = "tandem-epoch"

// stageSlot is this node's place in a pipeline: it implements the Node
// service, loading the layer range the leader assigns and serving it as a
// pipeline worker until the leader closes the control link, a newer epoch
// replaces it, or the daemon stops.
type stageSlot struct {
	tandemv1.UnimplementedNodeServer
	name      string
	ckpt      *model.Checkpoint
	usable    uint64 // memory the stage may use
	listen    ListenConfig
	log       *slog.Logger
	onServing func(serving bool) // called when a stage starts and stops serving

	ctx context.Context // the daemon's lifetime
	wg  sync.WaitGroup  // assignment goroutines

	mu    sync.Mutex // serializes Load, Connect and Release
	epoch uint64     // newest accepted
	cur   *assignment
}

// assignment is one loaded stage of one epoch.
type assignment struct {
	epoch   uint64
	index   int
	st      stage.Stage
	ctlLn   *pipeline.ControlListener
	dataLn  *collective.Listener // nil on the first stage
	next    collective.Sender    // set by Connect; nil on the last stage
	last    bool
	connect chan struct{} // closed by Connect
	closers []io.Closer   // links accepted by the assignment's goroutine
	cancel  context.CancelFunc
	done    chan struct{} // closed when the assignment's goroutine returns
}

// checkEpoch refuses an epoch older than the newest accepted.
func (s *stageSlot) checkEpoch(ctx context.Context, epoch uint64) error {
	if epoch >= s.epoch {
		return nil
	}
	grpc.SetTrailer(ctx, metadata.Pairs(epochTrailer, fmt.Sprint(s.epoch)))
	return preconditionf("stale leader epoch %d: node %s has accepted epoch %d", epoch, s.name, s.epoch)
}

// Load implements tandem.v1.Node.
func (s *stageSlot) Load(ctx context.Context, in *tandemv1.LoadRequest) (*tandemv1.LoadResponse, error) {
	resp, err := s.load(ctx, in)
	return resp, grpcError(err)
}

func (s *stageSlot) load(ctx context.Context, in *tandemv1.LoadRequest) (*tandemv1.LoadResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.checkEpoch(ctx, in.GetEpoch()); err != nil {
		return nil, err
	}
	if in.GetModelId() != s.ckpt.Identity() {
		return nil, preconditionf("node %s has model %s (%s), the leader %s serves %s", s.name, short(s.ckpt.Identity()), s.ckpt.Dir(), in.GetLeader(), short(in.GetModelId()))
	}
	cfg := s.ckpt.Config()
	lo, hi := int(in.GetLayerLo()), int(in.GetLayerHi())
	if lo >= hi || hi > cfg.NumLayers {
		return nil, invalidf("layers [%d, %d): the model has layers [0, %d)", lo, hi, cfg.NumLayers)
	}
	if in.GetMaxBatchTokens() == 0 || in.GetMaxSeqs() == 0 || in.GetBlockSize() == 0 {
		return nil, invalidf("max_batch_tokens %d, max_seqs %d and block_size %d: want at least 1", in.GetMaxBatchTokens(), in.GetMaxSeqs(), in.GetBlockSize())
	}
	maxSeqs, bs := int(in.GetMaxSeqs()), int(in.GetBlockSize())
	kv, err := stageKVTokens(cfg, s.usable, lo, hi, int(in.GetMaxBatchTokens()), maxSeqs)
	if err != nil {
		return nil, preconditionf("node %s: %v", s.name, err)
	}
	// The memory's worth of blocks, but no more than every sequence of a
	// full batch at the model's context length needs.
	blocks := min(kv/bs, maxSeqs*((cfg.MaxPositions+bs-1)/bs))
	if blocks < 1 {
		return nil, preconditionf("node %s: layers [%d, %d) leave room for %d tokens of KV cache, less than a block of %d", s.name, lo, hi, kv, bs)
	}
	s.release()
	s.epoch = in.GetEpoch()
	if err := s.ckpt.CheckLayers(lo, hi, lo == 0, hi == cfg.NumLayers); err != nil {
		return nil, fmt.Errorf("node %s: %w", s.name, err)
	}
	st, err := cpu.New(cpu.Config{Model: cfg, Lo: lo, Hi: hi, Weights: s.ckpt, MaxTokens: int(in.GetMaxBatchTokens()), MaxSeqs: maxSeqs, NumBlocks: blocks, BlockSize: bs})
	if err != nil {
		return nil, fmt.Errorf("node %s: load layers [%d, %d): %w", s.name, lo, hi, err)
	}
	a := &assignment{epoch: in.GetEpoch(), index: int(in.GetIndex()), st: st, last: hi == cfg.NumLayers, connect: make(chan struct{}), done: make(chan struct{})}
	fail := func(err error) (*tandemv1.LoadResponse, error) {
		a.closeAll()
		return nil, err
	}
	if a.ctlLn, err = pipeline.ListenControl(s.listen.Control); err != nil {
		return fail(fmt.Errorf("node %s: %w", s.name, err))
	}
	info := st.Info()
	resp := &tandemv1.LoadResponse{ControlAddr: advertised(a.ctlLn.Addr(), s.listen.Advertise), Backend: info.Backend, ModelId: s.ckpt.Identity(), KvBlocks: uint64(info.KVBlocks), MaxSeqLen: uint32(cfg.MaxPositions)}
	if lo > 0 {
		if a.dataLn, err = (collective.ListenConfig{Link: dataLink(lo), Logger: s.log}).Listen(s.listen.Data); err != nil {
			return fail(fmt.Errorf("node %s: %w", s.name, err))
		}
		resp.DataAddr = advertised(a.dataLn.Addr().String(), s.listen.Advertise)
	}
	actx, cancel := context.WithCancel(s.ctx)
	a.cancel = cancel
	s.cur = a
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.serve(actx, a)
	}()
	s.log.Info("stage loaded", "epoch", a.epoch, "index", a.index, "layers", fmt.Sprintf("[%d,%d)", lo, hi), "leader", in.GetLeader(), "kv_blocks", info.KVBlocks, "block_size", bs)
	return resp, nil
}

// Connect implements tandem.v1.Node.
func (s *stageSlot) Connect(ctx context.Context, in *tandemv1.ConnectRequest) (*tandemv1.ConnectResponse, error) {
	return &tandemv1.ConnectResponse{}, grpcError(s.connectNext(ctx, in))
}

func (s *stageSlot) connectNext(ctx context.Context, in *tandemv1.ConnectRequest) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.checkEpoch(ctx, in.GetEpoch()); err != nil {
		return err
	}
	a := s.cur
	if a == nil || a.epoch != in.GetEpoch() || a.ended() {
		return preconditionf("node %s has no stage of epoch %d to connect", s.name, in.GetEpoch())
	}
	select {
	case <-a.connect:
		return preconditionf("node %s: the stage of epoch %d is already connected", s.name, a.epoch)
	default:
	}
	switch {
	case a.last && in.GetNextDataAddr() != "":
		return invalidf("next_data_addr %q given to the last stage", in.GetNextDataAddr())
	case !a.last && in.GetNextDataAddr() == "":
		return invalidf("next_data_addr is required: stage %d is not the last", a.index)
	}
	if !a.last {
		hi := a.st.Info().Hi
		ctx, cancel := context.WithTimeout(ctx, wireTimeout)
		defer cancel()
		next, err := (collective.DialConfig{Link: dataLink(hi)}).Dial(ctx, in.GetNextDataAddr())
		if err != nil {
			return unavailablef("node %s: connect stage %d to the next stage at %s: %v", s.name, a.index, in.GetNextDataAddr(), err)
		}
		a.next = next
	}
	close(a.connect)
	return nil
}

// Release implements tandem.v1.Node.
func (s *stageSlot) Release(ctx context.Context, in *tandemv1.ReleaseRequest) (*tandemv1.ReleaseResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.checkEpoch(ctx, in.GetEpoch()); err != nil {
		return nil, grpcError(err)
	}
	if s.cur != nil && s.cur.epoch == in.GetEpoch() {
		s.release()
	}
	return &tandemv1.ReleaseResponse{}, nil
}

// release stops the current assignment and waits for it. s.mu is held.
func (s *stageSlot) release() {
	if a := s.cur; a != nil {
		a.cancel()
		<-a.done
		s.cur = nil
	}
}

// stop ends every assignment (daemon shutdown) and waits for them.
func (s *stageSlot) stop() {
	s.mu.Lock()
	s.release()
	s.mu.Unlock()
	s.wg.Wait()
}

// busy reports whether a stage is assigned.
func (s *stageSlot) busy() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cur != nil && !s.cur.ended()
}

// serve wires the assignment to its peers, runs it as a pipeline worker
// and cleans up after it.
func (s *stageSlot) serve(ctx context.Context, a *assignment) {
	defer close(a.done)
	defer a.closeAll()
	err := s.work(ctx, a)
	switch {
	case err == nil:
		s.log.Info("stage finished", "epoch", a.epoch, "index", a.index)
	case ctx.Err() != nil:
		s.log.Info("stage released", "epoch", a.epoch, "index", a.index)
	default:
		s.log.Warn("stage failed", "epoch", a.epoch, "index", a.index, "err", err)
	}
}

func (s *stageSlot) work(ctx context.Context, a *assignment) error {
	w := &pipeline.Worker{Index: a.index, Stage: a.st, Epoch: a.epoch}
	wctx, cancel := context.WithTimeout(ctx, wireTimeout)
	defer cancel()
	if a.dataLn != nil {
		prev, err := a.dataLn.Accept(wctx)
		if err != nil {
			return fmt.Errorf("accept the previous stage: %w", err)
		}
		a.addCloser(prev)
		w.Prev = prev
	}
	select {
	case <-a.connect:
	case <-wctx.Done():
		return fmt.Errorf("wait for Connect: %w", wctx.Err())
	}
	w.Next = a.next
	ctl, err := a.ctlLn.Accept(wctx)
	if err != nil {
		return fmt.Errorf("accept the leader's control link: %w", err)
	}
	a.addCloser(ctl)
	w.Ctl = ctl
	s.onServing(true)
	defer s.onServing(false)
	return w.Serve(ctx)
}

// addCloser registers a link for closeAll. Only the assignment's goroutine
// calls it.
func (a *assignment) addCloser(c io.Closer) { a.closers = append(a.closers, c) }

// ended reports whether the assignment's goroutine has returned.
func (a *assignment) ended() bool {
	select {
	case <-a.done:
		return true
	default:
		return false
	}
}

// closeAll releases everything the assignment holds.
func (a *assignment) closeAll() {
	if a.next != nil {
		a.next.Close()
	}
	for _, c := range a.closers {
		c.Close()
	}
	if a.dataLn != nil {
		a.dataLn.Close()
	}
	if a.ctlLn != nil {
		a.ctlLn.Close()
	}
	a.st.Close()
}

// dataLink names the activation link into the stage that starts at layer
// lo, so a stage only accepts activations from the one that ends there.
func dataLink(lo int) string { return fmt.Sprintf("activations->layer%d", lo) }

// advertised rewrites the host of a bound address to the advertised host,
// when one is configured.
func advertised(addr, host string) string {
	if host == "" {
		return addr
	}
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	return net.JoinHostPort(host, port)
}

// short abbreviates a model identity for messages.
func short(id string) string {
	if len(id) > 12 {
		return id[:12]
	}
	return id
}
