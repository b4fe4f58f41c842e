package cpu

import (
	"errors"
	"fmt"
	"math"
	"runtime"
	"unsafe"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/stage"
)

// Config describes the stage to build.
type Config struct {
	Model   *model.Config
	Lo, Hi  int // layer range [Lo, Hi)
	Weights stage.Weights
	// MaxTokens and MaxSeqs bound one batch.
	MaxTokens, MaxSeqs int
	// NumBlocks and BlockSize size the paged KV cache: NumBlocks blocks of
	// BlockSize positions, for every layer of the stage (BlockSize 0:
	// stage.DefaultBlockSize; NumBlocks 0: enough for MaxSeqs sequences of
	// Model.MaxPositions). The leader's block size must be the same.
	NumBlocks, BlockSize int
	// Threads is how many goroutines a Forward uses (0: GOMAXPROCS).
	Threads int
}

// Stage is a CPU pipeline stage. It implements stage.Stage.
type Stage struct {
	m            model.Config
	lo, hi       int
	first, last  bool
	maxTokens    int
	maxSeqs      int
	threads      int
	qDim, kvDim  int // NumHeads·HeadDim and NumKVHeads·HeadDim
	qkvDim       int // qDim + 2·kvDim: one row of the fused q/k/v projection
	attnScale    float32
	invFreq      []float64 // rotary inverse frequencies, HeadDim/2 of them
	layers       []layer
	embed        []float32 // [Vocab × Hidden], first stage
	norm         []float32 // final norm, last stage
	lmHead       []float32 // [Vocab × Hidden], last stage (aliases embed when tied)
	seqs         map[uint64]*seqState
	numBlocks    int
	blockSize    int
	kPool, vPool [][]float32 // per layer: [NumBlocks·BlockSize × kvDim]
	closed       bool
	sampler      sampler
	buf          buffers
	runs         []seqRun        // the current batch's chunks, in batch order
	created      []uint64        // sequences the current Forward added to seqs
	headRows     []int           // rows whose logits the current batch needs
	inputBuffer  collective.Host // byte view of buf.in
	outputBuffer collective.Host // byte view of buf.x
	ho           handoff
}

// handoff is the stage's part of on-device hand-off: the rows the last stage
// reports, the rows the first stage receives and the token recorded for each
// slot (first stage).
type handoff struct {
	in     []int32         // [MaxSeqs × HandoffCols] received rows (first)
	out    []int32         // [MaxSeqs × HandoffCols] reported rows (last); in itself on a stage that is both
	tokens []int32         // [MaxSeqs] the token last recorded for each slot, -1: none (first)
	seen   []bool          // [MaxSeqs] scratch of ApplyHandoff's duplicate check
	inBuf  collective.Host // byte view of in
	outBuf collective.Host // byte view of out
}

// layer holds one transformer layer's weights in float32, row-major as
// Hugging Face stores them ([out × in]). The q, k and v projections are fused
// into one [qkvDim × Hidden] matrix, gate and up into one [2·Intermediate ×
// Hidden] matrix.
type layer struct {
	inNorm, postNorm []float32
	qkv              []float32
	qkvBias          []float32 // nil without attention bias
	o                []float32
	gateUp           []float32
	down             []float32
}

// buffers are the activation and scratch buffers, sized for MaxTokens rows.
type buffers struct {
	in       []float32 // [MaxTokens × Hidden] received activations (not first)
	x        []float32 // [MaxTokens × Hidden] residual stream, sent to the next stage
	xn       []float32 // [MaxTokens × Hidden] normalised rows
	qkv      []float32 // [MaxTokens × qkvDim]
	attn     []float32 // [MaxTokens × qDim]
	gateUp   []float32 // [MaxTokens × 2·Intermediate]
	act      []float32 // [MaxTokens × Intermediate]
	cos, sin []float32 // [MaxTokens × HeadDim/2]
	scores   []float32 // [Threads × MaxPositions] attention scores per worker
	logits   []float32 // [MaxSeqs × Vocab] (last)
}

// New loads the weights of a stage and allocates its buffers.
func New(cfg Config) (*Stage, error) {
	if err := checkConfig(&cfg); err != nil {
		return nil, fmt.Errorf("cpu stage: %w", err)
	}
	m := *cfg.Model
	s := &Stage{
		m:         m,
		lo:        cfg.Lo,
		hi:        cfg.Hi,
		first:     cfg.Lo == 0,
		last:      cfg.Hi == m.NumLayers,
		maxTokens: cfg.MaxTokens,
		maxSeqs:   cfg.MaxSeqs,
		threads:   cfg.Threads,
		qDim:      m.QDim(),
		kvDim:     m.KVDim(),
		attnScale: float32(1 / math.Sqrt(float64(m.HeadDim))),
		invFreq:   m.RopeInvFreq(),
		seqs:      make(map[uint64]*seqState),
		blockSize: cfg.BlockSize,
		numBlocks: cfg.NumBlocks,
		runs:      make([]seqRun, 0, cfg.MaxSeqs),
		created:   make([]uint64, 0, cfg.MaxSeqs),
	}
	if s.threads == 0 {
		s.threads = runtime.GOMAXPROCS(0)
	}
	s.qkvDim = s.qDim + 2*s.kvDim
	if err := s.load(cfg.Weights); err != nil {
		return nil, fmt.Errorf("cpu stage [%d,%d): %w", s.lo, s.hi, err)
	}
	s.allocate()
	return s, nil
}

// checkConfig checks cfg and fills in the KV cache's defaults.
func checkConfig(cfg *Config) error {
	if err := stage.CheckModel(cfg.Model, cfg.Lo, cfg.Hi); err != nil {
		return err
	}
	m := cfg.Model
	switch {
	case cfg.Weights == nil:
		return errors.New("no weights")
	case cfg.MaxTokens <= 0 || cfg.MaxSeqs <= 0:
		return fmt.Errorf("max tokens %d and max seqs %d must be positive", cfg.MaxTokens, cfg.MaxSeqs)
	case cfg.Threads < 0:
		return fmt.Errorf("threads %d is negative", cfg.Threads)
	case cfg.NumBlocks < 0 || cfg.BlockSize < 0:
		return fmt.Errorf("KV cache of %d blocks of %d positions: neither may be negative", cfg.NumBlocks, cfg.BlockSize)
	}
	if cfg.BlockSize == 0 {
		cfg.BlockSize = stage.DefaultBlockSize
	}
	if cfg.NumBlocks == 0 {
		cfg.NumBlocks = cfg.MaxSeqs * ((m.MaxPositions + cfg.BlockSize - 1) / cfg.BlockSize)
	}
	if cfg.NumBlocks > math.MaxInt32 {
		return fmt.Errorf("KV cache of %d blocks: block ids are 32-bit", cfg.NumBlocks)
	}
	return nil
}

func (s *Stage) allocate() {
	h, t := s.m.HiddenSize, s.maxTokens
	b := &s.buf
	if !s.first {
		b.in = make([]float32, t*h)
		s.inputBuffer = hostBytes(b.in)
	}
	b.x = make([]float32, t*h)
	s.outputBuffer = hostBytes(b.x)
	ho := &s.ho
	if s.first {
		ho.in = make([]int32, s.maxSeqs*stage.HandoffCols)
		ho.inBuf = hostBytes(ho.in)
		ho.tokens = make([]int32, s.maxSeqs)
		for i := range ho.tokens {
			ho.tokens[i] = -1
		}
		ho.seen = make([]bool, s.maxSeqs)
	}
	if s.last {
		ho.out, ho.outBuf = ho.in, ho.inBuf
		if !s.first {
			ho.out = make([]int32, s.maxSeqs*stage.HandoffCols)
			ho.outBuf = hostBytes(ho.out)
		}
	}
	b.xn = make([]float32, t*h)
	b.qkv = make([]float32, t*s.qkvDim)
	b.attn = make([]float32, t*s.qDim)
	b.gateUp = make([]float32, t*2*s.m.IntermediateSize)
	b.act = make([]float32, t*s.m.IntermediateSize)
	b.cos = make([]float32, t*s.m.HeadDim/2)
	b.sin = make([]float32, t*s.m.HeadDim/2)
	b.scores = make([]float32, s.threads*s.m.MaxPositions)
	s.kPool = make([][]float32, len(s.layers))
	s.vPool = make([][]float32, len(s.layers))
	for l := range s.layers {
		s.kPool[l] = make([]float32, s.numBlocks*s.blockSize*s.kvDim)
		s.vPool[l] = make([]float32, s.numBlocks*s.blockSize*s.kvDim)
	}
	if s.last {
		b.logits = make([]float32, s.maxSeqs*s.m.VocabSize)
		s.sampler = newSampler(s.m.VocabSize)
		s.headRows = make([]int, 0, s.maxTokens)
	}
}

// hostBytes views a slice of 4-byte values as its bytes in host order.
func hostBytes[T float32 | int32](f []T) collective.Host {
	return collective.Host(unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(f))), 4*len(f)))
}

// Info implements stage.Stage.
func (s *Stage) Info() stage.Info {
	return stage.Info{
		Backend:   "cpu",
		Lo:        s.lo,
		Hi:        s.hi,
		First:     s.first,
		Last:      s.last,
		Hidden:    s.m.HiddenSize,
		Vocab:     s.m.VocabSize,
		MaxTokens: s.maxTokens,
		MaxSeqs:   s.maxSeqs,
		ActDType:  collective.F32,
		KVBlocks:  s.numBlocks,
		BlockSize: s.blockSize,
	}
}

// Input implements stage.Stage: MaxTokens rows of Hidden float32 values, nil
// on the first stage.
func (s *Stage) Input() collective.Buffer {
	if s.first || s.closed {
		return nil
	}
	return s.inputBuffer
}

// Free implements stage.Stage: the stage forgets the sequence's cached
// length, so that it may start again at position 0. Its blocks are the
// leader's. Freeing an unknown sequence does nothing.
func (s *Stage) Free(seq uint64) {
	delete(s.seqs, seq)
}

// Close implements stage.Stage: it drops the weights, buffers and caches.
// Forward fails afterwards.
func (s *Stage) Close() error {
	s.closed = true
	s.layers, s.embed, s.norm, s.lmHead = nil, nil, nil, nil
	s.seqs = nil
	s.kPool, s.vPool = nil, nil
	s.buf = buffers{}
	s.sampler = sampler{}
	s.inputBuffer, s.outputBuffer = nil, nil
	s.ho = handoff{}
	return nil
}

var (
	_ stage.Stage           = (*Stage)(nil)
	_ stage.HandoffReceiver = (*Stage)(nil)
)
