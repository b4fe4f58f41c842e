package pipeline_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/pipeline"
	"github.com/tandem-llm/tandem/sched"
	"github.com/tandem-llm/tandem/stage"
)

// hashStage is a stage of a pipeline whose "model" is a chain of hashes:
// stage k's state at position pos of a sequence is mix(state at pos-1, its
// input at pos), its input being the token on the first stage and the
// previous stage's state elsewhere; the last stage samples mix(mix(h, seed),
// index) modulo the vocabulary. It implements stage.HandoffReceiver in host
// memory the way a real first stage does: placeholders take the token last
// applied for their slot, and a placeholder whose slot has no token fails
// the batch. A token comes out right only if every hand-off reached the
// first stage in time and in order.
type hashStage struct {
	first, last bool
	vocab       int
	delay       time.Duration // per Forward

	in, act    collective.Host // activations: rows of one uint64
	hin, hout  collective.Host // hand-off rows: slot, token as int32
	slotTok    []int32
	slotSet    []bool
	kv         map[uint64][]uint64
	out        stage.Output
	placeholds int // placeholders filled (first stage)
	skew       int // added to the rows of the hand-off header: a faulty stage
}

const (
	hashMaxTokens = 64
	hashMaxSeqs   = 8
)

func newHashStage(first, last bool, vocab int, delay time.Duration) *hashStage {
	return &hashStage{
		first: first, last: last, vocab: vocab, delay: delay,
		in: make(collective.Host, 8*hashMaxTokens), act: make(collective.Host, 8*hashMaxTokens),
		hin: make(collective.Host, 8*hashMaxSeqs), hout: make(collective.Host, 8*hashMaxSeqs),
		slotTok: make([]int32, hashMaxSeqs), slotSet: make([]bool, hashMaxSeqs),
		kv: map[uint64][]uint64{},
	}
}

func (s *hashStage) Info() stage.Info {
	return stage.Info{Backend: "hash", Hi: 1, First: s.first, Last: s.last, Hidden: 2, Vocab: s.vocab,
		MaxTokens: hashMaxTokens, MaxSeqs: hashMaxSeqs, ActDType: collective.F32}
}

func (s *hashStage) Input() collective.Buffer {
	if s.first {
		return nil
	}
	return s.in
}

func (s *hashStage) Free(seq uint64) { delete(s.kv, seq) }
func (s *hashStage) Close() error    { return nil }

func (s *hashStage) HandoffInput() collective.Buffer { return s.hin }

func (s *hashStage) ApplyHandoff(_ context.Context, rows int) error {
	if rows > hashMaxSeqs {
		return fmt.Errorf("%d hand-off rows, at most %d", rows, hashMaxSeqs)
	}
	for r := range rows {
		slot := int32(binary.LittleEndian.Uint32(s.hin[8*r:]))
		if slot < 0 || slot >= hashMaxSeqs {
			return fmt.Errorf("hand-off row %d: slot %d out of range", r, slot)
		}
		s.slotTok[slot] = int32(binary.LittleEndian.Uint32(s.hin[8*r+4:]))
		s.slotSet[slot] = true
	}
	return nil
}

func (s *hashStage) Forward(_ context.Context, b *stage.Batch) (*stage.Output, error) {
	time.Sleep(s.delay)
	s.out = stage.Output{}
	row := 0
	for _, q := range b.Seqs {
		h := s.kv[q.ID]
		if q.Pos != len(h) {
			return nil, fmt.Errorf("seq %d: chunk at position %d, %d cached", q.ID, q.Pos, len(h))
		}
		for _, t := range q.Tokens {
			var in uint64
			switch {
			case !s.first:
				in = binary.LittleEndian.Uint64(s.in[8*row:])
			case t == stage.Placeholder:
				if q.Slot < 0 || q.Slot >= hashMaxSeqs || !s.slotSet[q.Slot] {
					return nil, fmt.Errorf("seq %d: placeholder in slot %d, which has no token", q.ID, q.Slot)
				}
				in = uint64(s.slotTok[q.Slot])
				s.placeholds++
			default:
				in = uint64(t)
			}
			var prev uint64
			if len(h) > 0 {
				prev = h[len(h)-1]
			}
			h = append(h, mix(prev, in))
			binary.LittleEndian.PutUint64(s.act[8*row:], h[len(h)-1])
			row++
		}
		s.kv[q.ID] = h
		if q.Sample && s.last {
			tok := hashSample(h[len(h)-1], q.Sampling.Seed, q.Index, s.vocab)
			if b.Handoff {
				k := len(s.out.Sampled)
				binary.LittleEndian.PutUint32(s.hout[8*k:], uint32(q.Slot))
				binary.LittleEndian.PutUint32(s.hout[8*k+4:], uint32(tok))
			}
			s.out.Sampled = append(s.out.Sampled, stage.Sampled{Seq: q.ID, Token: tok})
		}
	}
	if s.last {
		if b.Handoff {
			s.out.HandoffHeader = collective.Header{Batch: b.ID, Rows: len(s.out.Sampled) + s.skew, Cols: stage.HandoffCols, DType: collective.I32}
			s.out.Handoff = s.hout
		}
		return &s.out, nil
	}
	s.out.Header = collective.Header{Batch: b.ID, Rows: row, Cols: 2, DType: collective.F32}
	s.out.Activations = s.act
	return &s.out, nil
}

func mix(a, b uint64) uint64 {
	x := a ^ (b+0x9e3779b97f4a7c15)*0xbf58476d1ce4e5b9
	x ^= x >> 31
	x *= 0x94d049bb133111eb
	x ^= x >> 29
	return x
}

func hashSample(h, seed uint64, index, vocab int) int32 {
	return int32(mix(mix(h, seed), uint64(index)) % uint64(vocab))
}

// checkAlone submits n random requests (prompts of 1 to 20 tokens, 1 to
// maxTokens tokens, every third with a stop token) to l, a loop over p
// hash stages, and checks that each streams the tokens it produces alone.
func checkAlone(t *testing.T, l *sched.Loop, p, vocab int, rng *rand.Rand, n, maxTokens int) {
	t.Helper()
	var wg sync.WaitGroup
	for i := range n {
		r := sched.Request{Prompt: make([]int32, 1+rng.IntN(20)), MaxTokens: 1 + rng.IntN(maxTokens), Sampling: stage.Sampling{Seed: rng.Uint64()}}
		for j := range r.Prompt {
			r.Prompt[j] = rng.Int32N(int32(vocab))
		}
		if i%3 == 0 {
			r.StopTokens = []int32{rng.Int32N(int32(vocab))}
		}
		s, err := l.Submit(context.Background(), r)
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() {
			var got []int32
			for {
				o, err := s.Recv(context.Background())
				if err == io.EOF {
					break
				}
				if err != nil {
					t.Errorf("request %d: %v", i, err)
					return
				}
				got = append(got, o.Token.Token)
			}
			if want := hashAlone(p, vocab, &r); !slices.Equal(got, want) {
				t.Errorf("request %d: %v, want %v (alone)", i, got, want)
			}
		})
	}
	wg.Wait()
}

// hashAlone is r's output from a pipeline of p hash stages run by itself,
// computed directly.
func hashAlone(p, vocab int, r *sched.Request) []int32 {
	h := make([]uint64, p)
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
	var out []int32
	for i := 0; ; i++ {
		t := hashSample(h[p-1], r.Sampling.Seed, i, vocab)
		out = append(out, t)
		if slices.Contains(r.StopTokens, t) || len(out) == r.MaxTokens {
			return out
		}
		feed(t)
	}
}

// TestLocalHandoff drives local pipelines of 1 to 3 hash stages with
// hand-off through sched.Loop, with one more step in flight than stages,
// and checks that every request's tokens are those it produces alone and
// that placeholders were filled on the first stage.
func TestLocalHandoff(t *testing.T) {
	const vocab = 50
	for p := 1; p <= 3; p++ {
		t.Run(fmt.Sprintf("stages=%d", p), func(t *testing.T) {
			var stages []stage.Stage
			for k := range p {
				stages = append(stages, newHashStage(k == 0, k == p-1, vocab, 50*time.Microsecond))
			}
			d, err := pipeline.LocalOptions{Handoff: true}.Start(context.Background(), stages)
			if err != nil {
				t.Fatal(err)
			}
			defer d.Close()
			l, err := sched.Start(sched.Config{MaxNumBatchedTokens: 24, MaxNumSeqs: hashMaxSeqs, BlockSize: 4, NumBlocks: 256,
				MaxConcurrentBatches: p + 1, OnDeviceHandoff: true}, d)
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			checkAlone(t, l, p, vocab, rand.New(rand.NewPCG(uint64(p), 7)), 24, 16)
			st := l.Stats()
			t.Logf("%d steps, %d tokens discarded, %d placeholders", st.Steps, st.Discarded, stages[0].(*hashStage).placeholds)
			if stages[0].(*hashStage).placeholds == 0 {
				t.Error("no placeholder reached the first stage")
			}
		})
	}
}

// TestWorkerHandoffErrors checks that a worker fails, naming the cause,
// when its hand-off wiring or the steps do not fit: a link on the wrong
// stage, a hand-off step without a link, a step awaiting more hand-offs
// than have run, and a stage whose hand-off does not match the batch.
func TestWorkerHandoffErrors(t *testing.T) {
	handoffStep := func(id uint64, await int) *pipeline.Step {
		return &pipeline.Step{AwaitHandoff: await, Batch: stage.Batch{ID: id, Handoff: true,
			Seqs: []stage.Seq{{ID: 1, Pos: int(id - 1), Tokens: []int32{3}, Sample: true}}}}
	}
	ring := func() (collective.Sender, collective.Receiver) { return collective.Pipe(4) }
	for _, tc := range []struct {
		name  string
		first bool
		last  bool
		wire  func(w *pipeline.Worker)
		steps []*pipeline.Step
		want  string
	}{
		{"link in on the last stage", false, true, func(w *pipeline.Worker) { _, w.HandoffIn = ring() }, nil, "hand-off link belongs"},
		{"link out on the first stage", true, false, func(w *pipeline.Worker) { w.HandoffOut, _ = ring() }, nil, "hand-off link belongs"},
		{"links on a single stage", true, true, func(w *pipeline.Worker) { w.HandoffOut, w.HandoffIn = ring() }, nil, "hand-off link belongs"},
		{"first stage without a link", true, false, func(*pipeline.Worker) {}, []*pipeline.Step{handoffStep(1, 0)}, "no hand-off link in"},
		{"last stage without a link", false, true, func(*pipeline.Worker) {}, []*pipeline.Step{handoffStep(1, 0)}, "no hand-off link out"},
		{"last stage's hand-off not the batch's", false, true, func(w *pipeline.Worker) {
			w.HandoffOut, _ = ring()
			w.Stage.(*hashStage).skew = 1
		}, []*pipeline.Step{handoffStep(1, 0)}, "stage hand-off batch 1 [2x2 i32] (buffer collective.Host), want batch 1 [1x2 i32]"},
		{"single stage's hand-off not the batch's", true, true, func(w *pipeline.Worker) { w.Stage.(*hashStage).skew = -1 },
			[]*pipeline.Step{handoffStep(1, 0)}, "stage hand-off batch 1 [0x2 i32]"},
		{"awaiting a step not run", true, false, func(w *pipeline.Worker) { _, w.HandoffIn = ring() },
			[]*pipeline.Step{handoffStep(1, 1)}, "awaits 1 hand-offs, but only 0 hand-off steps have run"},
		{"a single stage awaiting a step not run", true, true, func(*pipeline.Worker) {},
			[]*pipeline.Step{handoffStep(1, 0), handoffStep(2, 2)}, "awaits 2 hand-offs"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := newHashStage(tc.first, tc.last, 50, 0)
			ctl := &scriptedControl{steps: tc.steps}
			w := &pipeline.Worker{Stage: st, Ctl: ctl}
			if !tc.first {
				prev, recv := collective.Pipe(8)
				w.Prev = recv
				for _, s := range tc.steps {
					h := collective.Header{Batch: s.Batch.ID, Rows: s.Batch.NumTokens(), Cols: 2, DType: collective.F32}
					if err := prev.Send(context.Background(), h, make(collective.Host, h.Bytes())); err != nil {
						t.Fatal(err)
					}
				}
			}
			if !tc.last {
				w.Next, _ = collective.Pipe(8)
			}
			tc.wire(w)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			err := w.Serve(ctx)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Serve: %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

// TestWorkerHandoffOrder runs a first stage over a ring fed by hand: a
// step that awaits two hand-offs applies both, in order, so its
// placeholder takes the newer token of its slot; a message for another
// batch than the one expected next is an error.
func TestWorkerHandoffOrder(t *testing.T) {
	row := func(slot, tok int32) collective.Host {
		b := make(collective.Host, 8)
		binary.LittleEndian.PutUint32(b, uint32(slot))
		binary.LittleEndian.PutUint32(b[4:], uint32(tok))
		return b
	}
	steps := func() []*pipeline.Step {
		return []*pipeline.Step{
			{Batch: stage.Batch{ID: 1, Handoff: true, Seqs: []stage.Seq{{ID: 1, Tokens: []int32{4}, Sample: true, Slot: 2}}}},
			{Batch: stage.Batch{ID: 2, Handoff: true, Seqs: []stage.Seq{{ID: 1, Pos: 1, Tokens: []int32{stage.Placeholder}, Sample: true, Slot: 2}}}},
			{AwaitHandoff: 2, Batch: stage.Batch{ID: 3, Seqs: []stage.Seq{{ID: 1, Pos: 2, Tokens: []int32{stage.Placeholder}, Sample: true, Slot: 2}}}},
		}
	}
	// Step 2's placeholder is never filled in this test: the stage would
	// refuse it, so slot 2 starts with a token.
	for _, tc := range []struct {
		name    string
		batches []uint64 // the messages sent on the ring, in order
		want    string   // the error, or "" for success
	}{
		{"in order", []uint64{1, 2}, ""},
		{"out of order", []uint64{2, 1}, "batch 2, want 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := newHashStage(true, false, 50, 0)
			st.slotTok[2], st.slotSet[2] = 9, true
			out, in := collective.Pipe(4)
			next, acts := collective.Pipe(4)
			ctl := &scriptedControl{steps: steps()}
			w := &pipeline.Worker{Stage: st, Ctl: ctl, Next: next, HandoffIn: in}
			for i, b := range tc.batches {
				if err := out.Send(context.Background(), collective.Header{Batch: b, Rows: 1, Cols: 2, DType: collective.I32}, row(2, int32(20+i))); err != nil {
					t.Fatal(err)
				}
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			err := w.Serve(ctx)
			if tc.want != "" {
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Errorf("Serve: %v, want an error containing %q", err, tc.want)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			// Step 3's input is the token of batch 2's message (21): its
			// activation is mix(state at position 1, 21).
			buf := make(collective.Host, 8)
			var prev uint64
			for b := uint64(1); b <= 3; b++ {
				if err := acts.Recv(context.Background(), collective.Header{Batch: b, Rows: 1, Cols: 2, DType: collective.F32}, buf); err != nil {
					t.Fatal(err)
				}
				if b == 3 {
					if got, want := binary.LittleEndian.Uint64(buf), mix(prev, 21); got != want {
						t.Errorf("step 3 ran on state %x, want %x (token 21, the newer of slot 2)", got, want)
					}
				}
				prev = binary.LittleEndian.Uint64(buf)
			}
		})
	}
}

// TestTCPHandoff wires two hash stages as separate processes would: control
// over TCP (ListenControl, DialLink), activations and the hand-off ring over
// collective TCP links (the last stage dials a listener of the first), and
// drives them through sched.Loop with hand-off and three steps in flight.
// Every request's tokens must be those it produces alone.
func TestTCPHandoff(t *testing.T) {
	const vocab = 50
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	stages := []*hashStage{newHashStage(true, false, vocab, 0), newHashStage(false, true, vocab, 0)}
	workers := []*pipeline.Worker{{Index: 0, Stage: stages[0]}, {Index: 1, Stage: stages[1]}}
	listen := func() *collective.Listener {
		ln, err := collective.Listen("127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ln.Close() })
		return ln
	}
	// Activations 0 → 1, and the ring 1 → 0.
	for _, l := range []struct {
		from, to int
		ring     bool
	}{{0, 1, false}, {1, 0, true}} {
		ln := listen()
		accepted := make(chan collective.Receiver, 1)
		go func() {
			recv, err := ln.Accept(ctx)
			if err != nil {
				t.Error(err)
			}
			accepted <- recv
		}()
		send, err := collective.Dial(ctx, ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		recv := <-accepted
		if recv == nil {
			t.FailNow()
		}
		if l.ring {
			workers[l.from].HandoffOut, workers[l.to].HandoffIn = send, recv
		} else {
			workers[l.from].Next, workers[l.to].Prev = send, recv
		}
	}
	var links []pipeline.Link
	served := make(chan error, len(workers))
	for _, w := range workers {
		cl, err := pipeline.ListenControl("127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer cl.Close()
		accepted := make(chan *pipeline.NetControl, 1)
		go func() {
			nc, err := cl.Accept(ctx)
			if err != nil {
				t.Error(err)
			}
			accepted <- nc
		}()
		link, err := pipeline.DialLink(ctx, cl.Addr())
		if err != nil {
			t.Fatal(err)
		}
		nc := <-accepted
		if nc == nil {
			t.FailNow()
		}
		w.Ctl = nc
		links = append(links, link)
		go func() {
			err := w.Serve(ctx)
			// As a stage process does: hang up on the leader, close the
			// data links.
			for _, c := range []io.Closer{nc, w.Prev, w.Next, w.HandoffIn, w.HandoffOut} {
				if c != nil {
					c.Close()
				}
			}
			served <- err
		}()
	}
	d, err := pipeline.NewDriver(links)
	if err != nil {
		t.Fatal(err)
	}
	l, err := sched.Start(sched.Config{MaxNumBatchedTokens: 24, MaxNumSeqs: hashMaxSeqs, BlockSize: 4, NumBlocks: 256,
		MaxConcurrentBatches: 3, OnDeviceHandoff: true}, d)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for i := range 12 {
		r := sched.Request{Prompt: []int32{int32(i), 3, int32(2 * i % vocab)}, MaxTokens: 5 + i, Sampling: stage.Sampling{Seed: uint64(i)}}
		s, err := l.Submit(ctx, r)
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() {
			var got []int32
			for {
				o, err := s.Recv(ctx)
				if err == io.EOF {
					break
				}
				if err != nil {
					t.Errorf("request %d: %v", i, err)
					return
				}
				got = append(got, o.Token.Token)
			}
			if want := hashAlone(2, vocab, &r); !slices.Equal(got, want) {
				t.Errorf("request %d: %v, want %v (alone)", i, got, want)
			}
		})
	}
	wg.Wait()
	l.Close()
	if err := d.Close(); err != nil {
		t.Error(err)
	}
	for range workers {
		if err := <-served; err != nil {
			t.Errorf("worker: %v", err)
		}
	}
	if stages[0].placeholds == 0 {
		t.Error("no placeholder reached the first stage")
	}
}
