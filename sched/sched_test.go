package sched_test

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tandem-llm/tandem/pipeline"
	"github.com/tandem-llm/tandem/sched"
	"github.com/tandem-llm/tandem/stage"
)

func TestConfigDefaults(t *testing.T) {
	sc, err := sched.New(sched.Config{MaxNumBatchedTokens: 8, MaxNumSeqs: 2, NumBlocks: 4}, nil)
	if err != nil {
		t.Fatal(err)
	}
	c := sc.Config()
	if c.BlockSize != sched.DefaultBlockSize || c.MaxConcurrentBatches != 1 {
		t.Errorf("defaults: block size %d, concurrent batches %d; want %d and 1", c.BlockSize, c.MaxConcurrentBatches, sched.DefaultBlockSize)
	}
	if st := sc.Stats(); st.KVBlocks != 4 || st.BlockSize != 16 || st.KVBlocksUsed != 0 {
		t.Errorf("stats of a new scheduler: %+v", st)
	}
}

// TestCompleteRejectsMismatch checks that a result that does not match the
// oldest step in flight is an error and changes nothing: the right result
// is still taken afterwards.
func TestCompleteRejectsMismatch(t *testing.T) {
	for _, tc := range []struct {
		name string
		edit func(r *pipeline.Result)
		want string
	}{
		{"other batch", func(r *pipeline.Result) { r.Batch++ }, "oldest batch in flight is 1"},
		{"stage failure", func(r *pipeline.Result) { r.Stage, r.Err = 1, "boom" }, "stage 1 failed: boom"},
		{"missing sample", func(r *pipeline.Result) { r.Sampled = r.Sampled[:1] }, "sample 1 is not of sequence 2"},
		{"extra sample", func(r *pipeline.Result) { r.Sampled = append(r.Sampled, stage.Sampled{Seq: 9}) }, "3 samples, want 2"},
		{"other sequence", func(r *pipeline.Result) { r.Sampled[0].Seq = 2 }, "sample 0 is not of sequence 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sc, err := sched.New(sched.Config{MaxNumBatchedTokens: 8, MaxNumSeqs: 2, NumBlocks: 4}, nil)
			if err != nil {
				t.Fatal(err)
			}
			for id := uint64(1); id <= 2; id++ {
				if err := sc.Add(sched.Request{ID: id, Prompt: []int32{1, 2}, MaxTokens: 1}); err != nil {
					t.Fatal(err)
				}
			}
			st, ok := sc.Schedule()
			if !ok {
				t.Fatal("nothing scheduled")
			}
			good := func() *pipeline.Result {
				return &pipeline.Result{Batch: st.Batch.ID, Sampled: []stage.Sampled{{Seq: 1, Token: 5}, {Seq: 2, Token: 6}}}
			}
			bad := good()
			tc.edit(bad)
			if _, err := sc.Complete(bad); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
			outs, err := sc.Complete(good())
			if err != nil {
				t.Fatal(err)
			}
			var got []int32
			for _, o := range outs {
				got = append(got, o.Token.Token)
			}
			if !slices.Equal(got, []int32{5, 6}) || sc.Stats().Finished != 2 {
				t.Errorf("after the bad result: tokens %v, stats %+v; want [5 6], both finished", got, sc.Stats())
			}
		})
	}
}

// TestBalancedSteps checks that without hand-off the running requests are
// spread evenly over the steps in flight, within MaxNumSeqs.
func TestBalancedSteps(t *testing.T) {
	for _, tc := range []struct {
		reqs, seqs, batches int
		want                []int // sequences per step
	}{
		{reqs: 8, seqs: 16, batches: 4, want: []int{2, 2, 2, 2}},
		{reqs: 7, seqs: 16, batches: 3, want: []int{3, 3, 1}},
		{reqs: 5, seqs: 16, batches: 1, want: []int{5}},
		{reqs: 40, seqs: 4, batches: 2, want: []int{4, 4}},
		{reqs: 1, seqs: 4, batches: 8, want: []int{1}},
	} {
		sc, err := sched.New(sched.Config{MaxNumBatchedTokens: 1000, MaxNumSeqs: tc.seqs, NumBlocks: 100, MaxConcurrentBatches: tc.batches}, nil)
		if err != nil {
			t.Fatal(err)
		}
		for i := range tc.reqs {
			if err := sc.Add(sched.Request{ID: uint64(i), Prompt: []int32{1}, MaxTokens: 4}); err != nil {
				t.Fatal(err)
			}
		}
		var got []int
		for {
			st, ok := sc.Schedule()
			if !ok {
				break
			}
			got = append(got, len(st.Batch.Seqs))
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("%d requests, %d seqs, %d batches: steps of %v sequences, want %v", tc.reqs, tc.seqs, tc.batches, got, tc.want)
		}
	}
}

// drain runs sc until it is idle, sampling token 7 for every sequence,
// and returns the outputs in order.
func drain(t *testing.T, sc *sched.Scheduler) []sched.Output {
	t.Helper()
	var outs []sched.Output
	for !sc.Idle() {
		st, ok := sc.Schedule()
		if !ok {
			t.Fatal("not idle, but nothing to schedule")
		}
		if len(st.Batch.Seqs) == 0 {
			continue
		}
		r := &pipeline.Result{Batch: st.Batch.ID}
		for _, q := range st.Batch.Seqs {
			if q.Sample {
				r.Sampled = append(r.Sampled, stage.Sampled{Seq: q.ID, Token: 7})
			}
		}
		o, err := sc.Complete(r)
		if err != nil {
			t.Fatal(err)
		}
		outs = append(outs, o...)
	}
	return outs
}

// TestScheduledAndCounters checks that a request's first output carries
// when it was first scheduled (its later ones do not), that every output
// carries when its step came back, and that Counters
// given to two schedulers count the preemptions of both.
func TestScheduledAndCounters(t *testing.T) {
	var c sched.Counters
	var total uint64
	for run := range 2 {
		tick := time.Unix(100, 0)
		clock := func() time.Time { tick = tick.Add(time.Second); return tick }
		// Three blocks of one position for two requests that each need
		// three, both admitted at once (GrowthReserve -1: whatever fits
		// now): the newer is preempted while the older grows.
		sc, err := sched.New(sched.Config{MaxNumBatchedTokens: 8, MaxNumSeqs: 2, BlockSize: 1, NumBlocks: 3, Counters: &c, GrowthReserve: -1}, clock)
		if err != nil {
			t.Fatal(err)
		}
		for id := uint64(1); id <= 2; id++ {
			if err := sc.Add(sched.Request{ID: id, Prompt: []int32{1}, MaxTokens: 3}); err != nil {
				t.Fatal(err)
			}
		}
		first := tick.Add(time.Second) // the clock reading of the first step
		for _, o := range drain(t, sc) {
			if (o.Index == 0) == o.Scheduled.IsZero() {
				t.Errorf("run %d: output %+v: Scheduled set on the first token only", run, o)
			}
			if !o.Time.After(first) {
				t.Errorf("run %d: output %+v: Time not after the first step", run, o)
			}
			if o.Index == 0 && o.ID == 1 && !o.Scheduled.Equal(first) {
				t.Errorf("run %d: request 1 scheduled at %v, want the first step's %v", run, o.Scheduled, first)
			}
		}
		total += sc.Stats().Preemptions
		if c.Preemptions() != total || sc.Stats().Preemptions == 0 {
			t.Errorf("run %d: counters %d preemptions, the schedulers %d in all (this one %d); want equal, some", run, c.Preemptions(), total, sc.Stats().Preemptions)
		}
	}
}

// TestCountersOutliveSchedulers: Counters given to two schedulers in turn
// (as the leader gives every pipeline's) count the failed, refused,
// discarded and preempted requests and the steps of both, equal to the sum
// of their Stats.
func TestCountersOutliveSchedulers(t *testing.T) {
	var c sched.Counters
	var sum sched.Stats
	for run := range 2 {
		sc, err := sched.New(sched.Config{MaxNumBatchedTokens: 8, MaxNumSeqs: 2, BlockSize: 1, NumBlocks: 3, MaxNumWaiting: 1, GrowthReserve: -1, Counters: &c}, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := sc.Add(sched.Request{ID: 1, Prompt: []int32{1}, MaxTokens: 3}); err != nil {
			t.Fatal(err)
		}
		if err := sc.Add(sched.Request{ID: 2, Prompt: []int32{1}, MaxTokens: 3}); !errors.Is(err, sched.ErrQueueFull) {
			t.Fatalf("run %d: a second waiting request: %v, want ErrQueueFull", run, err)
		}
		if !sc.Fail(1) {
			t.Fatalf("run %d: request 1 not live", run)
		}
		// Request 3 is cancelled while its step is in flight: its token
		// comes back discarded. Request 4 runs to its end.
		if err := sc.Add(sched.Request{ID: 3, Prompt: []int32{1}, MaxTokens: 3}); err != nil {
			t.Fatal(err)
		}
		step, ok := sc.Schedule()
		if !ok {
			t.Fatalf("run %d: request 3 not scheduled", run)
		}
		sc.Cancel(3)
		if _, err := sc.Complete(&pipeline.Result{Batch: step.Batch.ID, Sampled: []stage.Sampled{{Seq: 3, Token: 7}}}); err != nil {
			t.Fatal(err)
		}
		if err := sc.Add(sched.Request{ID: 4, Prompt: []int32{1}, MaxTokens: 3}); err != nil {
			t.Fatal(err)
		}
		drain(t, sc)
		st := sc.Stats()
		sum.Failed += st.Failed
		sum.Refused += st.Refused
		sum.Discarded += st.Discarded
		sum.Steps += st.Steps
		sum.Preemptions += st.Preemptions
		if st.Failed != 1 || st.Refused != 1 || st.Discarded != 1 || st.Steps == 0 {
			t.Errorf("run %d: stats %+v: want 1 failed, 1 refused, 1 discarded, some steps", run, st)
		}
		got := sched.Stats{Failed: c.Failed(), Refused: c.Refused(), Discarded: c.Discarded(), Steps: c.Steps(), Preemptions: c.Preemptions()}
		if got != sum {
			t.Errorf("run %d: counters %+v, want the schedulers' sum %+v", run, got, sum)
		}
	}
}

// TestTooLarge checks that the refusals of requests too large to ever run
// wrap ErrTooLarge, and no other refusal does.
func TestTooLarge(t *testing.T) {
	sc, err := sched.New(sched.Config{MaxNumBatchedTokens: 8, MaxNumSeqs: 2, BlockSize: 4, NumBlocks: 3, MaxModelLen: 20}, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		r     sched.Request
		never bool
	}{
		{sched.Request{ID: 1, Prompt: make([]int32, 18), MaxTokens: 3}, true}, // past MaxModelLen
		{sched.Request{ID: 2, Prompt: make([]int32, 10), MaxTokens: 4}, true}, // 13 positions, 4 blocks
		{sched.Request{ID: 3, Prompt: nil, MaxTokens: 4}, false},
		{sched.Request{ID: 4, Prompt: []int32{1}, MaxTokens: 0}, false},
	} {
		err := sc.Add(tc.r)
		if err == nil || errors.Is(err, sched.ErrTooLarge) != tc.never {
			t.Errorf("request %d: %v; want an error, wrapping ErrTooLarge: %t", tc.r.ID, err, tc.never)
		}
	}
	if err := sc.Add(sched.Request{ID: 5, Prompt: make([]int32, 9), MaxTokens: 4}); err != nil {
		t.Errorf("a request of exactly the capacity: %v", err)
	}
}
