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
		case slices.Contains(r.StopTokens, t), r.StopCheck != nil && r.StopCheck(out):
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
type fakePipe struct {
	model     fakeModel
	blockSize int
	in        []chan fakeMsg
	results   chan *pipeline.Result
	board     *sampleBoard
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

type fakePipeConfig struct {
	model                fakeModel
	numBlocks, blockSize int
	// latency is how long stage k takes for batch b.
	latency func(k int, b *stage.Batch) time.Duration
}

func newFakePipe(c fakePipeConfig) *fakePipe {
	fp := &fakePipe{model: c.model, blockSize: c.blockSize, results: make(chan *pipeline.Result, 64), board: newSampleBoard()}
	for k := range c.model.stages {
		fp.in = append(fp.in, make(chan fakeMsg, 64))
		st := &fakeStage{k: k, fp: fp, kv: make([]slot, c.numBlocks*c.blockSize), owner: make([]uint64, c.numBlocks), seqs: map[uint64]*fakeSeq{}, lives: map[uint64]int{}}
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
				if m.err == nil {
					m.acts, m.err = st.run(m.step, m.acts)
					if m.err != nil {
						fp.fail(m.err)
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
	st.sampled = nil
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
					if j != n-1 || !q.Sample {
						return nil, fail("placeholder not a sampling decode")
					}
					t = st.fp.board.wait(q.ID, q.Index-1)
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
			if err := st.fp.board.put(q.ID, q.Index, t); err != nil {
				return nil, fail("%v", err)
			}
			st.sampled = append(st.sampled, stage.Sampled{Seq: q.ID, Token: t})
		}
	}
	return out, nil
}

// sampleBoard is the fake's on-device hand-off: the last stage posts each
// sample, and the first stage waits for the one a placeholder stands for.
type sampleBoard struct {
	mu sync.Mutex
	m  map[[2]uint64]*posted
}

type posted struct {
	tok   int32
	ready chan struct{}
}

func newSampleBoard() *sampleBoard { return &sampleBoard{m: map[[2]uint64]*posted{}} }

func (sb *sampleBoard) get(seq uint64, index int) *posted {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	k := [2]uint64{seq, uint64(index)}
	p := sb.m[k]
	if p == nil {
		p = &posted{ready: make(chan struct{})}
		sb.m[k] = p
	}
	return p
}

func (sb *sampleBoard) wait(seq uint64, index int) int32 {
	p := sb.get(seq, index)
	<-p.ready
	return p.tok
}

// put posts a sample; a sample posted again (a recomputed one) must be the
// same token.
func (sb *sampleBoard) put(seq uint64, index int, tok int32) error {
	p := sb.get(seq, index)
	select {
	case <-p.ready:
		if p.tok != tok {
			return fmt.Errorf("sample %d sampled again as %d, was %d", index, tok, p.tok)
		}
		return nil
	default:
	}
	p.tok = tok
	close(p.ready)
	return nil
}
