package cuda

import (
	"fmt"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/stage"
)

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

// workspace is the layout of a stage's one workspace allocation: the byte
// offset of each buffer (-1 where the stage has none) and the total size.
// The buffers are sized for the stage's maxima, so that their addresses
// never change (CUDA graphs bake them in).
//
// Every step: the fp32 residual stream (what a stage hands on), the fp32
// input activations (not on the first stage), fp32 q. Steps of the cuBLAS
// path (more tokens than the skinny kernels take): the layer GEMMs' bf16
// inputs and fp32 outputs for twice the rows (compensated, see
// 00_common.cu). Steps of the skinny path: fp32 attention output and
// SwiGLU activations for gemvMaxTokens rows. The last stage: fp32 logits,
// the LM head's softmax partials, the sampler's output and the hand-off
// rows it reports; the first: the hand-off rows received, the token of each
// slot and the status array. Then the packed batch description, the
// rotary frequencies, flash-decoding partials and counters, the gemvt
// kernels' split partials and counters (when the plan has them) and the
// cuBLAS workspace.
type workspace struct {
	in, resid, q                         int
	normed, qkv, attnB, y, gateUp, act   int // cuBLAS path
	attnF, actF                          int // skinny path
	logits, stats, sampleOut, hoOut      int // last stage
	hoIn, hoTokens, status               int // first stage
	batch, invFreq, part, partML, counts int
	gtPart, gtCounts                     int // gemvt
	blas                                 int
	size                                 int
}

// planWorkspace lays out the workspace of a stage of model m with the
// batch layout lay.
func planWorkspace(m *model.Config, lay layout, first, last bool, sk *skinnyPlan, at attnPlan) workspace {
	const bf, f32, i32 = 2, 4, 4
	const f = 2 // rows per token of the cuBLAS path's GEMM inputs and outputs
	T, H, I := lay.maxTokens, m.HiddenSize, m.IntermediateSize
	qDim, kvDim := m.QDim(), m.KVDim()
	qkvDim := qDim + 2*kvDim
	none := -1
	var a arena
	w := workspace{in: none, attnF: none, actF: none, logits: none, stats: none, sampleOut: none, hoOut: none,
		hoIn: none, hoTokens: none, status: none, gtPart: none, gtCounts: none}
	if !first {
		w.in = a.take(T * H * f32)
	}
	w.resid = a.take(T * H * f32)
	w.q = a.take(T * qDim * f32)
	w.normed = a.take(f * T * H * bf)
	w.qkv = a.take(f * T * qkvDim * f32)
	w.attnB = a.take(f * T * qDim * bf)
	w.y = a.take(f * T * H * f32)
	w.gateUp = a.take(f * T * 2 * I * f32)
	w.act = a.take(f * T * I * bf)
	if sk.maxTokens > 0 {
		n := min(T, sk.maxTokens)
		w.attnF = a.take(n * qDim * f32)
		w.actF = a.take(n * I * f32)
	}
	if last {
		w.logits = a.take(lay.maxLogitRows * m.VocabSize * f32)
		// Softmax partials: of logit_stats for every row the LM head may
		// have on cuBLAS, of gemvh for up to gemvhMaxRows rows, else one
		// per unit (gemv) or per warp, at most one per warp unit (gemvf).
		n := max(lay.maxLogitRows*logitStatsPartials(m.VocabSize), min(lay.maxLogitRows, gemvhMaxRows)*gemvhMostPartials(m.VocabSize, at.sms))
		if sk.maxTokens > 0 {
			n = max(n, min(lay.maxLogitRows, sk.maxTokens)*sk.head.mma.grid, sk.fmaTokens*(sk.head.fma.grid+8))
		}
		w.stats = a.take(n * 4 * f32)
		if first {
			// The status words end where the sampler's output begins, so
			// that one copy reads both back (Stage.run); the sampler's
			// output stays aligned.
			w.sampleOut = a.take(256+lay.maxSeqs*sampleOutInts*i32) + 256
			w.status = w.sampleOut - statusWords*i32
		} else {
			w.sampleOut = a.take(lay.maxSeqs * sampleOutInts * i32)
		}
		w.hoOut = a.take(lay.maxSeqs * stage.HandoffCols * i32)
	}
	if first {
		w.hoIn = a.take(lay.maxSeqs * stage.HandoffCols * i32)
		w.hoTokens = a.take(lay.maxSeqs * i32)
		if !last {
			w.status = a.take(statusWords * i32)
		}
	}
	w.batch = a.take(lay.words() * i32)
	w.invFreq = a.take(m.HeadDim / 2 * f32)
	units, partials := at.scratch(T)
	w.part = a.take(partials * attentionHeads * m.HeadDim * f32)
	w.partML = a.take(partials * attentionHeads * 2 * f32)
	w.counts = a.take(units * i32)
	if sk.maxTokens > 8 && sk.qkv.mma.wide {
		partials, counters := sk.gemvtScratch()
		w.gtPart = a.take(partials * f32)
		w.gtCounts = a.take(counters * i32)
	}
	w.blas = a.take(cublasWorkspace)
	w.size = a.size
	return w
}

// WorkspaceBytes is the most device memory besides weights, KV cache and
// CUDA graphs that a stage of cfg's model and batch bounds takes (in
// whatever place of the pipeline: the input buffer of a later stage and
// the logits of the last counted together), for placement to count before
// any stage exists. A stage reports its own figure in Memory.
func WorkspaceBytes(cfg Config) (int64, error) {
	if cfg.Model != nil && cfg.Hi == 0 {
		cfg.Lo, cfg.Hi = 0, cfg.Model.NumLayers
	}
	if err := checkConfig(&cfg); err != nil {
		return 0, fmt.Errorf("cuda workspace: %w", err)
	}
	m := cfg.Model
	lay := newLayout(&cfg)
	sk := planSkinny(m, cfg.SkinnyTokens, true, smemOptinDefault)
	sk.widen(cfg.SkinnyTokens)
	at := newAttnPlan(m, smsEstimate)
	w := planWorkspace(m, lay, false, true, &sk, at)
	first := planWorkspace(m, lay, true, false, &sk, at)
	return int64(max(w.size, first.size)), nil
}
