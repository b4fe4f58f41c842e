package cuda

import (
	"context"
	"fmt"
	"math"

	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/stage"
)

// Forward runs one batch: it validates the batch and its graph step,
// uploads its packed description (upload), then either orders every
// kernel and GEMM on the stage's stream (mode None) or replays the graphs
// of the step's key, and waits. On the last stage it copies back the
// sampled tokens and the requested logits. The Output and the buffers it
// points at are valid until the next Forward (or Finish). It is Launch
// then Finish, but waits on the device goroutine and leaves a first and
// last stage's hand-off rows to ApplyHandoff.
func (s *Stage) Forward(ctx context.Context, b *stage.Batch) (*stage.Output, error) {
	if s.launched > 0 {
		return nil, fmt.Errorf("cuda stage [%d,%d): batch %d: forward while %d batches are launched", s.lo, s.hi, b.ID, s.launched)
	}
	f, err := s.startBatch(ctx, b, false)
	if err != nil {
		return nil, err
	}
	out, err := s.finish(f, s.dev.Do(func() error { return s.await(f) }))
	if err != nil {
		return nil, err
	}
	s.pl.commit(b)
	return out, nil
}

// run orders the work of flight f: the upload of its description, the
// forward pass (whose sampler applies the stage's own hand-off rows, if
// it does: f.own), and the copies back of the status, the sampled tokens
// and the logits asked for, between f's events. Device goroutine only.
func (s *Stage) run(f *flight) error {
	lay := s.pl.lay
	p := &f.p
	st := s.stream
	if s.prof != nil {
		if err := s.spinBeforeStep(); err != nil {
			return err
		}
	}
	if err := s.upload(s.b.batch, f.hostBatch[:4*p.uploadWords(lay)]); err != nil {
		return fmt.Errorf("upload batch description: %w", err)
	}
	if f.sh.prefill() {
		lo, hi := lay.tileList(), lay.rowList()+2*f.sh.rowsLeft
		if err := s.upload(s.b.batch+gpu.DevicePtr(4*lo), f.hostBatch[4*lo:4*hi]); err != nil {
			return fmt.Errorf("upload attention's tiles and rows: %w", err)
		}
	}
	if err := f.events[0].Record(st); err != nil {
		return err
	}
	if err := s.forwardPass(f.step, f.sh); err != nil {
		return err
	}
	n := 0 // words of the sampler's output
	if s.last {
		n = p.nSampled * sampleOutInts
	}
	switch {
	case f.back != nil && n > 0:
		// A first and last stage's status words lie just before the
		// sampler's output, on the device as in f.back: one read-back.
		if err := s.readBack(f.back[:statusWords+n], s.ho.status); err != nil {
			return fmt.Errorf("read hand-off status and sampled tokens: %w", err)
		}
	case n > 0:
		if err := s.readBack(f.hostSample[:n], s.b.sampleOut); err != nil {
			return fmt.Errorf("copy sampled tokens: %w", err)
		}
	}
	if p.placeholders && (f.back == nil || n == 0) {
		if err := s.readBack(f.status, s.ho.status); err != nil {
			return fmt.Errorf("read hand-off status: %w", err)
		}
	}
	// Logits asked for with Seq.Logits: each sequence's rows are
	// contiguous in the logits buffer.
	V := s.m.VocabSize
	for i, start := range p.logitStart {
		n := p.logitCount[i]
		dst := gpu.AsBytes(s.hostLogits[start*V : (start+n)*V])
		if err := gpu.CopyDtoHAsync(dst, s.b.logits+gpu.DevicePtr(4*start*V), st); err != nil {
			return fmt.Errorf("copy logits: %w", err)
		}
	}
	return f.events[1].Record(st)
}

// upload orders the copy of pinned host bytes b to dst on the stage's
// stream: with unified addressing by copy_words, a kernel like the step's
// others, which measured faster through the API than a copy (the stream
// handing over to a copy engine and back: NOTES.md, phase 11).
func (s *Stage) upload(dst gpu.DevicePtr, b []byte) error {
	if s.zeroCopy {
		return s.copyWords(dst, gpu.HostPtr(b), len(b)/4)
	}
	return gpu.CopyHtoDAsync(dst, b, s.stream)
}

// readBack orders the copy of device words src into pinned host words dst
// on the stage's stream, by copy_words as upload does.
func (s *Stage) readBack(dst []int32, src gpu.DevicePtr) error {
	if s.zeroCopy {
		return s.copyWords(gpu.HostPtr(gpu.AsBytes(dst)), src, len(dst))
	}
	return gpu.CopyDtoHAsync(gpu.AsBytes(dst), src, s.stream)
}

// copyWords orders copy_words of n words from src to dst.
func (s *Stage) copyWords(dst, src gpu.DevicePtr, n int) error {
	a := s.args.Reset().Ptr(src).Ptr(dst).Int32(int32(n))
	blocks := max(1, min((n/4+copyThreads-1)/copyThreads, copyMaxBlocks))
	return s.launch("copy", kCopyWords, gpu.Dim3{X: uint32(blocks)}, gpu.Dim3{X: copyThreads}, a)
}

// forwardPass orders the stage's work for a step of shape sh: the full
// wrapper around all of it, and within it the dense segments, each in the
// piecewise wrapper, with attention between them. A wrapper replays (or,
// during Capture, captures) its graph when the step's mode is its own, and
// otherwise runs its part straight through: mode None runs everything
// eagerly, Piecewise replays the segments around eager attention, Full
// replays one graph. Device goroutine only.
func (s *Stage) forwardPass(step graphs.Step, sh shape) error {
	return s.g.full.call(s, step, 0, func() error {
		L := s.hi - s.lo
		for i := 0; i <= L; i++ {
			if err := s.g.piecewise.call(s, step, i, func() error { return s.segment(i, sh) }); err != nil {
				return err
			}
			if i < L {
				if err := s.attention(i, sh); err != nil {
					return err
				}
			}
		}
		return nil
	})
}

// segment orders dense segment i of L+1, the work between two attention
// calls: segment 0 takes the stage's input (embedding or received
// activations); segment i > 0 finishes layer i-1 (o projection, norm,
// MLP); segment i < L starts layer i (norm, q|k|v projection, rotary
// embedding and KV cache write); segment L ends the stage (the LM head and
// sampling on the last stage; other stages hand on the residual stream,
// which the down projection has already updated).
//
// A step of few tokens (skinnyPlan.use) runs one skinny kernel per
// product, the norm folded into its input and the rest of the layer into
// its epilogue: a layer is four products and attention. Other steps run
// the cuBLAS path: GEMMs between norm, rotary, SiLU and residual kernels,
// compensated up to Config.CompensatedTokens rows (their inputs T rows of
// bf16 values then T rows of rounding remainders, their outputs two halves
// lo = T rows apart; kernels/00_common.cu), on the bf16 values alone past
// it (lo 0); their small products on gemvs and their gate|up product with
// SiLU·mul on gemvg where those apply (gemvs.go, gemvg.go).
func (s *Stage) segment(i int, sh shape) error {
	m := &s.m
	T, H := sh.tokens, m.HiddenSize
	L := s.hi - s.lo
	lay := s.pl.lay
	if i == 0 {
		if s.first {
			a := s.args.Reset().Ptr(s.word(lay.tokens())).Ptr(s.ho.tokens).Ptr(s.ho.status).Ptr(s.weights.embed).
				Ptr(s.b.resid).Int32(int32(H)).Int32(int32(m.VocabSize))
			if err := s.launchDep("embed", kEmbed, gpu.Dim3{X: uint32(T)}, gpu.Dim3{X: embedThreads}, 0, a); err != nil {
				return err
			}
		} else if err := s.copyInput(T * H * 4); err != nil {
			return err
		}
	} else if err := s.finishLayer(i-1, sh); err != nil {
		return err
	}
	if i < L {
		return s.startLayer(i, sh)
	}
	if !s.sk.use(T) {
		// The last down projection, still pending on the cuBLAS path.
		if err := s.residualAdd(T); err != nil {
			return err
		}
	}
	if s.last && sh.rows > 0 {
		return s.head(sh)
	}
	return nil
}

// word is the device address of word off of the batch description.
func (s *Stage) word(off int) gpu.DevicePtr { return s.b.batch + gpu.DevicePtr(4*off) }

// copyInput moves the received activations into the residual stream.
func (s *Stage) copyInput(bytes int) error {
	if s.prof != nil {
		s.prof.before(s, "copy input")
	}
	if err := gpu.CopyDtoDAsync(s.b.resid, s.b.in, bytes, s.stream); err != nil {
		return fmt.Errorf("copy input activations: %w", err)
	}
	if s.prof != nil {
		s.prof.after(s)
	}
	return nil
}

// startLayer orders the stage's layer i up to attention: the input norm,
// the q|k|v projection, rotary embedding and the KV cache write (the last
// two left to attention when ropeInAttention).
func (s *Stage) startLayer(i int, sh shape) error {
	m := &s.m
	T := sh.tokens
	lw := s.layers[i]
	lay := s.pl.lay
	kc, vc := s.kvLayerPtrs(i)
	if s.sk.use(T) {
		err := s.gemv("qkv+norm+rope", &s.sk.qkv, lw.qkv, T, gemvIO{x: s.b.resid, g: lw.inNorm, out: s.b.q, ldo: s.qDim,
			bias: lw.qkvBias, pos: s.word(lay.pos()), cacheRow: s.word(lay.cacheRow()), kcache: kc, vcache: vc,
			tables: s.word(lay.tables()), tableOff: s.word(lay.tableOff()), bs: s.pl.kv.blockSize})
		if err != nil {
			return fmt.Errorf("layer %d qkv: %w", s.lo+i, err)
		}
		return nil
	}
	var y gpu.DevicePtr // the previous layer's down projection, pending
	if i > 0 {
		y = s.b.y
	}
	lo := s.remainders(T)
	if err := s.rmsnorm(T, y, s.downPlanes(T, lo), lw.inNorm, lo, 0); err != nil {
		return err
	}
	if s.ropeInAttention(sh) {
		// Attention takes q|k|v as the product leaves it, in planes.
		if _, err := s.smallProduct(prodQKV, s.b.qkv, s.b.normed, lw.qkv, T, lo, m.HiddenSize, s.qkvDim); err != nil {
			return fmt.Errorf("layer %d qkv: %w", s.lo+i, err)
		}
		return nil
	}
	if err := s.linear("qkv", s.b.qkv, s.b.normed, lw.qkv, T+lo, m.HiddenSize, s.qkvDim); err != nil {
		return fmt.Errorf("layer %d qkv: %w", s.lo+i, err)
	}
	a := s.args.Reset().Ptr(s.b.qkv).Int32(int32(lo)).Ptr(lw.qkvBias).Ptr(s.b.invFreq).Ptr(s.word(lay.pos())).
		Ptr(s.word(lay.cacheRow())).Ptr(s.b.q).Ptr(kc).Ptr(vc).
		Int32(int32(m.NumHeads)).Int32(int32(m.NumKVHeads)).Int32(int32(m.HeadDim))
	pairs := (m.NumHeads + m.NumKVHeads) * m.HeadDim / 2
	grid := gpu.Dim3{X: uint32(T), Y: uint32((pairs + ropeThreads - 1) / ropeThreads)}
	return s.launchDep("rope", kRopeQKV, grid, gpu.Dim3{X: ropeThreads}, 0, a)
}

// finishLayer orders the stage's layer i after attention: the o projection
// into the residual stream, the post-attention norm, the MLP (gate|up and
// SiLU·mul in one kernel where gemvg applies, else cuBLAS and silu_mul)
// and the down projection (on the cuBLAS path its output stays pending in
// y, added by the next norm or, at the stage's end, by residual_add).
func (s *Stage) finishLayer(i int, sh shape) error {
	m := &s.m
	T := sh.tokens
	H, I := m.HiddenSize, m.IntermediateSize
	lw := s.layers[i]
	layer := s.lo + i
	if s.sk.use(T) {
		if err := s.gemv("o+residual", &s.sk.o, lw.o, T, gemvIO{x: s.b.attnF, out: s.b.resid, ldo: H}); err != nil {
			return fmt.Errorf("layer %d o_proj: %w", layer, err)
		}
		if err := s.gemv("gate_up+norm+silu", &s.sk.gateUp, lw.gateUp, T, gemvIO{x: s.b.resid, g: lw.postNorm, out: s.b.actF, ldo: I}); err != nil {
			return fmt.Errorf("layer %d gate/up: %w", layer, err)
		}
		if err := s.gemv("down+residual", &s.sk.down, lw.down, T, gemvIO{x: s.b.actF, out: s.b.resid, ldo: H}); err != nil {
			return fmt.Errorf("layer %d down: %w", layer, err)
		}
		return nil
	}
	lo := s.remainders(T)
	p := cublasPlanes(lo)
	if s.ropeInAttention(sh) {
		var err error
		if p, err = s.smallProduct(prodO, s.b.y, s.b.attnB, lw.o, T, lo, s.qDim, H); err != nil {
			return fmt.Errorf("layer %d o_proj: %w", layer, err)
		}
	} else if err := s.linear("o", s.b.y, s.b.attnB, lw.o, T+lo, s.qDim, H); err != nil {
		return fmt.Errorf("layer %d o_proj: %w", layer, err)
	}
	if err := s.rmsnorm(T, s.b.y, p, lw.postNorm, lo, 0); err != nil {
		return err
	}
	if s.gemvg(T, lo) {
		if err := s.gateUpSilu(s.b.act, s.b.normed, lw.gateUp, T, lo); err != nil {
			return fmt.Errorf("layer %d gate/up: %w", layer, err)
		}
	} else if err := s.gateUpThenSilu(lw.gateUp, T, lo); err != nil {
		return fmt.Errorf("layer %d gate/up: %w", layer, err)
	}
	if _, err := s.smallProduct(prodDown, s.b.y, s.b.act, lw.down, T, lo, I, H); err != nil {
		return fmt.Errorf("layer %d down: %w", layer, err)
	}
	return nil
}

// downPlanes is how the cuBLAS path's down product of a step of T tokens
// (remainders lo rows on) leaves its output, pending for the next norm or
// residual_add.
func (s *Stage) downPlanes(T, lo int) planes {
	return s.smallPlanes(prodDown, T, lo, s.m.IntermediateSize, s.m.HiddenSize)
}

// gateUpThenSilu orders the gate|up product of T token rows (remainders lo
// rows on) with cuBLAS and then silu_mul into act.
func (s *Stage) gateUpThenSilu(w gpu.DevicePtr, T, lo int) error {
	H, I := s.m.HiddenSize, s.m.IntermediateSize
	if err := s.linear("gate_up", s.b.gateUp, s.b.normed, w, T+lo, H, 2*I); err != nil {
		return err
	}
	vec := 1
	if I%4 == 0 {
		vec = 4
	}
	a := s.args.Reset().Ptr(s.b.gateUp).Ptr(s.b.act).Int32(int32(lo)).Int32(int32(I)).Int32(int32(vec))
	grid := gpu.Dim3{X: uint32((I/vec + siluThreads - 1) / siluThreads), Y: uint32(T)}
	return s.launchDep("silu", kSiluMul, grid, gpu.Dim3{X: siluThreads}, 0, a)
}

// remainders is the row offset of the rounding remainders in a cuBLAS-path
// step of T token rows: T for a compensated step, 0 for one past
// Config.CompensatedTokens, whose GEMMs take the bf16-rounded activations
// alone (half the tensor-core work, as transformers' bf16 model computes).
func (s *Stage) remainders(T int) int {
	if s.compTokens >= 0 && T > s.compTokens {
		return 0
	}
	return T
}

// residualAdd adds the cuBLAS path's pending GEMM output (two halves, or
// one) into the residual stream.
func (s *Stage) residualAdd(T int) error {
	H := s.m.HiddenSize
	p := s.downPlanes(T, s.remainders(T))
	a := s.args.Reset().Ptr(s.b.resid).Ptr(s.b.y).Int32(int32(p.stride)).Int32(int32(p.n)).Int32(int32(H))
	grid := gpu.Dim3{X: uint32((H + addThreads - 1) / addThreads), Y: uint32(T)}
	return s.launchDep("residual_add", kResidualAdd, grid, gpu.Dim3{X: addThreads}, 0, a)
}

// ropeInAttention reports whether attention does the rotary embedding and
// the KV cache write of a step of shape sh (attention_gqa_rope_*): on the
// cuBLAS path, for decode steps, one kernel a layer fewer. Measured on one
// H200 against rope_qkv's launch, GPU ms of a decode step: 1B batch 32
// 1.305 -> 1.295, 8B 5.469 -> 5.450, batch 8 0.5% faster (NOTES.md).
func (s *Stage) ropeInAttention(sh shape) bool {
	return sh.decode && s.at.gqa && !s.sk.use(sh.tokens)
}

// kvLayerPtrs are the K and V caches of the stage's layer i.
func (s *Stage) kvLayerPtrs(i int) (k, v gpu.DevicePtr) {
	off := gpu.DevicePtr(i * s.kvLayer)
	return s.kcache + off, s.vcache + off
}

// attention orders the attention of the stage's layer i over the paged KV
// cache, through the batch's block tables, split along the sequence
// (attnPlan): into fp32 rows for the skinny o projection, else into the
// compensated bf16 rows of the cuBLAS path. A step with whole prefill
// tiles (sh.prefill) gives them to the tensor-core prefill kernel and the
// rows left, if any, to the per-row kernel (prefillLists).
func (s *Stage) attention(i int, sh shape) error {
	m := &s.m
	lay := s.pl.lay
	T := sh.tokens
	kc, vc := s.kvLayerPtrs(i)
	scale := float32(1 / math.Sqrt(float64(m.HeadDim)))
	out, outB, lo := s.b.attnF, gpu.DevicePtr(0), 0
	if !s.sk.use(T) {
		out, outB, lo = 0, s.b.attnB, s.remainders(T)
	}
	// The parameters both kernels begin with (ATT_PARAMS, PF_PARAMS).
	common := func() *gpu.KernelArgs {
		return s.args.Reset().Ptr(s.b.q).Ptr(kc).Ptr(vc).Ptr(out).Ptr(outB).Int32(int32(lo)).
			Ptr(s.word(lay.tables())).Ptr(s.word(lay.tableOff())).Ptr(s.word(lay.pos())).Int32(int32(s.pl.kv.blockSize)).
			Int32(int32(m.NumHeads)).Int32(int32(m.NumKVHeads))
	}
	rows, perRow := gpu.DevicePtr(0), T
	if sh.prefill() {
		rows, perRow = s.word(lay.rowList()), sh.rowsLeft
	}
	at := s.at.launch(T)
	a := common().Int32(int32(m.HeadDim)).Float32(scale).
		Int32(int32(at.splits)).Int32(int32(at.minChunk)).Ptr(s.b.part).Ptr(s.b.partML).Ptr(s.b.counts).Ptr(rows)
	name := at.name
	if s.ropeInAttention(sh) {
		lw := s.layers[i]
		name = at.ropeName
		a.Ptr(s.b.qkv).Ptr(lw.qkvBias).Ptr(s.b.invFreq).Ptr(s.word(lay.cacheRow()))
		// The plain form reads cuBLAS's planes (its two halves or one);
		// gemvs's splits, however many, take the planes form.
		if p := s.smallPlanes(prodQKV, T, lo, m.HiddenSize, s.qkvDim); p != cublasPlanes(lo) {
			name = at.ropePlanesName
			a.Int32(int32(p.n)).Int32(int32(p.stride))
		}
	}
	if perRow > 0 {
		grid := gpu.Dim3{X: uint32(perRow), Y: uint32(s.at.nkv * s.at.groups), Z: uint32(at.splits)}
		if err := s.launchDep("attention", name, grid, gpu.Dim3{X: uint32(at.threads)}, at.smem, a); err != nil || !sh.prefill() {
			return err
		}
	}
	a = common().Float32(scale).Ptr(s.word(lay.tileList()))
	return s.launchDep("attention prefill", prefillName(m.HeadDim), prefillGrid(m.NumHeads, sh.tiles), gpu.Dim3{X: prefillThreads}, prefillSmem(m.HeadDim), a)
}

// head computes the logits rows of the step (the final norm of the
// selected rows, the LM head in fp32) and samples: with the skinny LM head
// when the rows are few (the norm folded in, its blocks' softmax partials
// handed to the sampler), else a norm kernel and gemvh (up to
// gemvhMaxRows rows, the partials in its epilogue) or cuBLAS and
// logit_stats for the partials.
func (s *Stage) head(sh shape) error {
	m := &s.m
	lay := s.pl.lay
	rows := s.word(lay.logitRows())
	var stats gpu.DevicePtr
	nstat := 0
	if s.sk.use(sh.rows) {
		info := s.dev.Info()
		stats, nstat = s.b.stats, s.sk.call(&s.sk.head, sh.rows).stats(sh.rows, info.SMs, info.MaxSharedPerBlockOptin)
		err := s.gemv("lm_head+norm", &s.sk.head, s.weights.lmHead, sh.rows, gemvIO{x: s.b.resid, rowmap: rows, g: s.weights.norm,
			out: s.b.logits, ldo: m.VocabSize, stats: stats})
		if err != nil {
			return fmt.Errorf("LM head: %w", err)
		}
	} else {
		if err := s.rmsnorm(sh.rows, 0, planes{}, s.weights.norm, 0, rows); err != nil {
			return err
		}
		if s.gemvh(sh.rows) {
			n, err := s.lmHeadStats(s.b.logits, s.b.normed, s.weights.lmHead, s.b.stats, sh.rows)
			if err != nil {
				return fmt.Errorf("LM head: %w", err)
			}
			stats, nstat = s.b.stats, n
		} else {
			if err := s.linear("lm_head", s.b.logits, s.b.normed, s.weights.lmHead, sh.rows, m.HiddenSize, m.VocabSize); err != nil {
				return fmt.Errorf("LM head: %w", err)
			}
			if sh.sampled > 0 {
				stats, nstat = s.b.stats, logitStatsPartials(m.VocabSize)
				a := s.args.Reset().Ptr(s.b.logits).Int32(int32(m.VocabSize)).Ptr(stats)
				grid := gpu.Dim3{X: uint32(sh.rows), Y: uint32(logitStatsParts(m.VocabSize))}
				if err := s.launchDep("logit_stats", kLogitStats, grid, gpu.Dim3{X: statsThreads}, 0, a); err != nil {
					return err
				}
			}
		}
	}
	if sh.sampled == 0 {
		return nil
	}
	params := s.word(lay.sample())
	a := s.args.Reset().Ptr(s.b.logits).Int32(int32(m.VocabSize)).Ptr(params).Ptr(s.b.sampleOut).Int32(MaxLogprobs).
		Ptr(s.ho.out.Ptr()).Ptr(stats).Int32(int32(nstat)).Ptr(s.ho.tokens)
	return s.launchDep("sample", kSample, gpu.Dim3{X: uint32(sh.sampled)}, gpu.Dim3{X: sampleThreads}, 0, a)
}

// rmsnorm adds the pending product output y (0: none; lying as p says)
// into the residual stream and normalises its rows with
// weight w into the bf16 buffer normed, the rounding remainders outlo rows
// on (0: none); rowmap (0: none, else y must be 0) selects the rows (see
// norm.cu).
func (s *Stage) rmsnorm(rows int, y gpu.DevicePtr, p planes, w gpu.DevicePtr, outlo int, rowmap gpu.DevicePtr) error {
	a := s.args.Reset().Ptr(s.b.resid).Ptr(y).Int32(int32(p.stride)).Ptr(w).Ptr(s.b.normed).Int32(int32(outlo)).
		Ptr(rowmap).Int32(int32(s.m.HiddenSize)).Float32(float32(s.m.RMSNormEps))
	if threads, ok := normClusterBlock(s.m.HiddenSize, rows, s.dev.Info().Major); ok {
		a.Int32(int32(p.n))
		return s.launchDep("rmsnorm", kRMSNormC, gpu.Dim3{X: normCluster, Y: uint32(rows)}, gpu.Dim3{X: uint32(threads)}, 0, a)
	}
	name := kRMSNorm // cuBLAS's output: two planes or one
	if p.n > 2 {
		name = kRMSNormP
		a.Int32(int32(p.n))
	}
	return s.launchDep("rmsnorm", name, gpu.Dim3{X: uint32(rows)}, gpu.Dim3{X: uint32(normBlock(s.m.HiddenSize))}, 0, a)
}

// linear computes the fp32 row-major y[rows×out] = x·Wᵀ for bf16 x
// [rows×in] and a bf16 Hugging Face weight W [out×in] with cuBLAS,
// accumulating in fp32. While Capture runs it records the rows; after
// Capture it pads them to a shape Capture warmed (gemmwarm.go).
func (s *Stage) linear(label string, y, x, w gpu.DevicePtr, rows, in, out int) error {
	if s.g.capturing {
		s.g.gemm.record(in, out, rows)
	} else {
		rows = s.g.gemm.pad(in, out, rows)
	}
	if s.prof != nil {
		s.prof.before(s, "cublas "+label)
	}
	if err := s.blas.Gemm(gpu.OpT, gpu.OpN, out, rows, in, 1, w, gpu.R16BF, in, x, gpu.R16BF, in, 0, y, gpu.R32F, out); err != nil {
		return err
	}
	if s.prof != nil {
		s.prof.after(s)
	}
	return nil
}

// launch orders kernel name after everything before it on the stream: for
// a kernel that does not wait on its predecessors itself (handoff_apply);
// the others go through launchDep.
func (s *Stage) launch(label, name string, grid, block gpu.Dim3, a *gpu.KernelArgs) error {
	if s.prof != nil {
		s.prof.before(s, label)
	}
	if err := s.fn[name].Launch(grid, block, 0, s.stream, a); err != nil {
		return fmt.Errorf("kernel %s: %w", name, err)
	}
	if s.prof != nil {
		s.prof.after(s)
	}
	return nil
}

// launchDep orders kernel name as a programmatic dependent of the kernel
// before it when the stage uses dependent launches (its kernels all wait
// for their predecessors before touching activations; see 00_common.cu),
// else as launch does. Profiling launches plainly, so that the events
// around the kernel time it alone. The small kernels between cuBLAS's
// products (norms, SiLU, rope, residual add, logit statistics) go this way
// too: a decode step of 8 or 32 rows 0.1-0.8% faster on one H200 than
// launched plainly (NOTES.md).
func (s *Stage) launchDep(label, name string, grid, block gpu.Dim3, smem int, a *gpu.KernelArgs) error {
	f := s.fn[name]
	var err error
	switch {
	case s.prof != nil:
		s.prof.before(s, label)
		err = f.Launch(grid, block, smem, s.stream, a)
		s.prof.after(s)
	case s.pdl:
		err = f.LaunchDependent(grid, block, smem, s.stream, a)
	default:
		err = f.Launch(grid, block, smem, s.stream, a)
	}
	if err != nil {
		return fmt.Errorf("kernel %s: %w", name, err)
	}
	return nil
}

// output builds the Output of flight f, whose work is done.
func (s *Stage) output(f *flight) *stage.Output {
	b := f.b
	o := &f.out
	*o = stage.Output{Sampled: o.Sampled[:0], Logits: o.Logits[:0]}
	s.sendBuffers(f, o)
	if !s.last {
		return o
	}
	V := s.m.VocabSize
	stride := sampleOutInts
	k, j := 0, 0
	for i := range b.Seqs {
		sq := &b.Seqs[i]
		if sq.Logits {
			start, n := f.p.logitStart[j], len(sq.Tokens)
			j++
			rows := make([][]float32, n)
			for r := range rows {
				rows[r] = s.hostLogits[(start+r)*V : (start+r+1)*V : (start+r+1)*V]
			}
			o.Logits = append(o.Logits, stage.SeqLogits{Seq: sq.ID, Rows: rows})
		}
		if !sq.Sample {
			continue
		}
		w := f.hostSample[k*stride:]
		k++
		if w[0] < 0 { // the sampler found NaN or infinite logits (sample.cu)
			o.Sampled = append(o.Sampled, stage.Sampled{Seq: sq.ID, Err: fmt.Sprintf(
				"cuda stage [%d,%d): sequence %d: non-finite logits: %d of %d values are NaN or infinite", s.lo, s.hi, sq.ID, w[1], V)})
			continue
		}
		smp := stage.Sampled{Seq: sq.ID, Token: w[0], Logprob: math.Float32frombits(uint32(w[1]))}
		for t := 0; t < sq.Sampling.Logprobs; t++ {
			smp.Top = append(smp.Top, stage.TokenLogprob{Token: w[2+2*t], Logprob: math.Float32frombits(uint32(w[3+2*t]))})
		}
		o.Sampled = append(o.Sampled, smp)
	}
	return o
}
