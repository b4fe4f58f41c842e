package sched_test

import (
	"context"
	"errors"
	"io"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/tandem-llm/tandem/pipeline"
	"github.com/tandem-llm/tandem/sched"
	"github.com/tandem-llm/tandem/stage"
)

// TestKVPressureNoThrash runs the KV-pressure workload (16 requests
// of 1,500 positions at concurrency 16, a KV cache of 5 of them) in
// simulated time: it must finish within 1.3 times the best fixed
// concurrency's time, and no request may be preempted more than once
// (before admission kept headroom: 504 preemptions, one request preempted
// 134 times, 7.9 times the best fixed concurrency's time).
func TestKVPressureNoThrash(t *testing.T) {
	w := kvPressure
	best, bestC := time.Duration(1<<62), 0
	for c := 1; c <= 16; c++ {
		if r := simulateKV(t, w, c, func(cfg *sched.Config) { cfg.MaxNumSeqs = c }); r.elapsed < best {
			best, bestC = r.elapsed, c
		}
	}
	r := simulateKV(t, w, 16, nil)
	ratio := r.elapsed.Seconds() / best.Seconds()
	t.Logf("concurrency 16: %.3f simulated s, %d preemptions (at most %d of one request), %d positions recomputed, %d running at most; best fixed concurrency %d: %.3f s; ratio %.3f",
		r.elapsed.Seconds(), r.preemptions, r.maxPreempted, r.recomputedPos, r.peakRunning, bestC, best.Seconds(), ratio)
	if ratio > 1.3 {
		t.Errorf("concurrency 16 takes %.2f times the best fixed concurrency's time, want at most 1.3", ratio)
	}
	if r.maxPreempted > 1 {
		t.Errorf("a request was preempted %d times, want at most once", r.maxPreempted)
	}
}

// TestAdmissionLearnsLengths: requests that stop long before their
// MaxTokens (150 of 1,436 tokens) are admitted conservatively at first, as
// if they ran to MaxTokens (4 fit), and then, as finished ones show how
// short they are, many more at once: all 16 clients' requests run
// together, with few preemptions and none of a request twice.
func TestAdmissionLearnsLengths(t *testing.T) {
	w := kvPressure
	w.requests, w.stopAfter = 96, 150
	r := simulateKV(t, w, 16, nil)
	t.Logf("%d requests stopping after %d tokens: %.3f simulated s, %d running at most, %d preemptions (at most %d of one request)",
		w.requests, w.stopAfter, r.elapsed.Seconds(), r.peakRunning, r.preemptions, r.maxPreempted)
	if r.peakRunning < 16 || r.maxPreempted > 1 {
		t.Errorf("%d running at most, a request preempted %d times; want all 16 running at once and at most 1 preemption each", r.peakRunning, r.maxPreempted)
	}
}

// TestQueueBound: past MaxNumWaiting waiting requests Submit fails with
// ErrQueueFull, and takes requests again once the queue drains; the
// scheduler counts the refusals.
func TestQueueBound(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		fp := newFakePipe(fakePipeConfig{model: fakeModel{stages: 1, vocab: 50}, numBlocks: 64, blockSize: 4, maxSeqs: 2, maxConcurrent: 1, latency: fixedLatency(time.Millisecond)})
		defer fp.Close()
		l, err := sched.Start(sched.Config{MaxNumBatchedTokens: 64, MaxNumSeqs: 2, BlockSize: 4, NumBlocks: 64, MaxNumWaiting: 3}, fp)
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		ctx := context.Background()
		var streams []*sched.Stream
		refused := 0
		for range 10 {
			s, err := l.Submit(ctx, sched.Request{Prompt: []int32{1, 2}, MaxTokens: 4})
			switch {
			case errors.Is(err, sched.ErrQueueFull):
				refused++
			case err != nil:
				t.Fatal(err)
			default:
				streams = append(streams, s)
			}
		}
		// The first is admitted into the one step in flight; no time
		// passes before the others (synctest), so 3 wait and 6 are refused.
		if len(streams) != 4 || refused != 6 {
			t.Fatalf("%d accepted, %d refused; want 4 and 6", len(streams), refused)
		}
		for _, s := range streams {
			if toks, _, err := recvAll(s); err != io.EOF || len(toks) != 4 {
				t.Errorf("request %d: %d tokens, %v", s.ID(), len(toks), err)
			}
		}
		if _, err := l.Submit(ctx, sched.Request{Prompt: []int32{1}, MaxTokens: 1}); err != nil {
			t.Errorf("after the queue drained: %v", err)
		}
		if st := l.Stats(); st.Refused != 6 {
			t.Errorf("stats count %d refusals, want 6", st.Refused)
		}
	})
}

// failingExec is an Executor that samples token 7 for every sequence but
// one, whose sample fails as a stage does on non-finite logits.
type failingExec struct {
	bad   uint64
	steps chan *pipeline.Step
}

func (x failingExec) Submit(ctx context.Context, s *pipeline.Step) error {
	if len(s.Batch.Seqs) > 0 {
		x.steps <- s
	}
	return nil
}

func (x failingExec) Wait(ctx context.Context) (*pipeline.Result, error) {
	s := <-x.steps
	r := &pipeline.Result{Batch: s.Batch.ID, Stage: 2}
	for _, q := range s.Batch.Seqs {
		if q.Sample {
			smp := stage.Sampled{Seq: q.ID, Token: 7}
			if q.ID == x.bad {
				smp = stage.Sampled{Seq: q.ID, Err: "cpu stage [4,6): sequence 2: non-finite logits"}
			}
			r.Sampled = append(r.Sampled, smp)
		}
	}
	return r, nil
}

// TestRequestFailsAlone: a sample a stage could not draw ends that request
// with an error wrapping ErrRequestFailed and naming the stage, while the
// others of the same steps finish.
func TestRequestFailsAlone(t *testing.T) {
	x := failingExec{bad: 2, steps: make(chan *pipeline.Step, 4)}
	l, err := sched.Start(sched.Config{MaxNumBatchedTokens: 64, MaxNumSeqs: 4, NumBlocks: 64}, x)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	var streams []*sched.Stream
	for range 3 {
		s, err := l.Submit(context.Background(), sched.Request{Prompt: []int32{1, 2, 3}, MaxTokens: 5})
		if err != nil {
			t.Fatal(err)
		}
		streams = append(streams, s)
	}
	for _, s := range streams {
		toks, _, err := recvAll(s)
		if s.ID() == x.bad {
			if !errors.Is(err, sched.ErrRequestFailed) || !strings.Contains(err.Error(), "stage 2: cpu stage [4,6)") || len(toks) != 0 {
				t.Errorf("request %d: tokens %v, error %v; want none and ErrRequestFailed naming the stage", s.ID(), toks, err)
			}
			continue
		}
		if err != io.EOF || len(toks) != 5 {
			t.Errorf("request %d next to the failed one: %d tokens, %v", s.ID(), len(toks), err)
		}
	}
	if st := l.Stats(); st.Failed != 1 || st.Finished != 2 {
		t.Errorf("stats: %d failed, %d finished; want 1 and 2", st.Failed, st.Finished)
	}
}
