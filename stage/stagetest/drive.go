package stagetest

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/stage"
)

// pipeline runs batches through a chain of stages covering a model's layers
// in order.
type pipeline struct {
	stages   []stage.Stage
	transfer func(t *testing.T, out *stage.Output, next stage.Stage)
	tables   *BlockTables
}

func newPipeline(transfer func(*testing.T, *stage.Output, stage.Stage), stages ...stage.Stage) *pipeline {
	return &pipeline{stages: stages, transfer: transfer, tables: TablesFor(stages, uint64(len(stages)))}
}

// forward gives the batch's sequences block tables, runs it through every
// stage, moving each stage's activations into the next one's Input, and
// returns the last stage's output.
func (p *pipeline) forward(ctx context.Context, t *testing.T, b *stage.Batch) (*stage.Output, error) {
	t.Helper()
	if err := p.tables.Fill(b); err != nil {
		t.Fatal(err)
	}
	for i, st := range p.stages {
		out, err := st.Forward(ctx, b)
		if err != nil {
			return nil, fmt.Errorf("stage %d: %w", i, err)
		}
		if i == len(p.stages)-1 {
			return out, nil
		}
		next := p.stages[i+1].Info()
		want := collective.Header{Batch: b.ID, Rows: b.NumTokens(), Cols: next.Hidden, DType: next.ActDType}
		if out.Header != want {
			t.Fatalf("batch %d: stage %d sends header %+v, want %+v", b.ID, i, out.Header, want)
		}
		if out.Activations == nil || out.Activations.Len() < want.Bytes() {
			t.Fatalf("batch %d: stage %d activations %v hold less than the header's %d bytes", b.ID, i, out.Activations, want.Bytes())
		}
		p.transfer(t, out, p.stages[i+1])
	}
	panic("stagetest: empty pipeline")
}

// hostTransfer copies activations between host buffers.
func hostTransfer(t *testing.T, out *stage.Output, next stage.Stage) {
	t.Helper()
	src, ok := out.Activations.(collective.Host)
	dst, ok2 := next.Input().(collective.Host)
	if !ok || !ok2 {
		t.Fatalf("activations %T into input %T: not host buffers; set Backend.Transfer", out.Activations, next.Input())
	}
	n := out.Header.Bytes()
	if len(dst) < n {
		t.Fatalf("next stage input holds %d bytes, batch needs %d", len(dst), n)
	}
	copy(dst[:n], src[:n])
}

// request is one sequence a test drives to completion: its prompt is
// prefilled, then gen decode steps follow, each feeding one token and
// sampling the next.
type request struct {
	id     uint64
	prompt []int32
	// forced are the tokens the decode steps feed (teacher forcing); nil
	// feeds back the sampled tokens.
	forced   []int32
	gen      int
	logits   bool // ask for the logits of every position
	sampling stage.Sampling
}

// result is what the stages returned for one request.
type result struct {
	tokens    []int32     // every token fed: prompt, then decode tokens
	logits    [][]float32 // per position, when asked for
	sampled   []stage.Sampled
	samplePos []int // the position each sample was drawn at
}

// schedule shapes the batches of a drive.
type schedule struct {
	name    string
	chunk   int // most prompt tokens of one sequence per batch
	budget  int // most tokens per batch
	stagger int // batches between the starts of consecutive requests
	maxSeqs int // most sequences per batch
}

// drive runs the requests through p as a continuous batcher would: each
// batch takes every started, unfinished request in order (prefill chunks of
// up to sch.chunk tokens, single-token decodes) within the token budget. It
// checks the shape of every Output and, where a sampled row's logits were
// returned, that the sample agrees with them.
func drive(t *testing.T, p *pipeline, reqs []request, sch schedule) map[uint64]*result {
	t.Helper()
	type state struct {
		pos  int   // tokens fed so far
		fed  int   // decode tokens fed so far
		next int32 // the next decode token
		done bool
	}
	states := make([]state, len(reqs))
	results := make(map[uint64]*result, len(reqs))
	for _, r := range reqs {
		results[r.id] = &result{}
	}
	for step := 0; ; step++ {
		if !slices.ContainsFunc(states, func(s state) bool { return !s.done }) {
			return results
		}
		b := &stage.Batch{ID: uint64(1000 + step)}
		var idx []int // request of each Seq
		budget := sch.budget
		for i, r := range reqs {
			st := &states[i]
			if st.done || i*sch.stagger > step || len(b.Seqs) == sch.maxSeqs || budget == 0 {
				continue
			}
			var toks []int32
			if st.pos < len(r.prompt) {
				toks = r.prompt[st.pos : st.pos+min(sch.chunk, len(r.prompt)-st.pos, budget)]
			} else {
				toks = []int32{st.next}
			}
			budget -= len(toks)
			b.Seqs = append(b.Seqs, stage.Seq{
				ID: r.id, Pos: st.pos, Tokens: toks,
				Sample:   st.pos+len(toks) >= len(r.prompt),
				Sampling: r.sampling,
				Index:    len(results[r.id].sampled),
				Logits:   r.logits,
			})
			idx = append(idx, i)
		}
		if len(b.Seqs) == 0 {
			continue
		}
		out, err := p.forward(context.Background(), t, b)
		if err != nil {
			t.Fatalf("schedule %s: %v", sch.name, err)
		}
		checkOutputShape(t, b, out, p.stages[len(p.stages)-1].Info().Vocab)
		nl, ns := 0, 0
		for k := range b.Seqs {
			q := &b.Seqs[k]
			r, st, res := &reqs[idx[k]], &states[idx[k]], results[q.ID]
			res.tokens = append(res.tokens, q.Tokens...)
			var lastRow []float32
			if q.Logits {
				for _, row := range out.Logits[nl].Rows {
					res.logits = append(res.logits, append([]float32(nil), row...))
				}
				lastRow = out.Logits[nl].Rows[len(q.Tokens)-1]
				nl++
			}
			st.pos += len(q.Tokens)
			if !q.Sample {
				continue
			}
			smp := out.Sampled[ns]
			ns++
			if lastRow != nil {
				checkSampleAgainstRow(t, q, smp, lastRow)
			}
			res.sampled = append(res.sampled, smp)
			res.samplePos = append(res.samplePos, st.pos-1)
			if st.fed == r.gen {
				st.done = true
				continue
			}
			st.next = smp.Token
			if r.forced != nil {
				st.next = r.forced[st.fed]
			}
			st.fed++
		}
	}
}

// checkOutputShape checks that out has the logits and samples b asked for,
// in batch order.
func checkOutputShape(t *testing.T, b *stage.Batch, out *stage.Output, vocab int) {
	t.Helper()
	var wantLogits, wantSampled []uint64
	for _, q := range b.Seqs {
		if q.Logits {
			wantLogits = append(wantLogits, q.ID)
		}
		if q.Sample {
			wantSampled = append(wantSampled, q.ID)
		}
	}
	if len(out.Logits) != len(wantLogits) || len(out.Sampled) != len(wantSampled) {
		t.Fatalf("batch %d: %d logits and %d samples returned, want %d and %d", b.ID, len(out.Logits), len(out.Sampled), len(wantLogits), len(wantSampled))
	}
	k := 0
	for _, q := range b.Seqs {
		if !q.Logits {
			continue
		}
		sl := out.Logits[k]
		k++
		if sl.Seq != q.ID || len(sl.Rows) != len(q.Tokens) {
			t.Fatalf("batch %d: logits for seq %d with %d rows, want seq %d with %d", b.ID, sl.Seq, len(sl.Rows), q.ID, len(q.Tokens))
		}
		for _, row := range sl.Rows {
			if len(row) != vocab {
				t.Fatalf("batch %d: seq %d: logits row of %d values, want %d", b.ID, q.ID, len(row), vocab)
			}
		}
	}
	for i, id := range wantSampled {
		s := out.Sampled[i]
		if s.Seq != id {
			t.Fatalf("batch %d: sample %d is for seq %d, want %d", b.ID, i, s.Seq, id)
		}
		if s.Token < 0 || int(s.Token) >= vocab {
			t.Fatalf("batch %d: seq %d sampled token %d outside [0,%d)", b.ID, id, s.Token, vocab)
		}
	}
}

// checkSampleAgainstRow checks a sample against the logits row it was
// drawn from: its log-probability and top alternatives are those of the
// row's log-softmax, and a greedy sample is the row's arg-max.
func checkSampleAgainstRow(t *testing.T, q *stage.Seq, smp stage.Sampled, row []float32) {
	t.Helper()
	r := make([]float64, len(row))
	for i, v := range row {
		r[i] = float64(v)
	}
	lp := LogSoftmax(r)
	const tol = 1e-5
	if d := float64(smp.Logprob) - lp[smp.Token]; d > tol*(1-lp[smp.Token]) || -d > tol*(1-lp[smp.Token]) {
		t.Errorf("seq %d: sampled logprob %v, log-softmax of its logits row gives %v", q.ID, smp.Logprob, lp[smp.Token])
	}
	if q.Sampling.Temperature == 0 {
		best := 0
		for i, v := range row {
			if v > row[best] {
				best = i
			}
		}
		if int(smp.Token) != best {
			t.Errorf("seq %d: greedy sample %d, arg-max of its logits row is %d", q.ID, smp.Token, best)
		}
	}
	if len(smp.Top) != q.Sampling.Logprobs {
		t.Fatalf("seq %d: %d top logprobs, want %d", q.ID, len(smp.Top), q.Sampling.Logprobs)
	}
	for i, tl := range smp.Top {
		if d := float64(tl.Logprob) - lp[tl.Token]; d > tol*(1-lp[tl.Token]) || -d > tol*(1-lp[tl.Token]) {
			t.Errorf("seq %d: top %d: token %d logprob %v, log-softmax gives %v", q.ID, i, tl.Token, tl.Logprob, lp[tl.Token])
		}
		if i > 0 {
			prev := smp.Top[i-1]
			if row[tl.Token] > row[prev.Token] || (row[tl.Token] == row[prev.Token] && tl.Token < prev.Token) {
				t.Errorf("seq %d: top logprobs not in descending order at %d: %+v", q.ID, i, smp.Top)
			}
		}
	}
	if len(smp.Top) > 0 {
		for id, v := range row {
			if v > row[smp.Top[len(smp.Top)-1].Token] && !containsToken(smp.Top, int32(id)) {
				t.Errorf("seq %d: token %d (logit %v) is missing from the top logprobs %+v", q.ID, id, v, smp.Top)
				break
			}
		}
	}
}

func containsToken(top []stage.TokenLogprob, id int32) bool {
	for _, tl := range top {
		if tl.Token == id {
			return true
		}
	}
	return false
}

// randomTokens returns n token ids in [0, vocab).
func randomTokens(rng *rand.Rand, n, vocab int) []int32 {
	toks := make([]int32, n)
	for i := range toks {
		toks[i] = int32(rng.IntN(vocab))
	}
	return toks
}
