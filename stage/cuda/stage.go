package cuda

import (
	"errors"
	"fmt"
	"log/slog"
	"time"
	"unsafe"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/safetensors"
	"github.com/tandem-llm/tandem/stage"
)

// Weights gives access to a checkpoint's tensors by their Hugging Face name;
// *model.Checkpoint satisfies it. Tensors are only read during New.
type Weights interface {
	Tensor(name string) (*safetensors.Tensor, error)
}

// Config describes the stage to build.
type Config struct {
	Model   *model.Config
	Lo, Hi  int // layer range [Lo, Hi)
	Weights Weights
	// MaxTokens and MaxSeqs bound one batch.
	MaxTokens, MaxSeqs int
	// KVSlots is how many sequences the KV cache holds at once (0: MaxSeqs);
	// MaxSeqLen how many positions each may fill (0: the smaller of
	// Model.MaxPositions and 4096).
	KVSlots, MaxSeqLen int
	// MaxLogitRows bounds the logits rows of one batch: one per sampled
	// sequence plus every row of sequences with Logits set (0: the larger
	// of MaxSeqs and min(MaxTokens, 256)).
	MaxLogitRows int
	// Device runs the stage; nil opens device Ordinal (and closes it in
	// Close).
	Device  *gpu.Device
	Ordinal int
	// CacheDir holds compiled kernels ("": $TANDEM_CACHE_DIR/kernels or the
	// user cache directory's tandem/kernels).
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
}

// Memory is what a stage holds on its device.
type Memory struct {
	WeightBytes    int64 // weights of the stage's layers, embedding, norm, LM head
	WorkspaceBytes int64 // activations, logits, batch description, cuBLAS workspace
	KVBytes        int64 // the KV cache, with one scratch row for padding
	KVSlots        int   // sequences the cache holds at once
	KVPositions    int   // positions per sequence
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

// bufs points at the persistent activation buffers, sized for MaxTokens
// rows (logits for MaxLogitRows), twice that for the layer GEMMs' inputs
// and outputs (compensated: values and rounding remainders). The residual
// stream and GEMM outputs are fp32 (y is the output of the o and down
// projections, added into the residual stream by the next kernel); GEMM
// inputs, q and the KV cache are bf16.
type bufs struct {
	in, resid, y, qkv, gateUp gpu.DevicePtr // fp32
	normed, q, attn, act      gpu.DevicePtr // bf16
	logits, sampleOut, batch  gpu.DevicePtr
	invFreq                   gpu.DevicePtr
}

// Stage is a CUDA pipeline stage. It implements stage.Stage.
type Stage struct {
	m           model.Config
	lo, hi      int
	first, last bool
	qDim, kvDim int
	qkvDim      int
	maxLen      int
	dev         *gpu.Device
	ownDev      bool
	stream      gpu.Stream
	blas        *gpu.BLAS
	mod         gpu.Module
	fn          map[string]gpu.Function
	mems        []gpu.Mem // every device allocation, freed by Close
	hosts       [][]byte  // pinned host buffers, freed by Close
	mem         Memory
	weights     struct{ embed, norm, lmHead gpu.DevicePtr }
	layers      []layerW
	kcache      gpu.DevicePtr // [layer][row][kv heads][head dim], bf16
	vcache      gpu.DevicePtr
	kvLayer     int // bytes of one layer's K (or V) cache
	b           bufs
	input       gpu.Mem
	outBuf      gpu.Mem
	pl          planner
	p           plan
	hostBatch   []byte  // pinned: the packed batch description
	hostSample  []int32 // pinned: sampler output
	hostLogits  []float32
	events      [2]gpu.Event
	lastGPU     time.Duration
	args        gpu.KernelArgs
	out         stage.Output
	closed      bool
	g           graphState
	// The step Forward runs: its graph step (mode None: eager) and the
	// shape its kernels are launched for.
	step graphs.Step
	sh   shape
}

// New builds the stage: compiles (or loads from the cache) the kernels,
// uploads the stage's weights as bf16 and allocates every buffer. It fails
// with an error wrapping gpu.ErrNoDriver when no GPU can be used.
func New(cfg Config) (*Stage, error) {
	if err := checkConfig(&cfg); err != nil {
		return nil, fmt.Errorf("cuda stage: %w", err)
	}
	s := &Stage{m: *cfg.Model, lo: cfg.Lo, hi: cfg.Hi, dev: cfg.Device}
	s.g.debug = cfg.GraphDebug
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

func checkConfig(cfg *Config) error {
	m := cfg.Model
	switch {
	case m == nil:
		return errors.New("no model config")
	case cfg.Weights == nil:
		return errors.New("no weights")
	case cfg.Lo < 0 || cfg.Lo >= cfg.Hi || cfg.Hi > m.NumLayers:
		return fmt.Errorf("layer range [%d,%d) is not a non-empty part of the model's %d layers", cfg.Lo, cfg.Hi, m.NumLayers)
	case m.HiddenSize <= 0 || m.IntermediateSize <= 0 || m.VocabSize <= 0:
		return fmt.Errorf("hidden size %d, intermediate size %d, vocab size %d: all must be positive", m.HiddenSize, m.IntermediateSize, m.VocabSize)
	case m.NumKVHeads <= 0 || m.NumHeads <= 0 || m.NumHeads%m.NumKVHeads != 0:
		return fmt.Errorf("%d attention heads are not a positive multiple of %d key/value heads", m.NumHeads, m.NumKVHeads)
	case m.HeadDim <= 0 || m.HeadDim%2 != 0 || m.HeadDim > maxHeadDim:
		return fmt.Errorf("head dim %d: the CUDA kernels take even head dims up to %d", m.HeadDim, maxHeadDim)
	case m.MaxPositions <= 0 || m.RopeTheta <= 0:
		return fmt.Errorf("max positions %d and rope theta %v must be positive", m.MaxPositions, m.RopeTheta)
	case cfg.MaxTokens <= 0 || cfg.MaxSeqs <= 0:
		return fmt.Errorf("max tokens %d and max seqs %d must be positive", cfg.MaxTokens, cfg.MaxSeqs)
	case cfg.KVSlots < 0 || cfg.MaxSeqLen < 0 || cfg.MaxLogitRows < 0:
		return fmt.Errorf("KV slots %d, max sequence length %d and max logits rows %d must not be negative", cfg.KVSlots, cfg.MaxSeqLen, cfg.MaxLogitRows)
	}
	if rs := m.RopeScaling; rs != nil {
		if rs.Type != "llama3" {
			return fmt.Errorf("rope scaling type %q is not supported (only llama3)", rs.Type)
		}
		if rs.Factor <= 0 || rs.LowFreqFactor <= 0 || rs.HighFreqFactor <= rs.LowFreqFactor || rs.OriginalMaxPositions <= 0 {
			return fmt.Errorf("llama3 rope scaling %+v: need factor > 0, 0 < low_freq_factor < high_freq_factor and original_max_position_embeddings > 0", *rs)
		}
	}
	if cfg.KVSlots == 0 {
		cfg.KVSlots = cfg.MaxSeqs
	}
	if cfg.MaxSeqLen == 0 {
		cfg.MaxSeqLen = min(m.MaxPositions, 4096)
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
	if int64(cfg.KVSlots)*int64(cfg.MaxSeqLen)+1 > 1<<31-1 {
		return fmt.Errorf("KV cache of %d slots × %d positions has more rows than an int32 indexes", cfg.KVSlots, cfg.MaxSeqLen)
	}
	return nil
}

// init does all of New's device work, inside the device goroutine.
func (s *Stage) init(cfg *Config) error {
	m := &s.m
	s.first, s.last = s.lo == 0, s.hi == m.NumLayers
	s.qDim, s.kvDim = m.NumHeads*m.HeadDim, m.NumKVHeads*m.HeadDim
	s.qkvDim = s.qDim + 2*s.kvDim
	s.maxLen = cfg.MaxSeqLen
	lay := layout{maxTokens: cfg.MaxTokens, maxSeqs: cfg.MaxSeqs, maxLogitRows: cfg.MaxLogitRows}
	s.pl = planner{lay: lay, first: s.first, last: s.last, vocab: m.VocabSize, maxPos: m.MaxPositions,
		kv: newKVSlots(cfg.KVSlots, cfg.MaxSeqLen)}
	img, err := s.kernelImage(cfg.CacheDir)
	if err != nil {
		return err
	}
	return s.dev.Do(func() error {
		if err := s.loadModule(img, cfg.CacheDir); err != nil {
			return err
		}
		var err error
		if s.stream, err = gpu.NewStream(); err != nil {
			return fmt.Errorf("create stream: %w", err)
		}
		for i := range s.events {
			if s.events[i], err = gpu.NewEvent(); err != nil {
				return fmt.Errorf("create event: %w", err)
			}
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
		return nil
	})
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

// arena hands out 256-byte aligned offsets within one allocation.
type arena struct{ size int }

func (a *arena) take(bytes int) int {
	off := (a.size + 255) &^ 255
	a.size = off + bytes
	return off
}

// cublasWorkspace is the workspace given to cuBLAS, so that it allocates
// nothing while a stream is captured.
const cublasWorkspace = 32 << 20

// allocate creates the workspace, holds back the graph memory, creates the
// KV cache and the pinned host buffers. Device memory starts zeroed, so
// rows a step does not write (padding) never hold NaNs.
func (s *Stage) allocate(cfg *Config, lay layout) error {
	m := &s.m
	const bf, f32 = 2, 4
	T, H, I := cfg.MaxTokens, m.HiddenSize, m.IntermediateSize
	const f = 2 // rows per token of the layer GEMMs' inputs and outputs
	var a arena
	var in int
	if !s.first {
		in = a.take(T * H * f32)
	}
	resid := a.take(T * H * f32)
	y := a.take(f * T * H * f32)
	normed := a.take(f * T * H * bf)
	qkv := a.take(f * T * s.qkvDim * f32)
	q := a.take(T * s.qDim * bf)
	attn := a.take(f * T * s.qDim * bf)
	gateUp := a.take(f * T * 2 * I * f32)
	act := a.take(f * T * I * bf)
	var logits, sampleOut int
	if s.last {
		logits = a.take(lay.maxLogitRows * m.VocabSize * 4)
		sampleOut = a.take(lay.maxSeqs * (2 + 2*MaxLogprobs) * 4)
	}
	batch := a.take(lay.words() * 4)
	freq := a.take(m.HeadDim / 2 * 4)
	ws := a.take(cublasWorkspace)
	work, err := s.alloc(a.size, "activations")
	if err != nil {
		return err
	}
	if err := gpu.MemsetD8Async(work.Ptr(), 0, a.size, s.stream); err != nil {
		return fmt.Errorf("clear activations: %w", err)
	}
	p := func(off int) gpu.DevicePtr { return work.Ptr() + gpu.DevicePtr(off) }
	s.b = bufs{in: p(in), resid: p(resid), y: p(y), normed: p(normed), qkv: p(qkv), q: p(q), attn: p(attn),
		gateUp: p(gateUp), act: p(act), logits: p(logits), sampleOut: p(sampleOut),
		batch: p(batch), invFreq: p(freq)}
	if s.first {
		s.b.in = 0
	} else {
		s.input = work.Slice(in, T*H*f32)
	}
	s.outBuf = work.Slice(resid, T*H*f32)
	if err := s.blas.SetWorkspace(work.Slice(ws, cublasWorkspace)); err != nil {
		return fmt.Errorf("cuBLAS workspace: %w", err)
	}
	s.mem.WorkspaceBytes = int64(a.size)

	if cfg.GraphMemory > 0 {
		if s.g.reserve, err = gpu.Alloc(int(cfg.GraphMemory)); err != nil {
			return fmt.Errorf("hold back %d bytes for CUDA graphs: %w", cfg.GraphMemory, err)
		}
		s.g.budget = cfg.GraphMemory
		s.mem.GraphBytes = cfg.GraphMemory
	}

	// One row past the slots is the scratch row that padding rows write.
	s.kvLayer = (cfg.KVSlots*cfg.MaxSeqLen + 1) * s.kvDim * bf
	layers := s.hi - s.lo
	kv, err := s.alloc(2*layers*s.kvLayer, "the KV cache")
	if err != nil {
		return err
	}
	if err := gpu.MemsetD8Async(kv.Ptr(), 0, kv.Len(), s.stream); err != nil {
		return fmt.Errorf("clear the KV cache: %w", err)
	}
	s.kcache = kv.Ptr()
	s.vcache = kv.Ptr() + gpu.DevicePtr(layers*s.kvLayer)
	s.mem.KVBytes = int64(kv.Len())
	s.mem.KVSlots, s.mem.KVPositions = cfg.KVSlots, cfg.MaxSeqLen
	if err := s.stream.Synchronize(); err != nil {
		return fmt.Errorf("clear device buffers: %w", err)
	}

	if s.hostBatch, err = s.allocHost(lay.words()*4, "the batch description"); err != nil {
		return err
	}
	s.p.words = unsafe.Slice((*int32)(unsafe.Pointer(&s.hostBatch[0])), lay.words())
	if s.last {
		hs, err := s.allocHost(lay.maxSeqs*(2+2*MaxLogprobs)*4, "sampled tokens")
		if err != nil {
			return err
		}
		s.hostSample = unsafe.Slice((*int32)(unsafe.Pointer(&hs[0])), len(hs)/4)
		hl, err := s.allocHost(lay.maxLogitRows*m.VocabSize*4, "logits")
		if err != nil {
			return err
		}
		s.hostLogits = unsafe.Slice((*float32)(unsafe.Pointer(&hl[0])), len(hl)/4)
	}
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

// Free drops a sequence's KV cache slot.
func (s *Stage) Free(seq uint64) { s.pl.kv.release(seq) }

// Close releases the device memory, handles and (when New opened it) the
// device. It is safe on a partly built stage.
func (s *Stage) Close() error {
	if s.closed {
		return nil
	}
	s.closed = true
	var errs []error
	err := s.dev.Do(func() error {
		if s.stream != 0 {
			errs = append(errs, s.stream.Synchronize())
		}
		errs = append(errs, s.g.release())
		for _, m := range s.mems {
			errs = append(errs, m.Free())
		}
		for _, h := range s.hosts {
			errs = append(errs, gpu.FreeHost(h))
		}
		if s.blas != nil {
			errs = append(errs, s.blas.Destroy())
		}
		for _, e := range s.events {
			if e != 0 {
				errs = append(errs, e.Destroy())
			}
		}
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
		slog.Warn("cuda stage close", "err", err)
		return fmt.Errorf("close cuda stage [%d,%d): %w", s.lo, s.hi, err)
	}
	return nil
}
