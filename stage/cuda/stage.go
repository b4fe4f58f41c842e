package cuda

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"time"
	"unsafe"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/stage"
)

// Config describes the stage to build.
type Config struct {
	Model   *model.Config
	Lo, Hi  int // layer range [Lo, Hi)
	Weights stage.Weights
	// MaxTokens and MaxSeqs bound one batch; MaxSeqs is also the number
	// of hand-off slots.
	MaxTokens, MaxSeqs int
	// NumBlocks and BlockSize size the paged KV cache: NumBlocks blocks of
	// BlockSize positions for every layer of the stage (BlockSize 0:
	// stage.DefaultBlockSize; NumBlocks 0: as many as fit in the device memory
	// free once the weights, the workspace and GraphMemory are taken,
	// less KVMargin). The leader's block size must be the same. Set
	// NumBlocks when several stages share a device.
	NumBlocks, BlockSize int
	// KVMargin is the device memory left free when NumBlocks is sized
	// from free memory (0: DefaultKVMargin).
	KVMargin int64
	// MaxSeqLen is how many positions one sequence may fill (0:
	// Model.MaxPositions); it sizes the block tables a batch carries.
	MaxSeqLen int
	// MaxLogitRows bounds the logits rows of one batch: one per sampled
	// sequence plus every row of sequences with Logits set (0: the larger
	// of MaxSeqs and min(MaxTokens, 256)).
	MaxLogitRows int
	// Device runs the stage; nil opens device Ordinal (and closes it in
	// Close).
	Device  *gpu.Device
	Ordinal int
	// CacheDir holds compiled kernels ("": model.CacheDir("kernels"):
	// $TANDEM_CACHE_DIR, systemd's $CACHE_DIRECTORY or the user cache
	// directory, then kernels).
	CacheDir string
	// GraphMemory is device memory New holds back for CUDA graphs before
	// it allocates the KV cache, so that the cache cannot take what the
	// graphs will need: Capture releases it, captures, and fails when the
	// graphs took more. 0 holds nothing back.
	GraphMemory int64
	// GraphDebug makes every graph replay check that the buffers the
	// graph reads and writes are still those it was captured with, and
	// fail the step naming the one that moved.
	GraphDebug bool
	// Progress, when set, is told how the long steps advance, for a person
	// watching: Progress(step) returns the function the stage calls with
	// the work done and the total, done == total when the step is over.
	// The steps: "compile kernels" (0 of 1, then 1 of 1; a cache hit is
	// quick) and "capture graphs" (graph keys captured of those asked
	// for). The weights' bytes are reported by Weights (model.Counted).
	Progress func(step string) func(done, total int)
	// Log is the node's logger for what the stage decides on its own
	// (kernel cache trouble, optional kernels, the skinny-kernel choice);
	// nil: slog.Default().
	Log *slog.Logger
	// SkinnyTokens is the most token rows of a step whose products run on
	// the stage's own skinny kernels, with the norms and the rest of the
	// layer fused into them, rather than on cuBLAS (at most 32; negative:
	// never). 0 lets the stage choose: on a device with tensor cores New
	// times steps of 2, then 4, 8 and (where the gemvt kernels compiled)
	// 16 and 32 rows both ways and keeps the skinny kernels up to the
	// largest size where they were faster (and agreed with cuBLAS); steps
	// of one row always run on them (tuneSkinny). It also times one-row
	// steps with each count of warps a unit of the attention output
	// product and keeps the fastest (tuneOSplits). Stages that must give
	// bit-identical results (tests comparing two stages) set it.
	SkinnyTokens int
	// CompensatedTokens is the most token rows of a step whose cuBLAS
	// GEMMs are compensated: they multiply each bf16-rounded activation
	// row and its rounding remainder, carrying the fp32 activations to
	// about 16 bits. That doubles the GEMMs' rows: it costs little in
	// small decode steps, 4-5% of a 32-sequence decode step and far more
	// in a long prefill. Larger steps take the rounded activations alone,
	// as transformers' bf16 model does (the residual stream, norms,
	// attention and sums stay fp32).
	// 0: DefaultCompensatedTokens; negative: every step compensated.
	CompensatedTokens int
	// NoDependentLaunch launches every kernel after the one before it has
	// finished; by default the stage's kernels are programmatic dependent
	// launches where the driver offers them (the next kernel starts, and
	// reads its weights, while the one before it ends).
	NoDependentLaunch bool
	// timeline compiles the kernel program with the block timeline
	// (00_common.cu's TANDEM_TIMELINE; TestStepTimeline and
	// TestBatchTimeline read it): a diagnostic for this package's tests.
	timeline bool
}

// DefaultCompensatedTokens is Config.CompensatedTokens when unset: steps
// of up to 16 rows (decode of up to 16 sequences) compensated, larger
// ones not. Measured on one H200 against 64 (NOTES.md, phase 18): decode
// steps of 32 sequences 1.279 -> 1.234 ms GPU (Llama-3.2-1B shape) and
// 5.470 -> 5.192 (8B), tandemctl bench at 32 and 64 concurrent requests
// +3.5% and +8.1% tokens/s; the logits of such steps stray about half as
// far from transformers' float32 model as its own bf16 model does (1B max
// relative L2 0.0174 against 0.0323; compensated 0.0088).
const DefaultCompensatedTokens = 16

// DefaultKVMargin is the device memory left free when Config.NumBlocks is
// sized from free memory and Config.KVMargin is 0.
const DefaultKVMargin = 1 << 30

// Memory is what a stage holds on its device.
type Memory struct {
	WeightBytes    int64 // weights of the stage's layers, embedding, norm, LM head
	WorkspaceBytes int64 // activations, logits, batch description, hand-off buffers, cuBLAS workspace
	KVBytes        int64 // the KV cache, with one scratch row for padding
	KVBlocks       int   // blocks of the paged KV cache
	BlockSize      int   // positions per block
	// GraphBytes is what the CUDA graphs took (after Capture), or the
	// memory held back for them (Config.GraphMemory) before.
	GraphBytes int64
}

// layerW points at one layer's weights on the device. q|k|v and gate|up are
// fused: their rows are concatenated, so one GEMM computes them.
type layerW struct {
	inNorm, postNorm gpu.DevicePtr
	qkv, qkvBias     gpu.DevicePtr // qkvBias is 0 without attention bias
	o, gateUp, down  gpu.DevicePtr
}

// bufs points at the persistent buffers of the workspace (workspace.go).
// The residual stream, q and GEMM outputs are fp32; the cuBLAS path's GEMM
// inputs and the KV cache are bf16.
type bufs struct {
	in, resid, q                       gpu.DevicePtr
	normed, qkv, attnB, y, gateUp, act gpu.DevicePtr // cuBLAS path
	attnF, actF                        gpu.DevicePtr // skinny path
	logits, stats, sampleOut, batch    gpu.DevicePtr
	invFreq, part, partML, counts      gpu.DevicePtr
	gtPart, gtCounts                   gpu.DevicePtr // gemvt
}

// handoffBufs are the device buffers of on-device hand-off: the rows the
// last stage's sampler reports and the rows the first stage receives (the
// same buffer on a stage that is both), and on the first stage the token
// recorded for each slot and the status array its kernels report errors
// in.
type handoffBufs struct {
	in, out gpu.Mem       // MaxSeqs rows of (slot, token) int32
	tokens  gpu.DevicePtr // [MaxSeqs] int32, -1: no token recorded
	status  gpu.DevicePtr // [statusWords] int32
	host    []int32       // pinned: the status read back
}

// Stage is a CUDA pipeline stage. It implements stage.Stage.
type Stage struct {
	log         *slog.Logger
	m           model.Config
	lo, hi      int
	first, last bool
	qDim, kvDim int
	qkvDim      int
	dev         *gpu.Device
	ownDev      bool
	progress    func(step string) func(done, total int) // Config.Progress
	stream      gpu.Stream
	blas        *gpu.BLAS
	mod         gpu.Module
	timeline    bool // Config.timeline
	fn          map[string]gpu.Function
	mems        []gpu.Mem // every device allocation, freed by Close
	hosts       [][]byte  // pinned host buffers, freed by Close
	mem         Memory
	weights     struct{ embed, norm, lmHead gpu.DevicePtr }
	layers      []layerW
	kcache      gpu.DevicePtr // [layer][row][kv heads][head dim], bf16
	vcache      gpu.DevicePtr
	ho          handoffBufs
	kvLayer     int // bytes of one layer's K (or V) cache
	b           bufs
	input       gpu.Mem
	outBuf      gpu.Mem
	pl          planner
	hostLogits  []float32 // pinned: the logits asked for
	lastGPU     time.Duration
	args        gpu.KernelArgs
	closed      bool
	g           graphState
	sk          skinnyPlan
	// prefill says attention_prefill_d* serves the model (tensor cores,
	// a head dim it is compiled for, its stages within the shared memory).
	prefill bool
	// compTokens is Config.CompensatedTokens, the default applied.
	compTokens int
	at         attnPlan
	pdl        bool     // launch kernels as programmatic dependents
	gemvs      bool     // decode steps' small products on gemvs.cu (gemvs.go)
	zeroCopy   bool     // upload and read back by kernels (unified addressing: upload, readBack)
	prof       *profile // per-kernel events during ProfileStep, else nil
	profPool   *profile // the events ProfileStep records, kept for the next
	// skinnyChoice is what tuneSkinny measured.
	skinnyChoice SkinnyChoice
	// The steps on their way through the device (launch.go): fl[oldest]
	// and the launched-1 after it are launched and not finished; waits
	// feeds the goroutine that waits for them (nil until the first
	// Launch), which closes waiterDone when it ends.
	fl               [stage.LaunchDepth]flight
	oldest, launched int
	waits            chan *flight
	waiterDone       chan struct{}
	launchedOut      stage.Output // LaunchedOutput's
}

// New builds the stage: compiles (or loads from the cache) the kernels,
// uploads the stage's weights as bf16 and allocates every buffer. It fails
// with an error wrapping gpu.ErrNoDriver when no GPU can be used.
func New(cfg Config) (*Stage, error) {
	if err := checkConfig(&cfg); err != nil {
		return nil, fmt.Errorf("cuda stage: %w", err)
	}
	if cfg.Weights == nil {
		return nil, errors.New("cuda stage: no weights")
	}
	s := &Stage{m: *cfg.Model, lo: cfg.Lo, hi: cfg.Hi, dev: cfg.Device, progress: cfg.Progress, log: cmp.Or(cfg.Log, slog.Default())}
	s.g.debug = cfg.GraphDebug
	s.timeline = cfg.timeline
	s.g.full = wrapper{mode: graphs.Full, graphs: map[segKey]graphExec{}}
	s.g.piecewise = wrapper{mode: graphs.Piecewise, graphs: map[segKey]graphExec{}}
	if s.dev == nil {
		if err := gpu.Probe(); err != nil {
			return nil, fmt.Errorf("cuda stage: no GPU: %w", err)
		}
		d, err := gpu.Open(cfg.Ordinal)
		if err != nil {
			return nil, fmt.Errorf("cuda stage: %w", err)
		}
		s.dev, s.ownDev = d, true
	}
	if err := s.init(&cfg); err != nil {
		s.Close()
		return nil, fmt.Errorf("cuda stage [%d,%d) on GPU %d: %w", cfg.Lo, cfg.Hi, s.dev.Ordinal(), err)
	}
	return s, nil
}

// checkConfig checks cfg (the model with stage.CheckModel, then what the
// kernels and the buffers of this backend need) and fills its defaults.
func checkConfig(cfg *Config) error {
	if err := stage.CheckModel(cfg.Model, cfg.Lo, cfg.Hi); err != nil {
		return err
	}
	m := cfg.Model
	switch {
	case m.HeadDim%8 != 0 || m.HeadDim > maxHeadDim:
		return fmt.Errorf("head dim %d: the CUDA kernels take multiples of 8 up to %d", m.HeadDim, maxHeadDim)
	case cfg.MaxTokens <= 0 || cfg.MaxSeqs <= 0:
		return fmt.Errorf("max tokens %d and max seqs %d must be positive", cfg.MaxTokens, cfg.MaxSeqs)
	case cfg.NumBlocks < 0 || cfg.BlockSize < 0 || cfg.KVMargin < 0:
		return fmt.Errorf("KV cache of %d blocks of %d positions with a margin of %d bytes: none may be negative", cfg.NumBlocks, cfg.BlockSize, cfg.KVMargin)
	case cfg.MaxSeqLen < 0 || cfg.MaxLogitRows < 0:
		return fmt.Errorf("max sequence length %d and max logits rows %d must not be negative", cfg.MaxSeqLen, cfg.MaxLogitRows)
	}
	if cfg.BlockSize == 0 {
		cfg.BlockSize = stage.DefaultBlockSize
	}
	if cfg.KVMargin == 0 {
		cfg.KVMargin = DefaultKVMargin
	}
	if cfg.MaxSeqLen == 0 || cfg.MaxSeqLen > m.MaxPositions {
		cfg.MaxSeqLen = m.MaxPositions
	}
	if cfg.MaxLogitRows == 0 {
		cfg.MaxLogitRows = max(cfg.MaxSeqs, min(cfg.MaxTokens, 256))
	}
	if cfg.MaxLogitRows > cfg.MaxTokens {
		cfg.MaxLogitRows = cfg.MaxTokens
	}
	if cfg.MaxLogitRows < cfg.MaxSeqs && cfg.MaxLogitRows < cfg.MaxTokens {
		return fmt.Errorf("max logits rows %d is below max seqs %d: every sequence may sample", cfg.MaxLogitRows, cfg.MaxSeqs)
	}
	if cfg.GraphMemory < 0 {
		return fmt.Errorf("graph memory %d must not be negative", cfg.GraphMemory)
	}
	if int64(cfg.NumBlocks+1)*int64(cfg.BlockSize) > math.MaxInt32 {
		return fmt.Errorf("KV cache of %d blocks of %d positions has more rows than an int32 indexes", cfg.NumBlocks, cfg.BlockSize)
	}
	if tables := int64(cfg.MaxSeqs) * int64(blocksFor(cfg.MaxSeqLen, cfg.BlockSize)); tables > math.MaxInt32/4 {
		return fmt.Errorf("block tables of %d sequences of %d positions in blocks of %d are too large", cfg.MaxSeqs, cfg.MaxSeqLen, cfg.BlockSize)
	}
	return nil
}

// newLayout is the batch description's layout for cfg (with its defaults).
func newLayout(cfg *Config) layout {
	return layout{maxTokens: cfg.MaxTokens, maxSeqs: cfg.MaxSeqs, maxLogitRows: cfg.MaxLogitRows,
		maxBlocks: blocksFor(cfg.MaxSeqLen, cfg.BlockSize)}
}

// blocksFor is how many blocks of size bs cover n positions.
func blocksFor(n, bs int) int { return (n + bs - 1) / bs }

// init does all of New's device work, inside the device goroutine.
func (s *Stage) init(cfg *Config) error {
	m := &s.m
	s.first, s.last = s.lo == 0, s.hi == m.NumLayers
	s.qDim, s.kvDim = m.NumHeads*m.HeadDim, m.NumKVHeads*m.HeadDim
	s.qkvDim = s.qDim + 2*s.kvDim
	lay := newLayout(cfg)
	info := s.dev.Info()
	s.sk = planSkinny(m, cfg.SkinnyTokens, info.Major >= 8, info.MaxSharedPerBlockOptin)
	s.compTokens = cfg.CompensatedTokens
	s.prefill = info.Major >= 8 && slices.Contains(prefillHeadDims, m.HeadDim) &&
		prefillSmem(m.HeadDim) <= info.MaxSharedPerBlockOptin
	if s.compTokens == 0 {
		s.compTokens = DefaultCompensatedTokens
	}
	s.at = newAttnPlan(m, info.SMs)
	s.at.gqa = s.prefill && s.at.groups == 1 && gqaSmem(m.HeadDim, 8) <= info.MaxSharedPerBlockOptin
	s.pdl = !cfg.NoDependentLaunch && info.Major >= 9 && gpu.LaunchDependentAvailable()
	s.zeroCopy = info.UnifiedAddressing
	s.gemvs = s.pdl // gemvs gains only as a dependent launch (gemvs.go)
	s.pl = planner{lay: lay, first: s.first, last: s.last, vocab: m.VocabSize, maxPos: m.MaxPositions,
		kv: newPagedKV(cfg.NumBlocks, cfg.BlockSize, cfg.MaxSeqLen)}
	compiled := s.reportStep("compile kernels")
	compiled(0, 1)
	img, optional, err := s.kernelImage(cfg.CacheDir)
	if err != nil {
		return err
	}
	compiled(1, 1)
	return s.dev.Do(func() error {
		if err := s.loadModule(img, optional, cfg.CacheDir); err != nil {
			return err
		}
		if optional {
			s.sk.widen(cfg.SkinnyTokens)
		}
		var err error
		if s.stream, err = gpu.NewStream(); err != nil {
			return fmt.Errorf("create stream: %w", err)
		}
		if s.blas, err = gpu.NewBLAS(); err != nil {
			return fmt.Errorf("create cuBLAS handle: %w", err)
		}
		if err := s.blas.SetStream(s.stream); err != nil {
			return fmt.Errorf("cuBLAS stream: %w", err)
		}
		if err := s.loadWeights(cfg.Weights); err != nil {
			return err
		}
		if err := s.allocate(cfg, lay); err != nil {
			return err
		}
		if err := gpu.CopyHtoD(s.b.invFreq, gpu.AsBytes(invFreq(m))); err != nil {
			return fmt.Errorf("upload rotary frequencies: %w", err)
		}
		if s.sk.tune {
			return s.tuneSkinny()
		}
		return nil
	})
}

// reportStep returns the function reporting how step advances (Config.Progress;
// a no-op without one).
func (s *Stage) reportStep(name string) func(done, total int) {
	if s.progress == nil {
		return func(int, int) {}
	}
	return s.progress(name)
}

// alloc allocates device memory that Close frees.
func (s *Stage) alloc(bytes int, what string) (gpu.Mem, error) {
	mem, err := gpu.Alloc(bytes)
	if err != nil {
		return gpu.Mem{}, fmt.Errorf("allocate %d bytes for %s: %w", bytes, what, err)
	}
	s.mems = append(s.mems, mem)
	return mem, nil
}

// allocHost allocates pinned host memory that Close frees.
func (s *Stage) allocHost(bytes int, what string) ([]byte, error) {
	b, err := gpu.AllocHost(bytes)
	if err != nil {
		return nil, fmt.Errorf("allocate %d pinned bytes for %s: %w", bytes, what, err)
	}
	s.hosts = append(s.hosts, b)
	return b, nil
}

// allocate creates the workspace, holds back the graph memory, creates the
// KV cache (sizing it from free memory when cfg.NumBlocks is 0) and the
// pinned host buffers. Device memory starts zeroed, so rows a step does
// not write (padding) never hold NaNs.
func (s *Stage) allocate(cfg *Config, lay layout) error {
	m := &s.m
	const i32 = 4
	T, H := cfg.MaxTokens, m.HiddenSize
	ws := planWorkspace(m, lay, s.first, s.last, &s.sk, s.at)
	work, err := s.alloc(ws.size, "activations")
	if err != nil {
		return err
	}
	if err := gpu.MemsetD8Async(work.Ptr(), 0, ws.size, s.stream); err != nil {
		return fmt.Errorf("clear activations: %w", err)
	}
	p := func(off int) gpu.DevicePtr {
		if off < 0 {
			return 0
		}
		return work.Ptr() + gpu.DevicePtr(off)
	}
	s.b = bufs{in: p(ws.in), resid: p(ws.resid), q: p(ws.q), normed: p(ws.normed), qkv: p(ws.qkv),
		attnB: p(ws.attnB), y: p(ws.y), gateUp: p(ws.gateUp), act: p(ws.act), attnF: p(ws.attnF), actF: p(ws.actF),
		logits: p(ws.logits), stats: p(ws.stats), sampleOut: p(ws.sampleOut), batch: p(ws.batch),
		invFreq: p(ws.invFreq), part: p(ws.part), partML: p(ws.partML), counts: p(ws.counts),
		gtPart: p(ws.gtPart), gtCounts: p(ws.gtCounts)}
	if s.first {
		s.ho.in = work.Slice(ws.hoIn, lay.maxSeqs*stage.HandoffCols*i32)
		s.ho.tokens, s.ho.status = p(ws.hoTokens), p(ws.status)
		// No slot has a token yet.
		if err := gpu.MemsetD32Async(s.ho.tokens, 0xffffffff, lay.maxSeqs, s.stream); err != nil {
			return fmt.Errorf("clear hand-off tokens: %w", err)
		}
	} else {
		s.input = work.Slice(ws.in, T*H*4)
	}
	if s.last {
		s.ho.out = s.ho.in
		if !s.first {
			s.ho.out = work.Slice(ws.hoOut, lay.maxSeqs*stage.HandoffCols*i32)
		}
	}
	s.outBuf = work.Slice(ws.resid, T*H*4)
	if err := s.blas.SetWorkspace(work.Slice(ws.blas, cublasWorkspace)); err != nil {
		return fmt.Errorf("cuBLAS workspace: %w", err)
	}
	s.mem.WorkspaceBytes = int64(ws.size)

	if cfg.GraphMemory > 0 {
		if s.g.reserve, err = gpu.Alloc(int(cfg.GraphMemory)); err != nil {
			return fmt.Errorf("hold back %d bytes for CUDA graphs: %w", cfg.GraphMemory, err)
		}
		s.g.budget = cfg.GraphMemory
		s.mem.GraphBytes = cfg.GraphMemory
	}
	if err := s.allocateKV(cfg); err != nil {
		return err
	}
	if err := s.stream.Synchronize(); err != nil {
		return fmt.Errorf("clear device buffers: %w", err)
	}

	if err := s.allocFlights(lay); err != nil {
		return err
	}
	if s.first {
		hs, err := s.allocHost(statusWords*i32, "the hand-off status")
		if err != nil {
			return err
		}
		s.ho.host = asInt32s(hs)
	}
	if s.last {
		hl, err := s.allocHost(lay.maxLogitRows*m.VocabSize*4, "logits")
		if err != nil {
			return err
		}
		s.hostLogits = unsafe.Slice((*float32)(unsafe.Pointer(&hl[0])), len(hl)/4)
	}
	return nil
}

// allocateKV creates the paged KV cache: per layer, NumBlocks·BlockSize
// rows and the scratch row, of kv heads × head dim bf16, for K and again
// for V. With cfg.NumBlocks 0 it takes as many blocks as the free device
// memory holds beyond cfg.KVMargin.
func (s *Stage) allocateKV(cfg *Config) error {
	const bf = 2
	layers := s.hi - s.lo
	rowBytes := int64(2 * layers * s.kvDim * bf) // one row of K and V, every layer
	bs := cfg.BlockSize
	blocks := cfg.NumBlocks
	if blocks == 0 {
		free, _, err := gpu.MemInfo()
		if err != nil {
			return fmt.Errorf("size the KV cache: %w", err)
		}
		n := (int64(free) - cfg.KVMargin - rowBytes) / (rowBytes * int64(bs))
		if n < 1 {
			return fmt.Errorf("no device memory for the KV cache: %d bytes free, %d to be left (Config.KVMargin), %d per block of %d positions", free, cfg.KVMargin, rowBytes*int64(bs), bs)
		}
		blocks = int(min(n, int64(math.MaxInt32/bs-1)))
	}
	s.pl.kv.blocks = blocks
	s.kvLayer = (blocks*bs + 1) * s.kvDim * bf
	kv, err := s.alloc(2*layers*s.kvLayer, fmt.Sprintf("the KV cache of %d blocks of %d positions", blocks, bs))
	if err != nil {
		return err
	}
	if err := gpu.MemsetD8Async(kv.Ptr(), 0, kv.Len(), s.stream); err != nil {
		return fmt.Errorf("clear the KV cache: %w", err)
	}
	s.kcache = kv.Ptr()
	s.vcache = kv.Ptr() + gpu.DevicePtr(layers*s.kvLayer)
	s.mem.KVBytes = int64(kv.Len())
	s.mem.KVBlocks, s.mem.BlockSize = blocks, bs
	return nil
}

// Info describes the stage.
func (s *Stage) Info() stage.Info {
	return stage.Info{
		Backend:   "cuda",
		Lo:        s.lo,
		Hi:        s.hi,
		First:     s.first,
		Last:      s.last,
		Hidden:    s.m.HiddenSize,
		Vocab:     s.m.VocabSize,
		MaxTokens: s.pl.lay.maxTokens,
		MaxSeqs:   s.pl.lay.maxSeqs,
		ActDType:  collective.F32,
		KVBlocks:  s.pl.kv.blocks,
		BlockSize: s.pl.kv.blockSize,
		Graphs:    graphs.Always,
	}
}

// Input is the device buffer (a gpu.Mem) the previous stage's fp32
// activations are received into; nil on the first stage.
func (s *Stage) Input() collective.Buffer {
	if s.first {
		return nil
	}
	return s.input
}

// Memory reports the device memory the stage holds.
func (s *Stage) Memory() Memory { return s.mem }

// Device is the device the stage runs on.
func (s *Stage) Device() *gpu.Device { return s.dev }

// Stream is the stream Forward orders its work on.
func (s *Stage) Stream() gpu.Stream { return s.stream }

// LastStepTime is the device time of the last Forward's work, measured with
// events around it.
func (s *Stage) LastStepTime() time.Duration { return s.lastGPU }

// Free forgets a sequence's cached length, so that it may start again at
// position 0. Its blocks are the leader's. Freeing an unknown sequence does
// nothing.
func (s *Stage) Free(seq uint64) { s.pl.kv.release(seq) }

// Close releases the device memory, handles and (when New opened it) the
// device, once the work of launched batches is done. It is safe on a
// partly built stage.
func (s *Stage) Close() error {
	if s.closed {
		return nil
	}
	s.closed = true
	s.stopWaiter()
	var errs []error
	err := s.dev.Do(func() error {
		if s.stream != 0 {
			errs = append(errs, s.stream.Synchronize())
		}
		errs = append(errs, s.g.release())
		errs = append(errs, s.releaseProfile())
		for _, m := range s.mems {
			errs = append(errs, m.Free())
		}
		for _, h := range s.hosts {
			errs = append(errs, gpu.FreeHost(h))
		}
		if s.blas != nil {
			errs = append(errs, s.blas.Destroy())
		}
		errs = append(errs, s.releaseFlights())
		if s.stream != 0 {
			errs = append(errs, s.stream.Destroy())
		}
		if s.mod != 0 {
			errs = append(errs, s.mod.Unload())
		}
		return nil
	})
	errs = append(errs, err)
	if s.ownDev {
		errs = append(errs, s.dev.Close())
	}
	if err := errors.Join(errs...); err != nil {
		s.log.Warn("cuda stage close", "err", err)
		return fmt.Errorf("close cuda stage [%d,%d): %w", s.lo, s.hi, err)
	}
	return nil
}

// asInt32s views pinned host memory as int32s.
func asInt32s(b []byte) []int32 { return unsafe.Slice((*int32)(unsafe.Pointer(&b[0])), len(b)/4) }
