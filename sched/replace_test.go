package sched_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/tandem-llm/tandem/pipeline"
	"github.com/tandem-llm/tandem/sched"
	"github.com/tandem-llm/tandem/stage"
)

// errBroken is the failure of a breakable pipeline.
var errBroken = errors.New("stage 1: link lost")

// breakable is a fake pipeline that can be made to fail, as a pipeline
// whose stage died: Submit and Wait fail from then on.
type breakable struct {
	*fakePipe
	broken context.Context
	breaks context.CancelFunc
}

func newBreakable(c fakePipeConfig) *breakable {
	b := &breakable{fakePipe: newFakePipe(c)}
	b.broken, b.breaks = context.WithCancel(context.Background())
	return b
}

func (b *breakable) Submit(ctx context.Context, s *pipeline.Step) error {
	if b.broken.Err() != nil {
		return errBroken
	}
	return b.fakePipe.Submit(ctx, s)
}

func (b *breakable) Wait(ctx context.Context) (*pipeline.Result, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(b.broken, cancel)
	defer stop()
	r, err := b.fakePipe.Wait(ctx)
	if b.broken.Err() != nil {
		return nil, errBroken
	}
	return r, err
}

// abandon stops a pipeline the scheduler has left: its stages end once
// they have run what they were sent; their caches are dropped unchecked.
func (b *breakable) abandon() {
	b.breaks()
	close(b.in[0])
	for range b.results {
	}
	b.wg.Wait()
}

// TestLoopSurvivesPipelines runs a random workload through a Loop with
// OnFailure whose pipeline fails at random times (a stage died: the loop
// reports it and parks the requests until the test, standing in for the
// supervisor, brings a new pipeline after a random outage) or is replaced
// while healthy (the layers moved). Each new pipeline is a fresh fake
// pipeline with empty caches and its own KV capacity, steps in flight and
// hand-off. Every request must finish with exactly the tokens it produces
// alone, each delivered once and in order, nothing held at the end.
func TestLoopSurvivesPipelines(t *testing.T) {
	seeds := 12
	if testing.Short() {
		seeds = 4
	}
	for seed := range uint64(seeds) {
		t.Run(fmt.Sprintf("seed=%d", seed+1), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) { survivePipelines(t, seed+1) })
		})
	}
}

func survivePipelines(t *testing.T, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 3))
	const stages, requests = 3, 120
	model := fakeModel{stages: stages, vocab: vocab}
	// Each pipeline draws its own configuration; the block size and
	// sequence limit stay, as the daemon's configuration fixes them.
	blockSize, maxSeqs := []int{1, 4, 16}[rng.IntN(3)], 2+rng.IntN(12)
	need := (maxPrompt + maxGen - 1 + blockSize - 1) / blockSize
	newPipe := func(rng *rand.Rand) (sched.Config, *breakable) {
		cfg := sched.Config{
			MaxNumBatchedTokens: 8 + rng.IntN(64), MaxNumSeqs: maxSeqs, BlockSize: blockSize,
			NumBlocks: need + rng.IntN(2*need), OnDeviceHandoff: rng.IntN(2) == 0,
		}
		cfg.MaxConcurrentBatches = 1 + rng.IntN(stages+1)
		return cfg, newBreakable(fakePipeConfig{
			model: model, numBlocks: cfg.NumBlocks, blockSize: blockSize, maxSeqs: maxSeqs, maxConcurrent: cfg.MaxConcurrentBatches,
			latency: func(k int, b *stage.Batch) time.Duration {
				return time.Millisecond + 20*time.Microsecond*time.Duration(b.NumTokens())
			},
		})
	}
	failures := make(chan sched.Executor, 1)
	cfg, cur := newPipe(rng)
	// The supervisor draws from its own generator.
	srng := rand.New(rand.NewPCG(seed, 4))
	l, err := sched.LoopOptions{OnFailure: func(ex sched.Executor, err error) {
		if !errors.Is(err, errBroken) {
			t.Errorf("failure %v, want the pipeline's", err)
		}
		failures <- ex
	}}.Start(cfg, cur)
	if err != nil {
		t.Fatal(err)
	}
	// The supervisor: it breaks the pipeline or replaces it at random
	// times until the requests are done; after a break it waits for the
	// failure, then brings the next pipeline after an outage.
	done := make(chan struct{})
	var checked []*breakable
	var sup sync.WaitGroup
	breaks, moves := 0, 0
	sup.Go(func() {
		for {
			select {
			case <-done:
				return
			case <-time.After(time.Duration(50+srng.IntN(400)) * time.Millisecond):
			}
			old := cur
			if srng.IntN(3) > 0 {
				breaks++
				old.breaks()
				if ex := <-failures; ex != sched.Executor(old) {
					t.Errorf("failure of %p, want the pipeline %p", ex, old)
				}
				time.Sleep(time.Duration(srng.IntN(300)) * time.Millisecond)
			} else {
				moves++
			}
			var next *breakable
			cfg, next = newPipe(srng)
			if err := l.Replace(cfg, next); err != nil {
				t.Errorf("replace: %v", err)
			}
			cur = next
			old.abandon()
			checked = append(checked, old)
		}
	})
	results := make([]reqResult, requests)
	var wg sync.WaitGroup
	for i := range results {
		r := &results[i]
		r.req = sched.Request{Prompt: make([]int32, 1+rng.IntN(maxPrompt)), MaxTokens: 1 + rng.IntN(maxGen), Sampling: stage.Sampling{Seed: rng.Uint64()}}
		for j := range r.req.Prompt {
			r.req.Prompt[j] = rng.Int32N(vocab)
		}
		arrive := time.Duration(rng.Int64N(int64(3 * time.Second)))
		wg.Go(func() {
			time.Sleep(arrive)
			s, err := l.Submit(context.Background(), r.req)
			if err != nil {
				r.err = err
				return
			}
			for {
				o, err := s.Recv(context.Background())
				if err != nil {
					r.err = err
					return
				}
				if o.Index != len(r.got) || o.ID != s.ID() {
					r.err = fmt.Errorf("output %+v after %d tokens of request %d", o, len(r.got), s.ID())
					return
				}
				r.got = append(r.got, o.Token.Token)
				r.finish = o.Finish
			}
		})
	}
	wg.Wait()
	close(done)
	sup.Wait()
	time.Sleep(time.Second) // the steps still in flight come back
	synctest.Wait()
	st := l.Stats()
	l.Close()
	cur.abandon()
	checked = append(checked, cur)
	for _, b := range checked {
		for _, err := range b.Errs() {
			t.Error(err)
		}
	}
	for i, r := range results {
		want, finish := model.alone(&r.req)
		if r.err != io.EOF || !slices.Equal(r.got, want) || r.finish != finish {
			t.Errorf("request %d: %v finish %q (%v), want %v finish %q (alone)", i, r.got, r.finish, r.err, want, finish)
		}
	}
	if st.Running+st.Waiting+st.InFlight+st.KVBlocksUsed != 0 || st.Finished != requests {
		t.Errorf("after every request: %+v, want %d finished, nothing running, waiting, in flight or held", st, requests)
	}
	t.Logf("%d requests over %d pipelines (%d broke, %d replaced healthy): %d re-prefilled, %d steps, %d preemptions", requests, breaks+moves+1, breaks, moves, st.Reprefilled, st.Steps, st.Preemptions)
}

// TestLoopFailAll checks that FailAll ends every request, waiting or
// running, with the reason given, while the loop goes on: a request
// submitted after it is served once a pipeline is there.
func TestLoopFailAll(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		model := fakeModel{stages: 2, vocab: 50}
		cfg := sched.Config{MaxNumBatchedTokens: 16, MaxNumSeqs: 4, BlockSize: 4, NumBlocks: 16, MaxConcurrentBatches: 2}
		pipe := func() *breakable {
			return newBreakable(fakePipeConfig{model: model, numBlocks: 16, blockSize: 4, maxSeqs: 4, maxConcurrent: 2, latency: fixedLatency(time.Millisecond)})
		}
		first := pipe()
		failed := make(chan error, 1)
		l, err := sched.LoopOptions{OnFailure: func(_ sched.Executor, err error) { failed <- err }}.Start(cfg, first)
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		var streams []*sched.Stream
		for i := range 3 {
			s, err := l.Submit(context.Background(), sched.Request{Prompt: []int32{int32(i), 7}, MaxTokens: 40})
			if err != nil {
				t.Fatal(err)
			}
			streams = append(streams, s)
		}
		if _, err := streams[0].Recv(context.Background()); err != nil {
			t.Fatal(err)
		}
		first.breaks()
		<-failed
		first.abandon()
		// Parked: a request still queues.
		late, err := l.Submit(context.Background(), sched.Request{Prompt: []int32{9}, MaxTokens: 2})
		if err != nil {
			t.Fatal(err)
		}
		reason := errors.New("no pipeline within 60s: stage node s2 is dead")
		if err := l.FailAll(reason); err != nil {
			t.Fatal(err)
		}
		for i, s := range append(streams, late) {
			if _, _, err := recvAll(s); !errors.Is(err, reason) {
				t.Errorf("stream %d ended with %v, want the reason", i, err)
			}
		}
		if st := l.Stats(); st.Failed != 4 || st.Running+st.Waiting+st.KVBlocksUsed != 0 {
			t.Errorf("stats after FailAll: %+v, want 4 failed and nothing left", st)
		}
		next := pipe()
		if err := l.Replace(cfg, next); err != nil {
			t.Fatal(err)
		}
		r := sched.Request{Prompt: []int32{4, 5}, MaxTokens: 3}
		s, err := l.Submit(context.Background(), r)
		if err != nil {
			t.Fatal(err)
		}
		toks, _, err := recvAll(s)
		if want, _ := model.alone(&r); err != io.EOF || !slices.Equal(toks, want) {
			t.Errorf("after FailAll and a new pipeline: %v %v, want %v", toks, err, want)
		}
		if err := l.Replace(sched.Config{}, nil); err == nil {
			t.Error("replace with an invalid config: no error")
		}
		l.Close()
		next.abandon()
		if err := l.FailAll(reason); err == nil {
			t.Error("FailAll after Close: no error")
		}
	})
}
