package sched_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/tandem-llm/tandem/pipeline"
	"github.com/tandem-llm/tandem/sched"
	"github.com/tandem-llm/tandem/stage"
)

// The fake pipeline's "model" is a chain of hashes: stage k's state at
// position pos is h_k(pos) = mix(h_k(pos-1), h_{k-1}(pos)), where
// h_{-1}(pos) is the token at pos and h_k(-1) = 0, and each stage keeps its
// h_k in its KV cache. The last stage samples mix(mix(h, seed), index)
// modulo the vocabulary. A token is right only if every stage was fed the
// right inputs at the right positions and read its cache through the right
// block table, so the output equals the output run alone (fakeModel.alone)
// iff the scheduler did its job.
type fakeModel struct {
	stages, vocab int
}

func mix(a, b uint64) uint64 {
	x := a ^ (b+0x9e3779b97f4a7c15)*0xbf58476d1ce4e5b9
	x ^= x >> 31
	x *= 0x94d049bb133111eb
	x ^= x >> 29
	return x
}

func (m fakeModel) sample(h uint64, sp *stage.Sampling, index int) int32 {
	return int32(mix(mix(h, sp.Seed), uint64(index)) % uint64(m.vocab))
}

// alone is r's output run by itself, computed directly.
func (m fakeModel) alone(r *sched.Request) (out []int32, finish string) {
	h := make([]uint64, m.stages)
	feed := func(t int32) {
		in := uint64(t)
		for k := range h {
			h[k] = mix(h[k], in)
			in = h[k]
		}
	}
	for _, t := range r.Prompt {
		feed(t)
	}
	for i := 0; ; i++ {
		t := m.sample(h[m.stages-1], &r.Sampling, i)
		out = append(out, t)
		switch {
		case slices.Contains(r.StopTokens, t):
			return out, sched.FinishStop
		case len(out) == r.MaxTokens:
			return out, sched.FinishLength
		}
		feed(t)
	}
}

// fakePipe is a p-stage pipeline of fakeStages, one goroutine each, with a
// latency per stage and step; it implements sched.Executor. Every stage
// checks what it is given: block tables covering exactly the chunk's
// positions, ids in range, no block held by two live sequences, tables
// that only grow while a sequence lives, chunks that continue where the
// sequence's cache ends, and cache reads that find the sequence's own
// entry. A check that fails is recorded and fails the step.
//
// Hand-off works as pipeline.Worker does it: the last stage of a step with
// Batch.Handoff sends its (slot, token) rows on a ring link of
// maxConcurrent messages to the first stage, which records, for each
// hand-off step it has run, the batch and row count it expects, and before
// running a step receives and applies messages in order until it has
// applied AwaitHandoff; a placeholder takes the token last applied for its
// slot. A wrong AwaitHandoff or slot gives a wrong token (or a deadlock,
// which synctest reports); a single stage applies its own rows at once.
type fakePipe struct {
	model     fakeModel
	blockSize int
	maxSeqs   int
	in        []chan fakeMsg
	results   chan *pipeline.Result
	ring      chan fakeHandoff
	stages    []*fakeStage
	wg        sync.WaitGroup

	mu   sync.Mutex
	errs []error
}

type fakeMsg struct {
	step *pipeline.Step
	acts []uint64 // the previous stage's h per row
	err  error
}

// fakeHandoff is a hand-off message: the rows of one step.
type fakeHandoff struct {
	batch uint64
	rows  [][2]int32 // slot, token
}

type fakePipeConfig struct {
	model                fakeModel
	numBlocks, blockSize int
	// maxSeqs bounds the hand-off slots; maxConcurrent is the depth of the
	// ring link (the scheduler's MaxConcurrentBatches).
	maxSeqs, maxConcurrent int
	// latency is how long stage k takes for batch b.
	latency func(k int, b *stage.Batch) time.Duration
}

func newFakePipe(c fakePipeConfig) *fakePipe {
	fp := &fakePipe{model: c.model, blockSize: c.blockSize, maxSeqs: c.maxSeqs, results: make(chan *pipeline.Result, 64), ring: make(chan fakeHandoff, c.maxConcurrent)}
	for k := range c.model.stages {
		fp.in = append(fp.in, make(chan fakeMsg, 64))
		st := &fakeStage{k: k, fp: fp, kv: make([]slot, c.numBlocks*c.blockSize), owner: make([]uint64, c.numBlocks), seqs: map[uint64]*fakeSeq{}, lives: map[uint64]int{},
			slotTok: make([]int32, c.maxSeqs), slotSet: make([]bool, c.maxSeqs)}
		for b := range st.owner {
			st.owner[b] = noOwner
		}
		fp.stages = append(fp.stages, st)
	}
	for k, st := range fp.stages {
		fp.wg.Add(1)
		go func() {
			defer fp.wg.Done()
			last := k == len(fp.stages)-1
			if last {
				defer close(fp.results)
			} else {
				defer close(fp.in[k+1])
			}
			for m := range fp.in[k] {
				st.sampled, st.rows = nil, nil
				if m.err == nil && k == 0 {
					m.err = st.awaitHandoff(m.step)
				}
				if m.err == nil {
					m.acts, m.err = st.run(m.step, m.acts)
				}
				if m.err != nil {
					fp.fail(m.err)
				}
				if m.step.Batch.Handoff {
					// Even a failed step sends its rows, so that the first
					// stage reports the mismatch instead of waiting for
					// them.
					if err := st.handoff(m.step); err != nil && m.err == nil {
						m.err = err
						fp.fail(err)
					}
				}
				if c.latency != nil && len(m.step.Batch.Seqs) > 0 {
					time.Sleep(c.latency(k, &m.step.Batch))
				}
				if !last {
					fp.in[k+1] <- m
				} else if len(m.step.Batch.Seqs) > 0 {
					r := &pipeline.Result{Batch: m.step.Batch.ID, Stage: k}
					if m.err != nil {
						r.Err = m.err.Error()
					} else {
						r.Sampled = st.sampled
					}
					fp.results <- r
				}
			}
		}()
	}
	return fp
}

func (fp *fakePipe) fail(err error) {
	fp.mu.Lock()
	fp.errs = append(fp.errs, err)
	fp.mu.Unlock()
}

// Errs are the failed checks.
func (fp *fakePipe) Errs() []error {
	fp.mu.Lock()
	defer fp.mu.Unlock()
	return slices.Clone(fp.errs)
}

// Submit implements sched.Executor.
func (fp *fakePipe) Submit(ctx context.Context, s *pipeline.Step) error {
	select {
	case fp.in[0] <- fakeMsg{step: s}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Wait implements sched.Executor.
func (fp *fakePipe) Wait(ctx context.Context) (*pipeline.Result, error) {
	select {
	case r, ok := <-fp.results:
		if !ok {
			return nil, errors.New("fake pipeline closed")
		}
		if r.Err != "" {
			return nil, errors.New(r.Err)
		}
		return r, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// Close stops the stages once they have run every step submitted, and
// checks that no block is still held.
func (fp *fakePipe) Close() {
	close(fp.in[0])
	for range fp.results {
	}
	fp.wg.Wait()
	for _, st := range fp.stages {
		for b, o := range st.owner {
			if o != noOwner {
				fp.fail(fmt.Errorf("stage %d: block %d still held by seq %d at the end", st.k, b, o))
			}
		}
	}
}

const noOwner = ^uint64(0)

// slot is one position's entry in a stage's KV cache.
type slot struct {
	seq  uint64
	life int // the sequence's life on the stage: Free ends one
	pos  int
	h    uint64
	set  bool
}

type fakeSeq struct {
	n      int // positions cached
	life   int
	blocks []int32
}

type fakeStage struct {
	k       int
	fp      *fakePipe
	kv      []slot   // [NumBlocks × BlockSize]
	owner   []uint64 // per block: the live sequence holding it
	seqs    map[uint64]*fakeSeq
	lives   map[uint64]int
	sampled []stage.Sampled
	rows    [][2]int32 // the last step's hand-off rows (last stage)

	// The first stage's hand-off state: the steps whose rows it expects,
	// in order, how many it has applied, and the token applied last for
	// each slot.
	expect  []fakeHandoff
	applied int
	slotTok []int32
	slotSet []bool
}

// awaitHandoff receives and applies hand-off messages until AwaitHandoff
// are applied (first stage).
func (st *fakeStage) awaitHandoff(s *pipeline.Step) error {
	for st.applied < s.AwaitHandoff {
		if len(st.expect) == 0 {
			return fmt.Errorf("batch %d awaits %d hand-offs, but only %d hand-off steps have run", s.Batch.ID, s.AwaitHandoff, st.applied)
		}
		want := st.expect[0]
		st.expect = st.expect[1:]
		m := <-st.fp.ring
		if m.batch != want.batch || len(m.rows) != len(want.rows) {
			return fmt.Errorf("hand-off of batch %d with %d rows, want batch %d with %d", m.batch, len(m.rows), want.batch, len(want.rows))
		}
		if err := st.apply(m.rows); err != nil {
			return fmt.Errorf("hand-off of batch %d: %w", m.batch, err)
		}
	}
	return nil
}

func (st *fakeStage) apply(rows [][2]int32) error {
	for _, r := range rows {
		if r[0] < 0 || int(r[0]) >= len(st.slotTok) {
			return fmt.Errorf("slot %d out of range [0, %d)", r[0], len(st.slotTok))
		}
		st.slotTok[r[0]], st.slotSet[r[0]] = r[1], true
	}
	st.applied++
	return nil
}

// handoff does a hand-off step's part on the first stage (expect its rows)
// and on the last (send them, or apply them on a single stage).
func (st *fakeStage) handoff(s *pipeline.Step) error {
	first, last := st.k == 0, st.k == len(st.fp.stages)-1
	switch {
	case first && last:
		return st.apply(st.rows)
	case first:
		var rows [][2]int32
		for _, q := range s.Batch.Seqs {
			if q.Sample {
				rows = append(rows, [2]int32{})
			}
		}
		st.expect = append(st.expect, fakeHandoff{batch: s.Batch.ID, rows: rows})
	case last:
		st.fp.ring <- fakeHandoff{batch: s.Batch.ID, rows: slices.Clone(st.rows)}
	}
	return nil
}

func (st *fakeStage) run(s *pipeline.Step, acts []uint64) ([]uint64, error) {
	for _, id := range s.Free {
		if q := st.seqs[id]; q != nil {
			for _, b := range q.blocks {
				st.owner[b] = noOwner
			}
			delete(st.seqs, id)
		}
		st.lives[id]++
	}
	out := make([]uint64, 0, s.Batch.NumTokens())
	bs := st.fp.blockSize
	for i := range s.Batch.Seqs {
		q := &s.Batch.Seqs[i]
		fs := st.seqs[q.ID]
		if fs == nil {
			fs = &fakeSeq{life: st.lives[q.ID]}
			st.seqs[q.ID] = fs
		}
		fail := func(format string, a ...any) error {
			return fmt.Errorf("stage %d, batch %d, seq %d (pos %d, %d tokens, blocks %v): %s", st.k, s.Batch.ID, q.ID, q.Pos, len(q.Tokens), q.Blocks, fmt.Sprintf(format, a...))
		}
		n := len(q.Tokens)
		switch {
		case n == 0:
			return nil, fail("empty chunk")
		case q.Pos != fs.n:
			return nil, fail("chunk at position %d, but %d positions are cached", q.Pos, fs.n)
		case len(q.Blocks) != (q.Pos+n+bs-1)/bs:
			return nil, fail("%d blocks for %d positions of %d", len(q.Blocks), q.Pos+n, bs)
		}
		for j, b := range q.Blocks {
			switch {
			case b < 0 || int(b) >= len(st.owner):
				return nil, fail("block %d out of range", b)
			case j < len(fs.blocks):
				if fs.blocks[j] != b {
					return nil, fail("block %d changed from %d", j, fs.blocks[j])
				}
			case st.owner[b] != noOwner:
				return nil, fail("block %d held by live seq %d", b, st.owner[b])
			default:
				st.owner[b] = q.ID
				fs.blocks = append(fs.blocks, b)
			}
		}
		at := func(pos int) *slot { return &st.kv[int(q.Blocks[pos/bs])*bs+pos%bs] }
		for j := range n {
			pos := q.Pos + j
			var prev uint64
			if pos > 0 {
				sl := at(pos - 1)
				if !sl.set || sl.seq != q.ID || sl.life != fs.life || sl.pos != pos-1 {
					return nil, fail("position %d reads %+v", pos-1, *sl)
				}
				prev = sl.h
			}
			var in uint64
			if st.k == 0 {
				t := q.Tokens[j]
				if t == stage.Placeholder {
					switch {
					case j != n-1 || !q.Sample:
						return nil, fail("placeholder not a sampling decode")
					case q.Slot < 0 || q.Slot >= len(st.slotTok) || !st.slotSet[q.Slot]:
						return nil, fail("placeholder in slot %d, which has no token", q.Slot)
					}
					t = st.slotTok[q.Slot]
				}
				in = uint64(t)
			} else {
				in = acts[len(out)]
			}
			h := mix(prev, in)
			*at(pos) = slot{seq: q.ID, life: fs.life, pos: pos, h: h, set: true}
			out = append(out, h)
		}
		fs.n += n
		if q.Sample && st.k == len(st.fp.stages)-1 {
			t := st.fp.model.sample(out[len(out)-1], &q.Sampling, q.Index)
			st.sampled = append(st.sampled, stage.Sampled{Seq: q.ID, Token: t})
			st.rows = append(st.rows, [2]int32{int32(q.Slot), t})
		}
	}
	return out, nil
}
