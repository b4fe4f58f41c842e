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

	"github.com/tandem-llm/tandem/sched"
	"github.com/tandem-llm/tandem/stage"
)

// workload is a randomized run of the Loop over a fake pipeline.
type workload struct {
	seed     uint64
	cfg      sched.Config
	stages   int
	requests int
}

// randomWorkload draws a configuration: 1 to 4 stages, 1 to stages+1
// steps in flight, with or without hand-off, block sizes from 1 to 16, a
// random token budget and sequence limit, and a KV capacity from just
// enough for the longest request to twice that, so preemption is frequent.
func randomWorkload(seed uint64, requests int) workload {
	rng := rand.New(rand.NewPCG(seed, 1))
	w := workload{seed: seed, stages: 1 + rng.IntN(4), requests: requests}
	w.cfg = sched.Config{
		MaxNumBatchedTokens: 1 + rng.IntN(64),
		MaxNumSeqs:          1 + rng.IntN(24),
		BlockSize:           []int{1, 2, 3, 4, 16}[rng.IntN(5)],
		OnDeviceHandoff:     rng.IntN(2) == 0,
	}
	w.cfg.MaxConcurrentBatches = 1 + rng.IntN(w.stages+1)
	need := (maxPrompt + maxGen - 1 + w.cfg.BlockSize - 1) / w.cfg.BlockSize
	w.cfg.NumBlocks = need + rng.IntN(need+1)
	return w
}

const (
	maxPrompt = 48
	maxGen    = 24
	vocab     = 40
)

// repeatStop reports two equal tokens in a row at the end of g: a stand-in
// for a stop string, which the reader (as the request frontend does) sees
// and answers by cancelling the request.
func repeatStop(g []int32) bool { return len(g) >= 2 && g[len(g)-1] == g[len(g)-2] }

// TestRandomWorkload drives hundreds of concurrent requests with random
// prompt and output lengths, arrival times, stop tokens, stop checks by
// the reader and cancellations through the Loop and a fake pipeline with per-stage
// latency, under random scheduler settings. Every request must end
// finished (its tokens exactly those it produces alone) or cancelled (a
// prefix of them), each token delivered once and in order, with no KV
// block left held on the scheduler or any stage, and every goroutine
// stopped (synctest fails otherwise).
func TestRandomWorkload(t *testing.T) {
	seeds, requests := 24, 300
	if testing.Short() {
		seeds, requests = 8, 150
	}
	for seed := range uint64(seeds) {
		w := randomWorkload(seed+1, requests)
		t.Run(fmt.Sprintf("seed=%d", w.seed), func(t *testing.T) {
			t.Logf("%d stages, %+v", w.stages, w.cfg)
			synctest.Test(t, func(t *testing.T) { w.run(t) })
		})
	}
}

type reqResult struct {
	req    sched.Request
	got    []int32
	err    error // io.EOF: finished
	finish string
	cancel bool
	// stopCheck: the reader cancels the request on repeatStop; stopped
	// when it did.
	stopCheck, stopped bool
}

func (w workload) run(t *testing.T) {
	rng := rand.New(rand.NewPCG(w.seed, 2))
	model := fakeModel{stages: w.stages, vocab: vocab}
	fp := newFakePipe(fakePipeConfig{
		model: model, numBlocks: w.cfg.NumBlocks, blockSize: w.cfg.BlockSize,
		maxSeqs: w.cfg.MaxNumSeqs, maxConcurrent: w.cfg.MaxConcurrentBatches,
		latency: func(k int, b *stage.Batch) time.Duration {
			return time.Millisecond*time.Duration(1+k%3) + 20*time.Microsecond*time.Duration(b.NumTokens())
		},
	})
	l, err := sched.Start(w.cfg, fp)
	if err != nil {
		t.Fatal(err)
	}
	results := make([]reqResult, w.requests)
	var wg sync.WaitGroup
	for i := range results {
		r := &results[i]
		r.req = sched.Request{
			Prompt:    make([]int32, 1+rng.IntN(maxPrompt)),
			MaxTokens: 1 + rng.IntN(maxGen),
			Sampling:  stage.Sampling{Seed: rng.Uint64()},
		}
		for j := range r.req.Prompt {
			r.req.Prompt[j] = rng.Int32N(vocab)
		}
		if rng.IntN(2) == 0 {
			r.req.StopTokens = []int32{rng.Int32N(vocab)}
		}
		r.stopCheck = rng.IntN(4) == 0
		arrive := time.Duration(rng.Int64N(int64(2 * time.Second)))
		var cancelAfter time.Duration
		if rng.IntN(8) == 0 {
			r.cancel = true
			cancelAfter = time.Duration(rng.Int64N(int64(time.Second)))
		}
		wg.Go(func() {
			time.Sleep(arrive)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if r.cancel {
				time.AfterFunc(cancelAfter, cancel)
			}
			s, err := l.Submit(ctx, r.req)
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
				if r.stopCheck && o.Finish == "" && repeatStop(r.got) {
					cancel()
					r.stopped = true
					return
				}
			}
		})
	}
	wg.Wait()
	// Let the steps still in flight (placeholders past a stop) come back
	// and the loop send the last frees.
	time.Sleep(time.Second)
	synctest.Wait()
	st := l.Stats()
	if err := l.Close(); err != nil {
		t.Error(err)
	}
	fp.Close()
	for _, err := range fp.Errs() {
		t.Error(err)
	}
	if err := l.Err(); !errors.Is(err, sched.ErrClosed) {
		t.Errorf("loop stopped with %v, want ErrClosed", err)
	}
	finished, cancelled, stopped := 0, 0, 0
	for i, r := range results {
		want, finish := model.alone(&r.req)
		switch {
		case r.stopped:
			stopped++
			n := len(r.got)
			if n >= len(want) || !slices.Equal(r.got, want[:n]) {
				t.Errorf("request %d stopped by its reader: %v, want a strict prefix of %v", i, r.got, want)
			}
			for k := 2; k < n; k++ {
				if repeatStop(r.got[:k]) {
					t.Errorf("request %d stopped by its reader at %d tokens, but %v repeats first at %d", i, n, r.got, k)
					break
				}
			}
		case r.err == io.EOF:
			finished++
			if !slices.Equal(r.got, want) || r.finish != finish {
				t.Errorf("request %d: %v finish %q, want %v finish %q (alone)", i, r.got, r.finish, want, finish)
			}
		case r.cancel && errors.Is(r.err, context.Canceled):
			cancelled++
			if len(r.got) >= len(want) || !slices.Equal(r.got, want[:len(r.got)]) {
				t.Errorf("cancelled request %d: %v, want a strict prefix of %v", i, r.got, want)
			}
		default:
			t.Errorf("request %d (cancel %v) ended with %v", i, r.cancel, r.err)
		}
	}
	if st.Running != 0 || st.Waiting != 0 || st.InFlight != 0 || st.KVBlocksUsed != 0 {
		t.Errorf("after every request: %+v, want nothing running, waiting, in flight or held", st)
	}
	// A request its reader stopped may have finished in the scheduler
	// before the cancellation reached it.
	if int(st.Finished) < finished || int(st.Finished) > finished+stopped || int(st.Cancelled) > cancelled+stopped || int(st.Finished+st.Cancelled) < finished+stopped {
		t.Errorf("stats count %d finished, %d cancelled; the streams %d finished, %d cancelled, %d stopped by their reader", st.Finished, st.Cancelled, finished, cancelled, stopped)
	}
	t.Logf("%d finished, %d cancelled, %d stopped by their reader, %d steps, %d preemptions, %d tokens discarded", finished, cancelled, stopped, st.Steps, st.Preemptions, st.Discarded)
}
