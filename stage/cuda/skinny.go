package cuda

import (
	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/model"
)

// DefaultSkinnyTokens is the most token rows a step may have for its
// products to run on the skinny kernels (gemv.cu) rather than cuBLAS, when
// Config.SkinnyTokens is 0. Measured on an H200 with the Llama-3.2-1B and
// Llama-3.1-8B shapes (NOTES.md): at 1 to 32 rows the skinny kernels read
// the weights at 85-90% of the copy bandwidth, cuBLAS (compensated, twice
// the rows) at 55-65%.
const DefaultSkinnyTokens = gemvMaxTokens

// skinnyPlan is how a stage runs its products in steps of at most
// maxTokens token rows (0: never): one gemv launch per product, with the
// norms folded into the q|k|v, gate|up and LM-head products and the rest of
// the layer into their epilogues (rotary embedding and KV-cache write;
// SiLU·mul; the residual adds of the o and down projections; the LM head's
// softmax partials).
type skinnyPlan struct {
	maxTokens                  int
	qkv, o, gateUp, down, head gemvCall
}

// gemvCall is one product's launch: the kernel variant, the input width k,
// the rows per segment n, the row mapping (s, u, mh, seg; gemv.cu), the
// rotary partner's distance in local rows (q|k|v) and the number of units
// (blocks of mt tiles; the grid is at most that, see blocks).
type gemvCall struct {
	v                   gemvVariant
	k, n, s, u, mh, seg int
	pdelta, grid        int
}

// plain is a product over rows [0, n) in blocks of mt tiles.
func plain(v gemvVariant, k, n int) gemvCall {
	return gemvCall{v: v, k: k, n: n, s: 1, u: 16 * v.mt, mh: v.mt, grid: (n + 16*v.mt - 1) / (16 * v.mt)}
}

// planSkinny plans the skinny products of model m, limited to max token
// rows (Config.SkinnyTokens: 0 the default, negative never). It returns a
// plan with maxTokens 0 when the kernels cannot serve the model: widths
// that are not multiples of 8 (16-byte rows), or a head dim whose rotary
// pairs a block cannot hold (neither a multiple of 32 nor a divisor of 16),
// or a device without bf16 tensor cores (tensorCores false).
func planSkinny(m *model.Config, max int, tensorCores bool) skinnyPlan {
	switch {
	case max == 0:
		max = DefaultSkinnyTokens
	case max < 0:
		return skinnyPlan{}
	}
	H, I, hd := m.HiddenSize, m.IntermediateSize, m.HeadDim
	qDim := m.QDim()
	qkvRows := qDim + 2*m.KVDim()
	if !tensorCores || H%8 != 0 || I%8 != 0 || qDim%8 != 0 {
		return skinnyPlan{}
	}
	p := skinnyPlan{maxTokens: min(max, gemvMaxTokens)}
	switch {
	case hd%32 == 0:
		// Block = tiles j and j + hd/32 of one head: rows i and i + hd/2.
		s := hd / 32
		p.qkv = gemvCall{v: gemvVariant{epiRope, 2}, k: H, n: qkvRows, s: s, u: hd, mh: 1, seg: hd / 2,
			pdelta: 16, grid: (m.NumHeads + 2*m.NumKVHeads) * s}
	case 16%hd == 0:
		// Block = one tile of whole heads.
		p.qkv = plain(gemvVariant{epiRope, 1}, H, qkvRows)
		p.qkv.pdelta = hd / 2
	default:
		return skinnyPlan{}
	}
	p.o = plain(gemvVariant{epiResid, 1}, qDim, H)
	p.gateUp = plain(gemvVariant{epiSilu, 2}, H, I)
	p.gateUp.mh, p.gateUp.u, p.gateUp.seg = 1, 16, I
	p.gateUp.grid = (I + 15) / 16
	p.down = plain(gemvVariant{epiResid, 1}, I, H)
	p.head = plain(gemvVariant{epiHead, 4}, H, m.VocabSize)
	return p
}

// use reports whether a step of t token rows runs on the skinny kernels.
func (p *skinnyPlan) use(t int) bool { return t > 0 && t <= p.maxTokens }

// gemvNTFor is the number of 8-token column groups a gemv launch covers
// for t tokens.
func gemvNTFor(t int) int {
	switch {
	case t <= 8:
		return 1
	case t <= 16:
		return 2
	}
	return 4
}

// gemvIO is what one gemv launch reads and writes besides its weights: the
// fp32 input rows x (rowmap: which row of x each token column reads, 0:
// the column's own), the norm weight g (0: no norm), the output and its
// row stride, and for q|k|v the bias, positions, cache rows and caches,
// for the LM head the softmax partials.
type gemvIO struct {
	x, rowmap, g          gpu.DevicePtr
	out                   gpu.DevicePtr
	ldo                   int
	bias, pos, cacheRow   gpu.DevicePtr
	kcache, vcache, stats gpu.DevicePtr
}

// gemv launches product c of weights w for t token rows.
func (s *Stage) gemv(label string, c *gemvCall, w gpu.DevicePtr, t int, io gemvIO) error {
	nt := gemvNTFor(t)
	a := c.args(s.args.Reset(), &s.m, w, t, io, s.b.invFreq)
	grid := gpu.Dim3{X: uint32(c.blocks(nt, s.dev.Info().SMs))}
	return s.launchDep(label, gemvName(c.v, nt), grid, gpu.Dim3{X: gemvThreads}, gemvSmem(c.v.mt, nt), a)
}

// blocks is the grid of a launch of c for nt token groups on a device of
// sms multiprocessors: the persistent blocks that fit at once, at most one
// per unit (c.grid).
func (c *gemvCall) blocks(nt, sms int) int {
	return max(1, min(c.grid, sms*gemvBlocksPerSM(c.v, nt)))
}

// gemvBlocksPerSM is the resident blocks a gemv kernel is compiled for
// (the minb of its GEMV_ENTRY): two, but one for the kernels with the most
// accumulators.
func gemvBlocksPerSM(v gemvVariant, nt int) int {
	if v.mt == 4 || v.mt*nt == 8 {
		return 1
	}
	return 2
}

// args appends the parameters of a launch of c (GEMV_PARAMS in gemv.cu).
func (c *gemvCall) args(a *gpu.KernelArgs, m *model.Config, w gpu.DevicePtr, t int, io gemvIO, invFreq gpu.DevicePtr) *gpu.KernelArgs {
	return a.Ptr(w).Ptr(io.x).Ptr(io.rowmap).Ptr(io.g).Float32(float32(m.RMSNormEps)).
		Int32(int32(c.k)).Int32(int32(c.n)).Int32(int32(t)).
		Int32(int32(c.s)).Int32(int32(c.u)).Int32(int32(c.mh)).Int32(int32(c.seg)).Int32(int32(c.grid)).
		Ptr(io.out).Int32(int32(io.ldo)).Ptr(io.bias).Ptr(invFreq).Ptr(io.pos).Ptr(io.cacheRow).
		Ptr(io.kcache).Ptr(io.vcache).Int32(int32(m.NumHeads)).Int32(int32(m.NumKVHeads)).Int32(int32(m.HeadDim)).
		Int32(int32(c.pdelta)).Ptr(io.stats)
}

// attnPlan is how attention splits the sequence (flash-decoding): enough
// blocks of (token, kv head, head group, split) to fill the device several
// times over, at most attnMaxSplits parts (the kernel uses fewer for short
// sequences: parts of at least 32 keys).
type attnPlan struct {
	nkv, groups int
	rmax        int // query heads per block: the kernel attention_r<rmax>
}

const (
	attnTargetBlocks = 1024
	attnMaxSplits    = 16
)

func newAttnPlan(m *model.Config) attnPlan {
	r := m.NumHeads / m.NumKVHeads
	rmax := attentionHeads
	for _, v := range attentionVariants {
		if v >= r {
			rmax = v
			break
		}
	}
	return attnPlan{nkv: m.NumKVHeads, groups: (r + rmax - 1) / rmax, rmax: rmax}
}

// splits is how many parts a step of t tokens cuts each sequence into.
func (a attnPlan) splits(t int) int {
	units := t * a.nkv * a.groups
	return max(1, min(attnMaxSplits, (attnTargetBlocks+units-1)/units))
}

// scratch is what steps of up to maxTokens tokens need: counters (one per
// (token, kv head, group)) and partial results (one per counter and split).
func (a attnPlan) scratch(maxTokens int) (units, partials int) {
	units = maxTokens * a.nkv * a.groups
	for t := 1; t <= maxTokens; t++ {
		if sp := a.splits(t); sp > 1 {
			partials = max(partials, t*a.nkv*a.groups*sp)
		}
	}
	return units, max(partials, 1)
}
