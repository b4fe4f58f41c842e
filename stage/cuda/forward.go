package cuda

import (
	"context"
	"fmt"
	"math"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/stage"
)

// Forward runs one batch: it validates the batch, uploads its packed
// description with one copy, orders every kernel and GEMM on the stage's
// stream and waits for them. On the last stage it copies back the sampled
// tokens and the requested logits. The Output and the buffers it points at
// are valid until the next Forward.
func (s *Stage) Forward(ctx context.Context, b *stage.Batch) (*stage.Output, error) {
	if s.closed {
		return nil, fmt.Errorf("cuda stage [%d,%d): forward after close", s.lo, s.hi)
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("cuda stage [%d,%d): batch %d: %w", s.lo, s.hi, b.ID, err)
	}
	if err := s.pl.build(b, &s.p); err != nil {
		return nil, fmt.Errorf("cuda stage [%d,%d): %w", s.lo, s.hi, err)
	}
	if err := s.dev.Do(s.run); err != nil {
		return nil, fmt.Errorf("cuda stage [%d,%d): batch %d: %w", s.lo, s.hi, b.ID, err)
	}
	s.pl.commit(b, &s.p)
	return s.output(b), nil
}

// run orders the batch's work and waits for it. Device goroutine only.
func (s *Stage) run() error {
	m := &s.m
	p := &s.p
	lay := s.pl.lay
	T := p.tokens
	H := m.HiddenSize
	st := s.stream
	word := func(off int) gpu.DevicePtr { return s.b.batch + gpu.DevicePtr(4*off) }
	tokens, pos, cacheRow, kvBase := word(lay.tokens()), word(lay.pos()), word(lay.cacheRow()), word(lay.kvBase())
	if err := gpu.CopyHtoDAsync(s.b.batch, s.hostBatch[:4*lay.words()], st); err != nil {
		return fmt.Errorf("upload batch description: %w", err)
	}
	if err := s.events[0].Record(st); err != nil {
		return err
	}
	resIn := s.b.in
	if s.first {
		a := s.args.Reset().Ptr(tokens).Ptr(s.weights.embed).Ptr(s.b.resid).Int32(int32(H))
		if err := s.launch(kEmbed, gpu.Dim3{X: uint32(T)}, gpu.Dim3{X: embedThreads}, a); err != nil {
			return err
		}
		resIn = s.b.resid
	}
	scale := float32(1 / math.Sqrt(float64(m.HeadDim)))
	for i, lw := range s.layers {
		kc := s.kcache + gpu.DevicePtr(i*s.kvLayer)
		vc := s.vcache + gpu.DevicePtr(i*s.kvLayer)
		var delta gpu.DevicePtr
		if i > 0 {
			resIn, delta = s.b.resid, s.b.delta
		}
		if err := s.rmsnorm(T, resIn, delta, s.b.resid, lw.inNorm, s.b.normed, 0); err != nil {
			return err
		}
		if err := s.blas.LinearBF16(s.b.qkv, s.b.normed, lw.qkv, T, H, s.qkvDim, 0); err != nil {
			return fmt.Errorf("layer %d qkv: %w", s.lo+i, err)
		}
		a := s.args.Reset().Ptr(s.b.qkv).Ptr(lw.qkvBias).Ptr(s.b.invFreq).Ptr(pos).Ptr(cacheRow).
			Ptr(s.b.q).Ptr(kc).Ptr(vc).Int32(int32(m.NumHeads)).Int32(int32(m.NumKVHeads)).Int32(int32(m.HeadDim))
		if err := s.launch(kRopeQKV, gpu.Dim3{X: uint32(T), Y: uint32(m.NumHeads + m.NumKVHeads)}, gpu.Dim3{X: uint32(m.HeadDim / 2)}, a); err != nil {
			return err
		}
		a = s.args.Reset().Ptr(s.b.q).Ptr(kc).Ptr(vc).Ptr(s.b.attn).Ptr(kvBase).Ptr(pos).
			Int32(int32(m.NumHeads)).Int32(int32(m.NumKVHeads)).Int32(int32(m.HeadDim)).Float32(scale)
		if err := s.launch(kAttention, gpu.Dim3{X: uint32(T), Y: uint32(m.NumHeads)}, gpu.Dim3{X: attentionThreads}, a); err != nil {
			return err
		}
		if err := s.blas.LinearBF16(s.b.delta, s.b.attn, lw.o, T, s.qDim, H, 0); err != nil {
			return fmt.Errorf("layer %d o_proj: %w", s.lo+i, err)
		}
		if err := s.rmsnorm(T, s.b.resid, s.b.delta, s.b.resid, lw.postNorm, s.b.normed, 0); err != nil {
			return err
		}
		if err := s.blas.LinearBF16(s.b.gateUp, s.b.normed, lw.gateUp, T, H, 2*m.IntermediateSize, 0); err != nil {
			return fmt.Errorf("layer %d gate/up: %w", s.lo+i, err)
		}
		a = s.args.Reset().Ptr(s.b.gateUp).Ptr(s.b.act).Int32(int32(m.IntermediateSize))
		grid := gpu.Dim3{X: uint32((m.IntermediateSize + siluThreads - 1) / siluThreads), Y: uint32(T)}
		if err := s.launch(kSiluMul, grid, gpu.Dim3{X: siluThreads}, a); err != nil {
			return err
		}
		if err := s.blas.LinearBF16(s.b.delta, s.b.act, lw.down, T, m.IntermediateSize, H, 0); err != nil {
			return fmt.Errorf("layer %d down: %w", s.lo+i, err)
		}
	}
	if !s.last {
		// The residual stream after the last layer is the stage's output.
		if err := s.rmsnorm(T, s.b.resid, s.b.delta, s.b.resid, 0, 0, 0); err != nil {
			return err
		}
	} else if p.rows > 0 {
		if err := s.head(); err != nil {
			return err
		}
	}
	if err := s.events[1].Record(st); err != nil {
		return err
	}
	if err := st.Synchronize(); err != nil {
		return fmt.Errorf("run batch: %w", err)
	}
	d, err := gpu.Elapsed(s.events[0], s.events[1])
	if err != nil {
		return err
	}
	s.lastGPU = d
	return nil
}

// head computes the logits rows the batch asks for (final norm of the
// selected rows, LM head in fp32), samples, and copies results back.
// Device goroutine only.
func (s *Stage) head() error {
	m := &s.m
	p := &s.p
	lay := s.pl.lay
	st := s.stream
	rows := s.b.batch + gpu.DevicePtr(4*lay.logitRows())
	if err := s.rmsnorm(p.rows, s.b.resid, s.b.delta, 0, s.weights.norm, s.b.normed, rows); err != nil {
		return err
	}
	// Row-major logits[rows × vocab] = normed · lm_headᵀ, fp32 output.
	if err := s.blas.Gemm(gpu.OpT, gpu.OpN, m.VocabSize, p.rows, m.HiddenSize, 1,
		s.weights.lmHead, gpu.R16BF, m.HiddenSize, s.b.normed, gpu.R16BF, m.HiddenSize,
		0, s.b.logits, gpu.R32F, m.VocabSize); err != nil {
		return fmt.Errorf("LM head: %w", err)
	}
	if p.nSampled > 0 {
		params := s.b.batch + gpu.DevicePtr(4*lay.sample())
		a := s.args.Reset().Ptr(s.b.logits).Int32(int32(m.VocabSize)).Ptr(params).Ptr(s.b.sampleOut).Int32(MaxLogprobs)
		if err := s.launch(kSample, gpu.Dim3{X: uint32(p.nSampled)}, gpu.Dim3{X: sampleThreads}, a); err != nil {
			return err
		}
		n := p.nSampled * (2 + 2*MaxLogprobs)
		if err := gpu.CopyDtoHAsync(gpu.AsBytes(s.hostSample[:n]), s.b.sampleOut, st); err != nil {
			return fmt.Errorf("copy sampled tokens: %w", err)
		}
	}
	// Logits asked for with Seq.Logits: each sequence's rows are
	// contiguous in the logits buffer.
	V := m.VocabSize
	for i, start := range p.logitStart {
		n := p.logitCount[i]
		dst := gpu.AsBytes(s.hostLogits[start*V : (start+n)*V])
		if err := gpu.CopyDtoHAsync(dst, s.b.logits+gpu.DevicePtr(4*start*V), st); err != nil {
			return fmt.Errorf("copy logits: %w", err)
		}
	}
	return nil
}

// rmsnorm orders the rmsnorm kernel over rows rows (see norm.cu); zero
// pointers are the kernel's nulls.
func (s *Stage) rmsnorm(rows int, resIn, delta, resOut, w, out, rowmap gpu.DevicePtr) error {
	a := s.args.Reset().Ptr(resIn).Ptr(delta).Ptr(resOut).Ptr(w).Ptr(out).Ptr(rowmap).
		Int32(int32(s.m.HiddenSize)).Float32(float32(s.m.RMSNormEps))
	return s.launch(kRMSNorm, gpu.Dim3{X: uint32(rows)}, gpu.Dim3{X: normThreads}, a)
}

func (s *Stage) launch(name string, grid, block gpu.Dim3, a *gpu.KernelArgs) error {
	if err := s.fn[name].Launch(grid, block, 0, s.stream, a); err != nil {
		return fmt.Errorf("kernel %s: %w", name, err)
	}
	return nil
}

// output builds the Output of the batch that just ran.
func (s *Stage) output(b *stage.Batch) *stage.Output {
	o := &s.out
	*o = stage.Output{Sampled: o.Sampled[:0], Logits: o.Logits[:0]}
	if !s.last {
		o.Header = collective.Header{Batch: b.ID, Rows: s.p.tokens, Cols: s.m.HiddenSize, DType: collective.BF16}
		o.Activations = s.outBuf
		return o
	}
	V := s.m.VocabSize
	stride := 2 + 2*MaxLogprobs
	k, j := 0, 0
	for i := range b.Seqs {
		sq := &b.Seqs[i]
		if sq.Logits {
			start, n := s.p.logitStart[j], len(sq.Tokens)
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
		w := s.hostSample[k*stride:]
		k++
		smp := stage.Sampled{Seq: sq.ID, Token: w[0], Logprob: math.Float32frombits(uint32(w[1]))}
		for t := 0; t < sq.Sampling.Logprobs; t++ {
			smp.Top = append(smp.Top, stage.TokenLogprob{Token: w[2+2*t], Logprob: math.Float32frombits(uint32(w[3+2*t]))})
		}
		o.Sampled = append(o.Sampled, smp)
	}
	return o
}
