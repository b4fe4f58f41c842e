package cpu

import (
	"context"
	"errors"
	"fmt"
	"math"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/stage"
)

// seqState is what the stage keeps of a sequence between steps: how many
// of its positions are in the KV cache. The keys and values themselves are
// in the pools, in the blocks of the sequence's block table.
type seqState struct {
	n int
}

// seqRun is one sequence's chunk placed in the batch: rows [row, row+n) at
// positions [pos, pos+n), its keys and values in blocks.
type seqRun struct {
	pos, n, row int
	state       *seqState
	blocks      []int32
}

// slot is the pool row of position p.
func (r *seqRun) slot(p, blockSize int) int {
	return int(r.blocks[p/blockSize])*blockSize + p%blockSize
}

// Forward implements stage.Stage. A batch that fails validation, or a
// Forward cut short by ctx, leaves every sequence's cached length as it
// was (a Forward cut short may have written its chunks' keys and values
// into their blocks, past the cached positions).
func (s *Stage) Forward(ctx context.Context, b *stage.Batch) (*stage.Output, error) {
	if s.closed {
		return nil, fmt.Errorf("batch %d: cpu stage [%d,%d) is closed", b.ID, s.lo, s.hi)
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("batch %d: %w", b.ID, err)
	}
	if err := s.validate(b); err != nil {
		return nil, fmt.Errorf("batch %d: %w", b.ID, err)
	}
	rows := s.prepare(b)
	s.ropeTables()
	for li := range s.layers {
		if err := ctx.Err(); err != nil {
			s.rollback()
			return nil, fmt.Errorf("batch %d: layer %d: %w", b.ID, s.lo+li, err)
		}
		s.layer(li, rows)
	}
	for _, run := range s.runs {
		run.state.n = run.pos + run.n
	}
	out := &stage.Output{}
	if !s.last {
		out.Header = collective.Header{Batch: b.ID, Rows: rows, Cols: s.m.HiddenSize, DType: collective.F32}
		out.Activations = s.outputBuffer
		return out, nil
	}
	s.head(b, out)
	if b.Handoff {
		s.reportHandoff(b, out)
	}
	return out, nil
}

// validate checks a batch against the stage's limits and caches.
func (s *Stage) validate(b *stage.Batch) error {
	if len(b.Seqs) == 0 {
		return errors.New("no sequences")
	}
	if len(b.Seqs) > s.maxSeqs {
		return fmt.Errorf("%d sequences, more than the %d a batch may carry", len(b.Seqs), s.maxSeqs)
	}
	if n := b.NumTokens(); n > s.maxTokens {
		return fmt.Errorf("%d tokens, more than the %d a batch may carry", n, s.maxTokens)
	}
	// The CPU stage captures no CUDA graphs: a step the leader dispatched
	// to a graph is refused, never run eagerly behind a replaying neighbour.
	if b.Graph != (graphs.Step{}) {
		if err := b.Graph.Validate(fmt.Sprintf("cpu [%d,%d)", s.lo, s.hi), b.NumTokens(), len(b.Seqs), nil); err != nil {
			return err
		}
	}
	for i := range b.Seqs {
		q := &b.Seqs[i]
		for j := range i {
			o := &b.Seqs[j]
			if o.ID == q.ID {
				return fmt.Errorf("seq %d appears twice", q.ID)
			}
			if b.Handoff && q.Sample && o.Sample && o.Slot == q.Slot {
				return fmt.Errorf("seq %d: hand-off slot %d is seq %d's too", q.ID, q.Slot, o.ID)
			}
		}
		if err := s.validateSeq(q); err != nil {
			return fmt.Errorf("seq %d: %w", q.ID, err)
		}
	}
	return nil
}

func (s *Stage) validateSeq(q *stage.Seq) error {
	n := len(q.Tokens)
	if n == 0 {
		return errors.New("empty chunk")
	}
	cached := 0
	if st := s.seqs[q.ID]; st != nil {
		cached = st.n
	}
	if q.Pos != cached {
		return fmt.Errorf("chunk starts at position %d but %d tokens are cached", q.Pos, cached)
	}
	if q.Pos+n > s.m.MaxPositions {
		return fmt.Errorf("chunk of %d tokens at position %d runs past the model's %d positions", n, q.Pos, s.m.MaxPositions)
	}
	need := (q.Pos + n + s.blockSize - 1) / s.blockSize
	if len(q.Blocks) < need {
		return fmt.Errorf("block table of %d blocks does not cover positions [0,%d) in blocks of %d", len(q.Blocks), q.Pos+n, s.blockSize)
	}
	for i, b := range q.Blocks[:need] {
		if b < 0 || int(b) >= s.numBlocks {
			return fmt.Errorf("block %d of the table is %d, outside the stage's [0,%d)", i, b, s.numBlocks)
		}
	}
	if q.Slot < 0 || q.Slot >= s.maxSeqs {
		return fmt.Errorf("hand-off slot %d outside [0,%d)", q.Slot, s.maxSeqs)
	}
	if s.first {
		for i, t := range q.Tokens {
			switch {
			case t == stage.Placeholder && s.ho.tokens[q.Slot] < 0:
				return fmt.Errorf("placeholder at position %d, but no token is recorded for hand-off slot %d", q.Pos+i, q.Slot)
			case t != stage.Placeholder && (t < 0 || int(t) >= s.m.VocabSize):
				return fmt.Errorf("token %d at position %d is outside the vocabulary [0,%d)", t, q.Pos+i, s.m.VocabSize)
			}
		}
	}
	if q.Sample {
		if err := q.Sampling.Validate(s.m.VocabSize); err != nil {
			return fmt.Errorf("sampling: %w", err)
		}
	}
	return nil
}

// prepare lays the batch out in rows, creates the state of new sequences
// and fills the residual stream with the embeddings (first stage) or the
// received activations. It returns the number of rows.
func (s *Stage) prepare(b *stage.Batch) int {
	s.runs = s.runs[:0]
	s.created = s.created[:0]
	h := s.m.HiddenSize
	row := 0
	for i := range b.Seqs {
		q := &b.Seqs[i]
		st := s.seqs[q.ID]
		if st == nil {
			st = &seqState{}
			s.seqs[q.ID] = st
			s.created = append(s.created, q.ID)
		}
		s.runs = append(s.runs, seqRun{pos: q.Pos, n: len(q.Tokens), row: row, state: st, blocks: q.Blocks})
		if s.first {
			for j, t := range q.Tokens {
				if t == stage.Placeholder {
					t = s.ho.tokens[q.Slot]
				}
				copy(s.buf.x[(row+j)*h:(row+j+1)*h], s.embed[int(t)*h:(int(t)+1)*h])
			}
		}
		row += len(q.Tokens)
	}
	if !s.first {
		copy(s.buf.x[:row*h], s.buf.in[:row*h])
	}
	return row
}

// rollback forgets the sequences this Forward created. Sequences that
// existed keep their cached length; rows written past it are unused.
func (s *Stage) rollback() {
	for _, id := range s.created {
		delete(s.seqs, id)
	}
}

// layer runs transformer layer s.lo+li on the first rows of the residual
// stream.
func (s *Stage) layer(li, rows int) {
	l := &s.layers[li]
	h, inter, hd := s.m.HiddenSize, s.m.IntermediateSize, s.m.HeadDim
	eps := float32(s.m.RMSNormEps)
	x, xn := s.buf.x[:rows*h], s.buf.xn[:rows*h]

	for r := range rows {
		rmsNorm(xn[r*h:(r+1)*h], x[r*h:(r+1)*h], l.inNorm, eps)
	}
	qkv := s.buf.qkv[:rows*s.qkvDim]
	s.linear(qkv, s.qkvDim, xn, rows, h, l.qkv, l.qkvBias, false)
	half := hd / 2
	kc, vc := s.kPool[li], s.vPool[li]
	for _, run := range s.runs {
		for i := range run.n {
			r := run.row + i
			qkvRow := qkv[r*s.qkvDim : (r+1)*s.qkvDim]
			// q and k heads are contiguous: rotate them in one pass.
			applyRope(qkvRow[:s.qDim+s.kvDim], hd, s.buf.cos[r*half:(r+1)*half], s.buf.sin[r*half:(r+1)*half])
			slot := run.slot(run.pos+i, s.blockSize)
			copy(kc[slot*s.kvDim:(slot+1)*s.kvDim], qkvRow[s.qDim:s.qDim+s.kvDim])
			copy(vc[slot*s.kvDim:(slot+1)*s.kvDim], qkvRow[s.qDim+s.kvDim:])
		}
	}
	s.attention(li)
	s.linear(x, h, s.buf.attn[:rows*s.qDim], rows, s.qDim, l.o, nil, true)

	for r := range rows {
		rmsNorm(xn[r*h:(r+1)*h], x[r*h:(r+1)*h], l.postNorm, eps)
	}
	gu := s.buf.gateUp[:rows*2*inter]
	s.linear(gu, 2*inter, xn, rows, h, l.gateUp, nil, false)
	act := s.buf.act[:rows*inter]
	for r := range rows {
		g := gu[r*2*inter : r*2*inter+inter]
		u := gu[r*2*inter+inter : (r+1)*2*inter]
		a := act[r*inter : (r+1)*inter]
		for j := range a {
			a[j] = silu(g[j]) * u[j]
		}
	}
	s.linear(x, h, act, rows, inter, l.down, nil, true)
}

// attention computes causal grouped-query attention of every row's query
// heads over its sequence's cached keys and values (which already include
// the batch's own rows), gathered block by block through the sequence's
// block table, writing the heads' outputs into buf.attn.
func (s *Stage) attention(li int) {
	nh, hd := s.m.NumHeads, s.m.HeadDim
	group := nh / s.m.NumKVHeads
	maxPos := s.m.MaxPositions
	bs, kvDim := s.blockSize, s.kvDim
	kc, vc := s.kPool[li], s.vPool[li]
	work := 0
	for _, run := range s.runs {
		work += run.n * (run.pos + run.n) * 2 * hd * nh
	}
	s.parallelItems(len(s.runs)*nh, work, func(worker, item int) {
		run := &s.runs[item/nh]
		h := item % nh
		kvOff := (h / group) * hd
		scores := s.buf.scores[worker*maxPos : (worker+1)*maxPos]
		for i := range run.n {
			r := run.row + i
			q := s.buf.qkv[r*s.qkvDim+h*hd : r*s.qkvDim+(h+1)*hd]
			sc := scores[:run.pos+i+1]
			m := float32(math.Inf(-1))
			for j0 := 0; j0 < len(sc); j0 += bs {
				off := int(run.blocks[j0/bs])*bs*kvDim + kvOff
				for j := j0; j < min(j0+bs, len(sc)); j, off = j+1, off+kvDim {
					v := dot(q, kc[off:off+hd]) * s.attnScale
					sc[j] = v
					m = max(m, v)
				}
			}
			var sum float32
			for j, v := range sc {
				e := float32(math.Exp(float64(v - m)))
				sc[j] = e
				sum += e
			}
			out := s.buf.attn[r*s.qDim+h*hd : r*s.qDim+(h+1)*hd]
			clear(out)
			for j0 := 0; j0 < len(sc); j0 += bs {
				off := int(run.blocks[j0/bs])*bs*kvDim + kvOff
				for j := j0; j < min(j0+bs, len(sc)); j, off = j+1, off+kvDim {
					axpy(sc[j], vc[off:off+hd], out)
				}
			}
			inv := 1 / sum
			for d := range out {
				out[d] *= inv
			}
		}
	})
}

// head applies the final norm and the LM head to the rows whose logits are
// needed, fills out.Logits and samples.
func (s *Stage) head(b *stage.Batch, out *stage.Output) {
	h, vocab := s.m.HiddenSize, s.m.VocabSize
	need := s.headRows[:0]
	for i, run := range s.runs {
		q := &b.Seqs[i]
		switch {
		case q.Logits:
			for j := range run.n {
				need = append(need, run.row+j)
			}
		case q.Sample:
			need = append(need, run.row+run.n-1)
		}
	}
	s.headRows = need
	if len(need) == 0 {
		return
	}
	eps := float32(s.m.RMSNormEps)
	hn := s.buf.xn[:len(need)*h]
	for k, r := range need {
		rmsNorm(hn[k*h:(k+1)*h], s.buf.x[r*h:(r+1)*h], s.norm, eps)
	}
	logits := s.buf.logits
	if len(need)*vocab > len(logits) {
		logits = make([]float32, len(need)*vocab)
	}
	logits = logits[:len(need)*vocab]
	s.linear(logits, vocab, hn, len(need), h, s.lmHead, nil, false)

	k := 0
	for i, run := range s.runs {
		q := &b.Seqs[i]
		var lastRow []float32
		switch {
		case q.Logits:
			sl := stage.SeqLogits{Seq: q.ID, Rows: make([][]float32, run.n)}
			for j := range run.n {
				sl.Rows[j] = logits[(k+j)*vocab : (k+j+1)*vocab : (k+j+1)*vocab]
			}
			k += run.n
			out.Logits = append(out.Logits, sl)
			lastRow = sl.Rows[run.n-1]
		case q.Sample:
			lastRow = logits[k*vocab : (k+1)*vocab]
			k++
		}
		if q.Sample {
			smp, err := s.sampler.sample(lastRow, &q.Sampling, q.Index)
			if err != nil {
				// Only this sequence fails; its hand-off row carries token 0.
				smp.Err = fmt.Sprintf("cpu stage [%d,%d): sequence %d: %v", s.lo, s.hi, q.ID, err)
			}
			smp.Seq = q.ID
			out.Sampled = append(out.Sampled, smp)
		}
	}
}
