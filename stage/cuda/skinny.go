package cuda

import (
	"math"

	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/model"
)

// DefaultSkinnyTokens is the most token rows a step may have for its
// products to run on the skinny kernels rather than cuBLAS, when
// Config.SkinnyTokens is 0, before the stage measures where they win
// (tuneSkinny): past it cuBLAS's wide tiles read the weights faster than
// gemv.cu's tensor-core kernels, fusion included (NOTES.md).
const DefaultSkinnyTokens = 8

// skinnyPlan is how a stage runs its products in steps of at most
// maxTokens token rows (0: never): one launch per product, with the norms
// folded into the q|k|v, gate|up and LM-head products and the rest of the
// layer into their epilogues (rotary embedding and KV-cache write;
// SiLU·mul; the residual adds of the o and down projections; the LM head's
// softmax partials). Steps of at most fmaTokens rows use the fp32
// multiply-add kernels (gemvf.cu), longer ones the tensor-core kernels
// (gemv.cu).
type skinnyPlan struct {
	maxTokens, fmaTokens       int
	qkv, o, gateUp, down, head product
	// tune says maxTokens is the most the kernels take, to be narrowed
	// by measurement once the weights are in (tuneSkinny).
	tune bool
}

// product is one product's launch on either kernel family.
type product struct{ mma, fma gemvCall }

// gemvCall is one product's launch: the kernel variant (mt 0: the gemvf
// family), the input width k, the rows per segment n, the row mapping (s,
// u, mh, seg; gemv.cu — for gemvf s, u, seg = d and dn; gemvf.cu), the
// rotary partner's distance in local rows (q|k|v, gemv.cu) and the number
// of units (gemv: blocks of mt tiles; gemvf: warp units of 4 rows). A wide
// call runs steps of more than 8 tokens on the gemvt kernel of its
// variant (gemvt.cu), same units and mapping. ks, for gemvf, fixes how
// many warps share a unit (0: fmaSplits chooses).
type gemvCall struct {
	v                   gemvVariant
	k, n, s, u, mh, seg int
	dn                  int
	pdelta, grid        int
	ks                  int
	wide                bool
}

// plain is a product over rows [0, n) in blocks of mt tiles.
func plain(v gemvVariant, k, n int) gemvCall {
	return gemvCall{v: v, k: k, n: n, s: 1, u: 16 * v.mt, mh: v.mt, grid: (n + 16*v.mt - 1) / (16 * v.mt)}
}

// smemOptinDefault is the shared memory a block may have on the devices
// the workspace estimate assumes (Hopper) when none is at hand.
const smemOptinDefault = 227 << 10

// planSkinny plans the skinny products of model m, limited to max token
// rows (limit: Config.SkinnyTokens, 0 the default, negative never), on a device
// with bf16 tensor cores or not and smemOptin bytes of shared memory a
// block can take. The tensor-core kernels need widths that are multiples
// of 8 (16-byte rows) and a head dim whose rotary pairs a block can hold
// (a multiple of 32 or a divisor of 16); the fp32 ones need the
// activations of their steps in shared memory. A plan with maxTokens 0
// runs every product on cuBLAS.
func planSkinny(m *model.Config, limit int, tensorCores bool, smemOptin int) skinnyPlan {
	choose := limit == 0
	switch {
	case limit == 0:
		limit = DefaultSkinnyTokens
	case limit < 0:
		return skinnyPlan{}
	}
	H, I, hd := m.HiddenSize, m.IntermediateSize, m.HeadDim
	qDim := m.QDim()
	qkvRows := qDim + 2*m.KVDim()
	if H%8 != 0 || I%8 != 0 || qDim%8 != 0 || hd%4 != 0 {
		return skinnyPlan{}
	}
	var p skinnyPlan
	maxK := max(H, I, qDim)
	for _, tt := range gemvfTokens {
		if tt <= limit && gemvfSmem(tt, maxK) <= smemOptin {
			p.fmaTokens = tt
		}
	}
	heads := m.NumHeads + 2*m.NumKVHeads
	p.qkv.fma = gemvCall{v: gemvVariant{epi: epiRope}, k: H, n: qkvRows, s: hd / 4, u: hd, seg: hd / 2, dn: hd / 2, grid: heads * hd / 4}
	p.o.fma = gemvCall{v: gemvVariant{epi: epiResid}, k: qDim, n: H, s: 1, u: 4, seg: 2, dn: 2, grid: (H + 3) / 4}
	p.gateUp.fma = gemvCall{v: gemvVariant{epi: epiSilu}, k: H, n: I, s: 1, u: 2, seg: I, grid: (I + 1) / 2}
	p.down.fma = gemvCall{v: gemvVariant{epi: epiResid}, k: I, n: H, s: 1, u: 4, seg: 2, dn: 2, grid: (H + 3) / 4}
	p.head.fma = gemvCall{v: gemvVariant{epi: epiHead}, k: H, n: m.VocabSize, s: 1, u: 4, seg: 2, dn: 2, grid: (m.VocabSize + 3) / 4}
	p.maxTokens = p.fmaTokens
	if !tensorCores {
		return p
	}
	switch {
	case hd%32 == 0:
		// Block = tiles j and j + hd/32 of one head: rows i and i + hd/2.
		s := hd / 32
		p.qkv.mma = gemvCall{v: gemvVariant{epiRope, 2}, k: H, n: qkvRows, s: s, u: hd, mh: 1, seg: hd / 2,
			pdelta: 16, grid: heads * s}
	case 16%hd == 0:
		// Block = one tile of whole heads.
		p.qkv.mma = plain(gemvVariant{epiRope, 1}, H, qkvRows)
		p.qkv.mma.pdelta = hd / 2
	default:
		return p
	}
	p.o.mma = plain(gemvVariant{epiResid, 1}, qDim, H)
	p.gateUp.mma = plain(gemvVariant{epiSilu, 2}, H, I)
	p.gateUp.mma.mh, p.gateUp.mma.u, p.gateUp.mma.seg = 1, 16, I
	p.gateUp.mma.grid = (I + 15) / 16
	p.down.mma = plain(gemvVariant{epiResid, 1}, I, H)
	p.head.mma = plain(gemvVariant{epiHead, 4}, H, m.VocabSize)
	p.maxTokens = max(p.fmaTokens, min(limit, gemvMaxTokens))
	// Whether the tensor-core kernels beat cuBLAS at all is measured too.
	p.tune = choose && p.maxTokens > p.fmaTokens
	return p
}

// widen lets the tensor-core products run steps of more than 8 tokens on
// the gemvt kernels (the optional part of the program compiled): all of
// them or none. With limit 0 (Config.SkinnyTokens unset) the plan then
// takes steps of up to gemvMaxTokens rows, which the stage narrows by
// measurement once its weights are in (tuneSkinny).
func (p *skinnyPlan) widen(limit int) {
	calls := p.mmaCalls()
	if len(calls) == 0 {
		return
	}
	for _, c := range calls {
		if !hasGemvt(c.v) {
			return
		}
	}
	for _, c := range calls {
		c.wide = true
	}
	if limit == 0 {
		p.maxTokens, p.tune = gemvMaxTokens, true
	}
}

// mmaCalls are the tensor-core calls of the plan (none without tensor
// cores).
func (p *skinnyPlan) mmaCalls() []*gemvCall {
	if p.qkv.mma.grid == 0 {
		return nil
	}
	return []*gemvCall{&p.qkv.mma, &p.o.mma, &p.gateUp.mma, &p.down.mma, &p.head.mma}
}

// gemvtScratch is what the gemvt launches of the plan need at most: floats
// of split partials and row-block counters.
func (p *skinnyPlan) gemvtScratch() (partials, counters int) {
	for _, c := range p.mmaCalls() {
		if !c.wide {
			continue
		}
		rb := c.gemvtBlocks()
		counters = max(counters, rb)
		if sp := c.gemvtMaxSplits(); sp > 1 {
			partials = max(partials, rb*sp*c.gemvtStride())
		}
	}
	return max(partials, 1), max(counters, 1)
}

// gemvtBlocks is the row blocks of a gemvt launch of c: gtWarps units each.
func (c *gemvCall) gemvtBlocks() int { return (c.grid + gtWarps - 1) / gtWarps }

// gemvtStride is the floats of one block's split partials: its units' sums
// for every token column, and the columns' sums of squares.
func (c *gemvCall) gemvtStride() int { return gtWarps*16*c.v.mt*gtC + gtC }

// gemvtMaxSplits is the most splits of k a gemvt launch of c takes: each
// of at least gtMinChunks chunks, at most gtMaxSplits, and no more than
// fill a device of smsEstimate multiprocessors once (the workspace holds
// their partials).
func (c *gemvCall) gemvtMaxSplits() int {
	rb := c.gemvtBlocks()
	fill := (smsEstimate*gemvtBlocksPerSM(c.v.mt) + rb - 1) / rb
	return normSplits(c.k, min(gtMaxSplits, (c.k+gtKC-1)/gtKC/gtMinChunks, fill))
}

// gemvtSplits is the splits of k of a gemvt launch of c on a device of sms
// multiprocessors: as many blocks as it holds at once (one wave), within
// gemvtMaxSplits. It depends on the product alone, never on the token
// count, so that a token column's result is the same whatever else a step
// holds.
func (c *gemvCall) gemvtSplits(sms int) int {
	rb := c.gemvtBlocks()
	target := sms * gemvtBlocksPerSM(c.v.mt)
	return normSplits(c.k, min(target/rb, c.gemvtMaxSplits()))
}

// normSplits is the number of non-empty splits when k is cut into sp
// parts of whole chunks (at least 1).
func normSplits(k, sp int) int {
	nch := (k + gtKC - 1) / gtKC
	sp = max(1, min(sp, nch))
	per := (nch + sp - 1) / sp
	return (nch + per - 1) / per
}

// call is the launch of product p for t token rows.
func (sp *skinnyPlan) call(p *product, t int) *gemvCall {
	if t <= sp.fmaTokens {
		return &p.fma
	}
	return &p.mma
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
// for the LM head the softmax partials; for a gemvt launch split along k,
// its partials and counters; for q|k|v on gemvf, the block tables, so that
// it can prefetch attention's first keys.
type gemvIO struct {
	x, rowmap, g          gpu.DevicePtr
	out                   gpu.DevicePtr
	ldo                   int
	bias, pos, cacheRow   gpu.DevicePtr
	kcache, vcache, stats gpu.DevicePtr
	part, counters        gpu.DevicePtr
	tables, tableOff      gpu.DevicePtr
	bs                    int
}

// gemv launches product p of weights w for t token rows.
func (s *Stage) gemv(label string, p *product, w gpu.DevicePtr, t int, io gemvIO) error {
	c := s.sk.call(p, t)
	info := s.dev.Info()
	l := c.launch(t, info.SMs, info.MaxSharedPerBlockOptin)
	io.part, io.counters = s.b.gtPart, s.b.gtCounts
	a := c.args(s.args.Reset(), &s.m, w, t, io, s.b.invFreq, l)
	return s.launchDep(label, l.name, l.gridDim(), gpu.Dim3{X: uint32(l.threads)}, l.smem, a)
}

// gemvLaunch is how a product is launched on a device: the kernel, its
// grid (blocks, and for gemvt the splits of k), threads and dynamic
// shared memory.
type gemvLaunch struct {
	name                        string
	grid, splits, threads, smem int
	ks                          int // gemvf: warps a unit
}

// gridDim is the launch's grid.
func (l gemvLaunch) gridDim() gpu.Dim3 {
	return gpu.Dim3{X: uint32(l.grid), Y: uint32(max(1, l.splits))}
}

// launch is the launch of c for t token rows on a device of sms
// multiprocessors and smemOptin bytes of shared memory per block. Blocks
// are persistent: as many as fit at once (two per multiprocessor, one for
// the kernels with the most accumulators or shared memory), at most one
// per unit (gemv) or per 8 warp units (gemvf).
func (c *gemvCall) launch(t, sms, smemOptin int) gemvLaunch {
	if c.v.mt == 0 {
		tt := gemvfTT(t)
		smem := gemvfSmem(tt, c.k)
		ks := c.fmaSplits(sms, smemOptin)
		return gemvLaunch{name: gemvfName(c.v.epi, tt), grid: max(1, min((c.grid*ks+gemvWarps-1)/gemvWarps, sms*gemvfBlocksPerSM(smem, smemOptin))),
			threads: gemvThreads, smem: smem, ks: ks}
	}
	if c.wide && t > 8 {
		return gemvLaunch{name: gemvtName(c.v), grid: c.gemvtBlocks(), splits: c.gemvtSplits(sms), threads: gtThreads,
			smem: gemvtSmem(c.v.mt)}
	}
	nt := gemvNTFor(t)
	return gemvLaunch{name: gemvName(c.v, nt), grid: max(1, min(c.grid, sms*gemvBlocksPerSM(c.v, nt))), threads: gemvThreads,
		smem: gemvSmem(c.v.mt, nt)}
}

// gemvfBlocksPerSM is the resident blocks of a gemvf kernel of smem bytes
// of shared memory: two (its launch bounds), or one when two don't fit.
func gemvfBlocksPerSM(smem, smemOptin int) int { return max(1, min(2, smemOptin/smem)) }

// gemvfMinPart is the fewest elements of k a warp sharing a unit reads:
// two 256-element chunks, half a batch of loads.
const gemvfMinPart = 512

// fmaSplits is how many warps share each unit of gemvf launch c (1, 2, 4
// or 8) on a device of sms multiprocessors: the count, among those that
// leave each warp at least gemvfMinPart elements, whose virtual warps fill
// the resident warps' last round best (the fewest on ties within 2%), so
// that a product of few units (the 1B shape's q|k|v, o and down: 512 to
// 768 units for 2,112 resident warps) keeps every multiprocessor reading.
// The LM head (softmax partials per warp) always has 1. It depends on the
// product and device alone, never on the token count (the kernel for the
// most rows sets the residency), so that a token's result is the same
// whatever else a step holds.
func (c *gemvCall) fmaSplits(sms, smemOptin int) int {
	if c.ks > 0 {
		return c.ks
	}
	if c.v.epi == epiHead {
		return 1
	}
	per := gemvfBlocksPerSM(gemvfSmem(gemvfTokens[len(gemvfTokens)-1], c.k), smemOptin)
	slots := float64(max(1, sms) * per * gemvWarps)
	best, bestEff := 1, 0.0
	for _, ks := range c.splitCounts() {
		rounds := float64(c.grid*ks) / slots
		if eff := rounds / math.Ceil(rounds); eff > bestEff+0.02 {
			best, bestEff = ks, eff
		}
	}
	return best
}

// splitCounts is the counts of warps that may share a unit of gemvf launch
// c, in increasing order: 1, 2, 4 and 8 (dividing a block's warps) while
// each warp keeps at least gemvfMinPart elements.
func (c *gemvCall) splitCounts() []int {
	n := []int{1}
	for ks := 2; ks <= gemvWarps && c.k/ks >= gemvfMinPart; ks *= 2 {
		n = append(n, ks)
	}
	return n
}

// gemvfTT is the gemvf kernel for t tokens: the fewest rows compiled
// that hold t.
func gemvfTT(t int) int {
	for _, tt := range gemvfTokens {
		if tt >= t {
			return tt
		}
	}
	return gemvfTokens[len(gemvfTokens)-1]
}

// stats is how many softmax partials per token row the LM-head launch c
// writes for t tokens: one per unit (gemv) or per warp (gemvf).
func (c *gemvCall) stats(t, sms, smemOptin int) int {
	if c.v.mt == 0 {
		return c.launch(t, sms, smemOptin).grid * gemvWarps
	}
	return c.grid
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

// args appends the parameters of launch l of c (GEMV_PARAMS in gemv.cu,
// GEMVF_PARAMS in gemvf.cu, GEMVT_PARAMS in gemvt.cu).
func (c *gemvCall) args(a *gpu.KernelArgs, m *model.Config, w gpu.DevicePtr, t int, io gemvIO, invFreq gpu.DevicePtr, l gemvLaunch) *gpu.KernelArgs {
	a.Ptr(w).Ptr(io.x).Ptr(io.rowmap).Ptr(io.g).Float32(float32(m.RMSNormEps)).
		Int32(int32(c.k)).Int32(int32(c.n)).Int32(int32(t)).Int32(int32(c.s)).Int32(int32(c.u))
	if c.v.mt == 0 {
		a.Int32(int32(c.seg)).Int32(int32(c.dn))
	} else {
		a.Int32(int32(c.mh)).Int32(int32(c.seg))
	}
	a.Int32(int32(c.grid))
	if c.v.mt == 0 {
		a.Int32(int32(l.ks))
	}
	a.Ptr(io.out).Int32(int32(io.ldo)).Ptr(io.bias).Ptr(invFreq).Ptr(io.pos).Ptr(io.cacheRow).
		Ptr(io.kcache).Ptr(io.vcache).Int32(int32(m.NumHeads)).Int32(int32(m.NumKVHeads)).Int32(int32(m.HeadDim))
	if c.v.mt != 0 {
		a.Int32(int32(c.pdelta))
	}
	a.Ptr(io.stats)
	if c.v.mt == 0 {
		a.Ptr(io.tables).Ptr(io.tableOff).Int32(int32(io.bs))
	}
	if l.splits > 0 {
		a.Int32(int32(l.splits)).Ptr(io.part).Ptr(io.counters)
	}
	return a
}

// attnPlan is how attention splits the sequence (flash-decoding) in a
// step of t tokens (attnLaunch): blocks of (token, kv head, head group,
// split), at most attnMaxSplits parts (the kernel uses fewer for short
// sequences: parts of at least minChunk keys). A step of at most sms units
// (token, kv head, group) has blocks of 16 warps, one per multiprocessor
// aimed at, and parts of at least 2^20 / hd² keys (256 at head dim 64, 64
// at 128); a larger one blocks of 4 warps, attnBlocksPerSM per
// multiprocessor, parts of at least 64 keys. A block's time is mostly
// latency: many short parts cost more in waves and merges than they gain.
// Measured (TestSkinnyBandwidth, one H100, us): 1 token of 256 keys, 4
// warps with 16 splits against 16 warps with the plan's parts: 8.9 -> 8.3
// (1B), 14.0 -> 10.8 (8B); of 4,096 keys 21.6 -> 18.2 and 40.1 -> 24.3;
// 32 tokens of 256 keys: 17.3 / 30.7 with 4 warps, 22.4 / 35.5 with 16.
// Where the tensor-core kernel can serve (gqa) it serves every step:
// measured on one H200 (us, 1B / 8B shapes), 1 token of 256 keys 8.5 /
// 13.8 -> 6.3 / 10.1 (8 warps, 16 splits), of 4,096 keys 16.7 / 23.3 ->
// 11.2 / 19.3; 32 tokens of 256 keys 17.1 / 29.9 -> 12.9 / 21.9 (4 warps,
// 1 split), of 1,024 keys 40.4 / 77.9 -> 45.7 / 76.9 (the one loss).
// With its tiles copied two deep by cp.async (H200, us, 1B / 8B): 1 token
// of 4,096 keys 10.8 / 19.6 -> 12.0 / 17.1; 32 tokens of 256 keys 12.8 /
// 22.1 -> 8.7 / 16.0 and of 1,024 keys 45.4 / 76.4 -> 24.5 / 51.3, with 8
// warps at head dim 64 (4: 11.8 and 39.8) and 4 at 128 (8: 21.3, 60.1).
type attnPlan struct {
	nkv, groups int
	rmax        int // query heads per block: the kernel attention_r<rmax>_w<warps>
	sms, hd     int
	// gqa says attention_gqa_d<hd>_w<w> can serve the model (tensor
	// cores, a head dim it is compiled for, at most 8 query heads a kv
	// head: one group); then every step uses it, with 8 warps a block
	// while the step has at most sms units or the head dim is at most 64,
	// else 4 (gqaWarps, when not 0, fixes it: tests), about sms blocks,
	// and parts of at least the keys its stages hold (gqaStages tiles of
	// 16 keys a warp: copied in one round, so a short sequence is one part
	// and needs no merge). Measured on one H200 against parts of at least
	// 64 keys, GPU ms of a decode step: 1B batch 1 0.877 -> 0.862, batch 8
	// 1.212 -> 1.191, batch 32 unchanged; 8B batch 1 4.351 -> 4.324, batch
	// 32 5.456 -> 5.493 (NOTES.md).
	gqa      bool
	gqaWarps int
	// warps and minChunk, when not 0, fix the per-row kernel's block and
	// least part (tests).
	warps, minChunk int
}

// attnLaunch is attention's launch for a step: the kernel, its block,
// dynamic shared memory, splits and least part; ropeName, when not empty,
// the kernel's form that also rotates and caches q|k|v (decode steps), and
// ropePlanesName its form for q|k|v in gemvs.cu's planes.
type attnLaunch struct {
	name, ropeName   string
	ropePlanesName   string
	threads, smem    int
	splits, minChunk int
}

const (
	attnMaxSplits = 16
	// attnBlocksPerSM is the attention blocks per multiprocessor the plan
	// aims at: at 32 tokens of the 1B and 8B shapes, 2 splits (4 on 132
	// multiprocessors) took 17.2 and 30.3 us at 256 keys, 40.7 and 78.0 us
	// at 1,024, against 19.1, 36.1, 61.5 and 123.8 us with 1 split (3)
	// and 23.1, 37.7, 45.4 and 82.9 us with 4 (NOTES.md).
	attnBlocksPerSM = 4
	// smsEstimate is the multiprocessors of the devices the workspace
	// estimate assumes (a full GH100) when none is at hand.
	smsEstimate = 144
)

// newAttnPlan plans attention for model m on a device of sms
// multiprocessors.
func newAttnPlan(m *model.Config, sms int) attnPlan {
	r := m.NumHeads / m.NumKVHeads
	rmax := attentionHeads
	for _, v := range attentionVariants {
		if v >= r {
			rmax = v
			break
		}
	}
	return attnPlan{nkv: m.NumKVHeads, groups: (r + rmax - 1) / rmax, rmax: rmax, sms: max(1, sms), hd: m.HeadDim}
}

// launch is attention's launch for a step of t tokens.
func (a attnPlan) launch(t int) attnLaunch {
	units := t * a.nkv * a.groups
	if a.gqa {
		w := 4
		if units <= a.sms || a.hd <= 64 {
			w = 8
		}
		if a.gqaWarps > 0 {
			w = a.gqaWarps
		}
		return attnLaunch{name: gqaName(a.hd, w, false), ropeName: gqaName(a.hd, w, true), ropePlanesName: gqaPlanesName(a.hd, w), threads: 32 * w,
			smem: gqaSmem(a.hd, w), splits: max(1, min(attnMaxSplits, a.sms/units)), minChunk: gqaStages * 16 * w}
	}
	w, target, chunk := 4, a.sms*attnBlocksPerSM, 64
	if units <= a.sms && attentionSmem(a.rmax, 16, a.hd) <= 48<<10 {
		w, target, chunk = 16, a.sms, max(64, (1<<20)/(a.hd*a.hd))
	}
	if a.warps > 0 {
		w, chunk = a.warps, a.minChunk
	}
	return attnLaunch{name: attentionName(a.rmax, w), threads: 32 * w, smem: attentionSmem(a.rmax, w, a.hd),
		splits: max(1, min(attnMaxSplits, target/units)), minChunk: chunk}
}

// splits is how many parts a step of t tokens cuts each sequence into.
func (a attnPlan) splits(t int) int { return a.launch(t).splits }

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
