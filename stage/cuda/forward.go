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
	if s.first {
		a := s.args.Reset().Ptr(tokens).Ptr(s.weights.embed).Ptr(s.b.resid).Int32(int32(H))
		if err := s.launch(kEmbed, gpu.Dim3{X: uint32(T)}, gpu.Dim3{X: embedThreads}, a); err != nil {
			return err
		}
	} else if err := gpu.CopyDtoDAsync(s.b.resid, s.b.in, T*H*4, st); err != nil {
		return fmt.Errorf("copy input activations: %w", err)
	}
	scale := float32(1 / math.Sqrt(float64(m.HeadDim)))
	for i, lw := range s.layers {
		kc := s.kcache + gpu.DevicePtr(i*s.kvLayer)
		vc := s.vcache + gpu.DevicePtr(i*s.kvLayer)
		if err := s.rmsnorm(T, lw.inNorm, 0); err != nil {
			return err
		}
		if err := s.linear(s.b.qkv, s.b.normed, lw.qkv, T, H, s.qkvDim, 0); err != nil {
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
		// The residual add is the GEMM's own: resid = attn·Woᵀ + 1·resid.
		if err := s.linear(s.b.resid, s.b.attn, lw.o, T, s.qDim, H, 1); err != nil {
			return fmt.Errorf("layer %d o_proj: %w", s.lo+i, err)
		}
		if err := s.rmsnorm(T, lw.postNorm, 0); err != nil {
			return err
		}
		if err := s.linear(s.b.gateUp, s.b.normed, lw.gateUp, T, H, 2*m.IntermediateSize, 0); err != nil {
			return fmt.Errorf("layer %d gate/up: %w", s.lo+i, err)
		}
		a = s.args.Reset().Ptr(s.b.gateUp).Ptr(s.b.act).Int32(int32(m.IntermediateSize))
		grid := gpu.Dim3{X: uint32((m.IntermediateSize + siluThreads - 1) / siluThreads), Y: uint32(T)}
		if err := s.launch(kSiluMul, grid, gpu.Dim3{X: siluThreads}, a); err != nil {
			return err
		}
		if err := s.linear(s.b.resid, s.b.act, lw.down, T, m.IntermediateSize, H, 1); err != nil {
			return fmt.Errorf("layer %d down: %w", s.lo+i, err)
		}
	}
	if s.last && p.rows > 0 {
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
	if err := s.rmsnorm(p.rows, s.weights.norm, rows); err != nil {
		return err
	}
	if err := s.linear(s.b.logits, s.b.normed, s.weights.lmHead, p.rows, m.HiddenSize, m.VocabSize, 0); err != nil {
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

// rmsnorm normalises rows of the residual stream with weight w into the
// bf16 buffer normed; rowmap (0: none) selects the rows (see norm.cu).
func (s *Stage) rmsnorm(rows int, w, rowmap gpu.DevicePtr) error {
	a := s.args.Reset().Ptr(s.b.resid).Ptr(w).Ptr(s.b.normed).Ptr(rowmap).
		Int32(int32(s.m.HiddenSize)).Float32(float32(s.m.RMSNormEps))
	return s.launch(kRMSNorm, gpu.Dim3{X: uint32(rows)}, gpu.Dim3{X: normThreads}, a)
}

// linear computes the fp32 row-major y[tokens×out] = x·Wᵀ + beta·y for bf16
// x [tokens×in] and a bf16 Hugging Face weight W [out×in], accumulating in
// fp32 (beta 1 adds into y, the residual stream).
func (s *Stage) linear(y, x, w gpu.DevicePtr, tokens, in, out int, beta float32) error {
	return s.blas.Gemm(gpu.OpT, gpu.OpN, out, tokens, in, 1, w, gpu.R16BF, in, x, gpu.R16BF, in, beta, y, gpu.R32F, out)
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
		o.Header = collective.Header{Batch: b.ID, Rows: s.p.tokens, Cols: s.m.HiddenSize, DType: collective.F32}
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
