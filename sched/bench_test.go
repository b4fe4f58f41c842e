package sched_test

import (
	"context"
	"fmt"
	"math"
	"path/filepath"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/randinit"
	"github.com/tandem-llm/tandem/pipeline"
	"github.com/tandem-llm/tandem/sched"
	"github.com/tandem-llm/tandem/stage"
	"github.com/tandem-llm/tandem/stage/cpu"
)

// BenchmarkSchedStep measures one step of the core, Schedule and Complete,
// with 256 running requests decoding (a finished request is replaced at
// once, so some steps also carry a prefill).
func BenchmarkSchedStep(b *testing.B) {
	const running = 256
	sc, err := sched.New(sched.Config{MaxNumBatchedTokens: 8192, MaxNumSeqs: running, NumBlocks: running * 16}, nil)
	if err != nil {
		b.Fatal(err)
	}
	prompt := make([]int32, 100)
	next := uint64(0)
	add := func() {
		next++
		if err := sc.Add(sched.Request{ID: next, Prompt: prompt, MaxTokens: 128, StopTokens: []int32{2}}); err != nil {
			b.Fatal(err)
		}
	}
	for range running {
		add()
	}
	r := &pipeline.Result{}
	step := func() {
		st, ok := sc.Schedule()
		if !ok {
			b.Fatal("nothing scheduled")
		}
		r.Batch = st.Batch.ID
		r.Sampled = r.Sampled[:0]
		for i := range st.Batch.Seqs {
			if q := &st.Batch.Seqs[i]; q.Sample {
				r.Sampled = append(r.Sampled, stage.Sampled{Seq: q.ID, Token: 1})
			}
		}
		outs, err := sc.Complete(r)
		if err != nil {
			b.Fatal(err)
		}
		for _, o := range outs {
			if o.Finish != "" {
				add()
			}
		}
	}
	step() // prefill everything
	b.ReportAllocs()
	for b.Loop() {
		step()
	}
	if st := sc.Stats(); st.Running != running {
		b.Fatalf("%d running, want %d", st.Running, running)
	}
}

// simulate runs requests through the core against a model of a p-stage
// pipeline in which every stage takes stageTime per step, whatever it
// carries, and a step passes to the next stage as soon as that stage is
// free. It returns the tokens delivered per second of simulated time over a
// horizon of 400 single-step round trips, in which requests never run out
// (a steady state: no ramp-down in the measure).
func simulate(tb testing.TB, p, inflight int) float64 {
	const (
		stageTime = time.Millisecond
		maxSeqs   = 8
	)
	horizon := 400 * time.Duration(p) * stageTime
	var now time.Duration
	start := time.Unix(0, 0)
	sc, err := sched.New(sched.Config{MaxNumBatchedTokens: 256, MaxNumSeqs: maxSeqs, NumBlocks: 8192, MaxConcurrentBatches: inflight},
		func() time.Time { return start.Add(now) })
	if err != nil {
		tb.Fatal(err)
	}
	for i := range 64 * p {
		if err := sc.Add(sched.Request{ID: uint64(i), Prompt: make([]int32, 8), MaxTokens: 32 + i%64}); err != nil {
			tb.Fatal(err)
		}
	}
	type flying struct {
		st   *pipeline.Step
		done time.Duration
	}
	var (
		queue  []flying
		free   = make([]time.Duration, p) // when each stage is next free
		tokens int
	)
	for {
		for {
			st, ok := sc.Schedule()
			if !ok {
				break
			}
			if len(st.Batch.Seqs) == 0 {
				continue
			}
			t := now
			for k := range free {
				t = max(t, free[k]) + stageTime
				free[k] = t
			}
			queue = append(queue, flying{st, t})
		}
		if st := sc.Stats(); st.Waiting == 0 {
			tb.Fatalf("p=%d, %d in flight: requests ran out at %v, before the horizon %v", p, inflight, now, horizon)
		}
		f := queue[0]
		queue = queue[1:]
		if f.done > horizon {
			return float64(tokens) / horizon.Seconds()
		}
		now = f.done
		r := &pipeline.Result{Batch: f.st.Batch.ID}
		for _, q := range f.st.Batch.Seqs {
			if q.Sample {
				r.Sampled = append(r.Sampled, stage.Sampled{Seq: q.ID, Token: 1})
			}
		}
		outs, err := sc.Complete(r)
		if err != nil {
			tb.Fatal(err)
		}
		tokens += len(outs)
	}
}

// BenchmarkPipelineInFlight reports the throughput of a simulated p-stage
// pipeline with a fixed stage time (see simulate: simulated time, not wall
// time) as the steps in flight go from 1 to p+1, and the speedup over one
// step in flight. ns/op is the scheduler's cost of the whole workload.
func BenchmarkPipelineInFlight(b *testing.B) {
	for _, p := range []int{2, 4, 8} {
		base := simulate(b, p, 1)
		for inflight := 1; inflight <= p+1; inflight++ {
			b.Run(fmt.Sprintf("p=%d/inflight=%d", p, inflight), func(b *testing.B) {
				var tput float64
				for b.Loop() {
					tput = simulate(b, p, inflight)
				}
				b.ReportMetric(tput, "tok/simsec")
				b.ReportMetric(tput/base, "speedup")
			})
		}
	}
}

// TestPipelineInFlightThroughput checks the pipeline-filling target: with
// p steps in flight a p-stage pipeline of fixed stage time delivers at
// least 0.95·p times the tokens per second of one step in flight.
func TestPipelineInFlightThroughput(t *testing.T) {
	for _, p := range []int{2, 4, 8} {
		one := simulate(t, p, 1)
		for _, inflight := range []int{p, p + 1} {
			got := simulate(t, p, inflight)
			t.Logf("p=%d: %d in flight %.0f tok/s, 1 in flight %.0f tok/s: ×%.3f", p, inflight, got, one, got/one)
			if got < 0.95*float64(p)*one {
				t.Errorf("p=%d, %d in flight: %.0f tok/s, want at least 0.95·%d·%.0f", p, inflight, got, p, one)
			}
		}
	}
}

// TestLoopFillsPipeline checks the same target end to end, through the Loop
// and the fake pipeline's goroutines on synctest's clock.
func TestLoopFillsPipeline(t *testing.T) {
	const p = 4
	elapsed := func(inflight int) time.Duration {
		var d time.Duration
		synctest.Test(t, func(t *testing.T) {
			fp := newFakePipe(fakePipeConfig{model: fakeModel{stages: p, vocab: 1000}, numBlocks: 1024, blockSize: 16, maxSeqs: 8, maxConcurrent: inflight, latency: fixedLatency(time.Millisecond)})
			defer fp.Close()
			l, err := sched.Start(sched.Config{MaxNumBatchedTokens: 256, MaxNumSeqs: 8, NumBlocks: 1024, MaxConcurrentBatches: inflight}, fp)
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			begin := time.Now()
			var wg sync.WaitGroup
			for range 2 * p * 8 {
				s, err := l.Submit(context.Background(), sched.Request{Prompt: make([]int32, 8), MaxTokens: 64})
				if err != nil {
					t.Fatal(err)
				}
				wg.Go(func() {
					if toks, _, _ := recvAll(s); len(toks) != 64 {
						t.Errorf("request %d: %d tokens, want 64", s.ID(), len(toks))
					}
				})
			}
			wg.Wait()
			d = time.Since(begin)
		})
		return d
	}
	one, full := elapsed(1), elapsed(p)
	t.Logf("%d stages: %v with 1 step in flight, %v with %d", p, one, full, p)
	if float64(one) < 0.95*p*float64(full) {
		t.Errorf("%d in flight is only ×%.2f faster than 1, want at least ×%.2f", p, float64(one)/float64(full), 0.95*p)
	}
}

// TestHandoffHidesRoundTrip checks, through the Loop and the fake pipeline
// on synctest's clock, what one more step in flight with on-device
// hand-off buys: with p = 4 stages of 1ms and results reaching the leader
// 1ms late, a request's next step no longer waits for that round trip, so
// 32 requests of 64 tokens finish at least 1.15 times sooner than with p
// disjoint steps in flight (the ideal is (4+1)/4 = 1.25; ×1.20 measured),
// both carrying 8 sequences a step.
func TestHandoffHidesRoundTrip(t *testing.T) {
	const (
		p        = 4
		requests = 32
		tokens   = 64
	)
	elapsed := func(handoff bool) time.Duration {
		c := sched.Config{MaxNumBatchedTokens: 256, MaxNumSeqs: requests / p, NumBlocks: 1024, MaxConcurrentBatches: p}
		if handoff {
			c.MaxNumSeqs, c.MaxConcurrentBatches, c.OnDeviceHandoff = requests, p+1, true
		}
		var d time.Duration
		synctest.Test(t, func(t *testing.T) {
			fp := newFakePipe(fakePipeConfig{model: fakeModel{stages: p, vocab: 1000}, numBlocks: 1024, blockSize: 16,
				maxSeqs: c.MaxNumSeqs, maxConcurrent: c.MaxConcurrentBatches, latency: fixedLatency(time.Millisecond)})
			defer fp.Close()
			l, err := sched.Start(c, lagged{fp, time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			begin := time.Now()
			var wg sync.WaitGroup
			for range requests {
				s, err := l.Submit(context.Background(), sched.Request{Prompt: make([]int32, 4), MaxTokens: tokens})
				if err != nil {
					t.Fatal(err)
				}
				wg.Go(func() {
					if toks, _, _ := recvAll(s); len(toks) != tokens {
						t.Errorf("request %d: %d tokens, want %d", s.ID(), len(toks), tokens)
					}
				})
			}
			wg.Wait()
			d = time.Since(begin)
			for _, err := range fp.Errs() {
				t.Error(err)
			}
		})
		return d
	}
	disjoint, handoff := elapsed(false), elapsed(true)
	t.Logf("%d stages: %v with %d disjoint steps in flight, %v with %d and hand-off: ×%.3f", p, disjoint, p, handoff, p+1, float64(disjoint)/float64(handoff))
	if float64(disjoint) < 1.15*float64(handoff) {
		t.Errorf("hand-off with %d in flight only ×%.3f faster than %d disjoint, want at least ×1.15", p+1, float64(disjoint)/float64(handoff), p)
	}
}

// slowStage is a CPU stage whose every forward pass takes at least delay:
// a stand-in for a stage whose compute dominates the step, whatever the
// batch.
type slowStage struct {
	*cpu.Stage
	delay time.Duration
}

func (s slowStage) Forward(ctx context.Context, b *stage.Batch) (*stage.Output, error) {
	t := time.Now()
	out, err := s.Stage.Forward(ctx, b)
	time.Sleep(s.delay - time.Since(t))
	return out, err
}

// lagged delays every result by rtt on its way to the leader: the
// control plane's round trip between machines, which is next to nothing
// inside one process.
type lagged struct {
	sched.Executor
	rtt time.Duration
}

func (l lagged) Wait(ctx context.Context) (*pipeline.Result, error) {
	r, err := l.Executor.Wait(ctx)
	time.Sleep(l.rtt)
	return r, err
}

// BenchmarkPipelineInFlightCPU measures, in wall time, tokens per second of
// a real two-stage CPU pipeline (a tiny model, every forward pass padded
// to 10ms, results reaching the leader 3ms late) through the Loop, for 1
// and 8 concurrent requests of 32 tokens: with p = 2 steps in flight and
// disjoint steps, and with p+1 = 3 and on-device hand-off, where a
// request's next step is queued on the first stage before its previous
// token is back at the leader.
func BenchmarkPipelineInFlightCPU(b *testing.B) {
	dir := filepath.Join(b.TempDir(), "m")
	o := randinit.DefaultOptions()
	if err := randinit.Write(dir, o); err != nil {
		b.Fatal(err)
	}
	ckpt, err := model.Open(dir)
	if err != nil {
		b.Fatal(err)
	}
	defer ckpt.Close()
	cfg := ckpt.Config()
	const (
		delay     = 10 * time.Millisecond
		rtt       = 3 * time.Millisecond
		maxTokens = 32
	)
	for _, requests := range []int{1, 8} {
		for _, handoff := range []bool{false, true} {
			inflight := 2
			if handoff {
				inflight = 3
			}
			b.Run(fmt.Sprintf("requests=%d/inflight=%d/handoff=%v", requests, inflight, handoff), func(b *testing.B) {
				var stages []stage.Stage
				for _, r := range [][2]int{{0, 2}, {2, cfg.NumLayers}} {
					st, err := cpu.New(cpu.Config{Model: cfg, Lo: r[0], Hi: r[1], Weights: ckpt, MaxTokens: 64, MaxSeqs: 8, NumBlocks: 256, BlockSize: 16, Threads: 1})
					if err != nil {
						b.Fatal(err)
					}
					defer st.Close()
					stages = append(stages, slowStage{st, delay})
				}
				d, err := pipeline.LocalOptions{Handoff: handoff}.Start(context.Background(), stages)
				if err != nil {
					b.Fatal(err)
				}
				defer d.Close()
				l, err := sched.Start(sched.Config{MaxNumBatchedTokens: 64, MaxNumSeqs: 8, BlockSize: 16, NumBlocks: 256,
					MaxConcurrentBatches: inflight, OnDeviceHandoff: handoff}, lagged{d, rtt})
				if err != nil {
					b.Fatal(err)
				}
				defer l.Close()
				tokens := 0
				start := time.Now()
				for b.Loop() {
					var wg sync.WaitGroup
					for i := range requests {
						s, err := l.Submit(context.Background(), sched.Request{Prompt: []int32{int32(i + 1), 7, 9}, MaxTokens: maxTokens})
						if err != nil {
							b.Fatal(err)
						}
						wg.Go(func() {
							if toks, _, _ := recvAll(s); len(toks) != maxTokens {
								b.Errorf("request %d: %d tokens, want %d", s.ID(), len(toks), maxTokens)
							}
						})
					}
					wg.Wait()
					tokens += requests * maxTokens
				}
				b.ReportMetric(float64(tokens)/time.Since(start).Seconds(), "tok/s")
			})
		}
	}
}

// kvWorkload is the KV-pressure workload of issue 13: requests that each
// grow to promptLen+maxTokens positions, a KV cache holding only a few of
// them whole, and closed-loop clients that keep concurrency requests
// submitted (a new one as soon as one ends).
type kvWorkload struct {
	stages, requests, promptLen, maxTokens int
	blocks, blockSize                      int
	// stepCost is one stage's time for a step: a fixed cost, a cost per
	// token and a cost per position attended to (a CPU stage's shape).
	fixed, perToken, perPosition time.Duration
	// stopAfter, when not 0, ends every request on its stopAfter-th token
	// (a stop token), well before its maxTokens.
	stopAfter int
}

// kvPressure is the workload the issue measured on a CPU cluster: 16
// requests of 1,500 positions, a KV cache of 5 such requests, 2 stages.
var kvPressure = kvWorkload{stages: 2, requests: 16, promptLen: 64, maxTokens: 1436, blocks: 5 * 1500 / 16, blockSize: 16,
	fixed: 200 * time.Microsecond, perToken: 40 * time.Microsecond, perPosition: 20 * time.Nanosecond}

// kvResult is what one simulated run measured.
type kvResult struct {
	elapsed       time.Duration // simulated
	preemptions   uint64
	maxPreempted  int // the most times one request was preempted
	peakRunning   int
	tokens        int
	recomputedPos int // positions prefilled again after a preemption
}

// simulateKV runs the workload through the scheduler core against a model
// of a pipeline of w.stages stages, each taking w.stepCost per step and
// passing a step on as soon as the next stage is free, with concurrency
// clients. It is deterministic (simulated time).
func simulateKV(tb testing.TB, w kvWorkload, concurrency int, tune func(*sched.Config)) kvResult {
	tb.Helper()
	var now time.Duration
	start := time.Unix(0, 0)
	cfg := sched.Config{MaxNumBatchedTokens: 512, MaxNumSeqs: 64, NumBlocks: w.blocks, BlockSize: w.blockSize, MaxConcurrentBatches: w.stages}
	if tune != nil {
		tune(&cfg)
	}
	sc, err := sched.New(cfg, func() time.Time { return start.Add(now) })
	if err != nil {
		tb.Fatal(err)
	}
	var res kvResult
	submitted, done := 0, 0
	submit := func() {
		submitted++
		r := sched.Request{ID: uint64(submitted), Prompt: make([]int32, w.promptLen), MaxTokens: w.maxTokens, StopTokens: []int32{2}}
		for i := range r.Prompt {
			r.Prompt[i] = int32(submitted*7+i) % 1000
		}
		if err := sc.Add(r); err != nil {
			tb.Fatal(err)
		}
	}
	for range min(concurrency, w.requests) {
		submit()
	}
	type flying struct {
		st   *pipeline.Step
		done time.Duration
	}
	var (
		queue     []flying
		free      = make([]time.Duration, w.stages)
		preempted = map[uint64]int{}
		fed       = map[uint64]int{} // positions fed per request, ever
	)
	for done < w.requests {
		for {
			before := sc.Stats().Preemptions
			st, ok := sc.Schedule()
			if !ok {
				break
			}
			if n := sc.Stats().Preemptions - before; n > 0 {
				for _, id := range st.Free {
					preempted[id]++
					res.maxPreempted = max(res.maxPreempted, preempted[id])
				}
			}
			if len(st.Batch.Seqs) == 0 {
				continue
			}
			cost := w.fixed
			for _, q := range st.Batch.Seqs {
				cost += time.Duration(len(q.Tokens))*w.perToken + time.Duration(len(q.Tokens)*(q.Pos+len(q.Tokens)))*w.perPosition
				if q.Pos < fed[q.ID] {
					res.recomputedPos += min(fed[q.ID], q.Pos+len(q.Tokens)) - q.Pos
				}
				fed[q.ID] = max(fed[q.ID], q.Pos+len(q.Tokens))
			}
			t := now
			for k := range free {
				t = max(t, free[k]) + cost
				free[k] = t
			}
			queue = append(queue, flying{st, t})
			res.peakRunning = max(res.peakRunning, sc.Stats().Running)
		}
		if len(queue) == 0 {
			tb.Fatalf("concurrency %d: nothing in flight with %d of %d requests done", concurrency, done, w.requests)
		}
		f := queue[0]
		queue = queue[1:]
		now = f.done
		r := &pipeline.Result{Batch: f.st.Batch.ID}
		for _, q := range f.st.Batch.Seqs {
			if q.Sample {
				tok := int32(1)
				if w.stopAfter > 0 && q.Index == w.stopAfter-1 {
					tok = 2
				}
				r.Sampled = append(r.Sampled, stage.Sampled{Seq: q.ID, Token: tok})
			}
		}
		outs, err := sc.Complete(r)
		if err != nil {
			tb.Fatal(err)
		}
		for _, o := range outs {
			res.tokens++
			if o.Finish != "" {
				done++
				if submitted < w.requests {
					submit()
				}
			}
		}
	}
	res.elapsed = now
	res.preemptions = sc.Stats().Preemptions
	return res
}

// BenchmarkKVPressure reports the simulated time of the KV-pressure
// workload at concurrency 16 and at each fixed concurrency from 1 to 16,
// and the ratio of the first to the best of the others (the issue's
// target: at most 1.3).
func BenchmarkKVPressure(b *testing.B) {
	w := kvPressure
	best := time.Duration(math.MaxInt64)
	bestC := 0
	for c := 1; c <= 16; c++ {
		r := simulateKV(b, w, c, func(cfg *sched.Config) { cfg.MaxNumSeqs = c })
		if r.elapsed < best {
			best, bestC = r.elapsed, c
		}
	}
	var r kvResult
	for b.Loop() {
		r = simulateKV(b, w, 16, nil)
	}
	b.ReportMetric(r.elapsed.Seconds(), "simsec")
	b.ReportMetric(best.Seconds(), "best-fixed-simsec")
	b.ReportMetric(float64(bestC), "best-concurrency")
	b.ReportMetric(r.elapsed.Seconds()/best.Seconds(), "ratio")
	b.ReportMetric(float64(r.preemptions), "preemptions")
	b.ReportMetric(float64(r.maxPreempted), "max-preempted")
	b.ReportMetric(float64(r.recomputedPos), "recomputed-pos")
}

// pipeModel is a pipeline of stages that each hold an equal share of a
// model's layers, on devices whose step time grows slowly with the batch
// (decode reads every weight whatever the batch): a step of n tokens
// takes (Fixed + PerToken·n)/stages of device time on each stage, plus
// Host of host work per stage and step that the device waits for (the
// batch description, launch, synchronisation, links). A step reaches the
// stages RTT/2 after the leader schedules it, activations pass on at
// once, a result reaches the leader RTT/2 after the last stage, and a
// hand-off reaches the first stage Handoff after the last stage's step.
type pipeModel struct {
	stages                                 int
	fixed, perToken, host, rtt, handoffLat time.Duration
}

// h200Llama1B is a pipeModel of the Llama-3.2-1B shape on H200s as
// stage/cuda measured a whole-model decode step after issue 15 (1.089 ms
// at batch 1, 1.771 ms at batch 32: 1.07 ms and 22 µs a token), with 100 µs
// of host work a step on each stage and a control round trip of 200 µs
// between processes of one machine.
func h200Llama1B(stages int) pipeModel {
	return pipeModel{stages: stages, fixed: 1070 * time.Microsecond, perToken: 22 * time.Microsecond, host: 100 * time.Microsecond,
		rtt: 200 * time.Microsecond, handoffLat: 30 * time.Microsecond}
}

// simRun is the outcome of simulatePipeline over its measured window.
type simRun struct {
	tokensPerS float64
	// busy is each stage's device-busy fraction; seqs the mean number of
	// sequences a step carries; running the most requests running at once.
	busy    []float64
	seqs    float64
	running int
}

// simulatePipeline runs a closed loop of concurrency requests (a 64-token
// prompt, 256 tokens to generate; a finished request is replaced at once)
// through the scheduler configured by cfg against model m, in simulated
// time, and measures the tokens delivered per second and how busy the
// stages are over [0.5 s, 3 s].
func simulatePipeline(tb testing.TB, m pipeModel, cfg sched.Config, concurrency int) simRun {
	const (
		warmup  = 500 * time.Millisecond
		horizon = 3 * time.Second
	)
	var now time.Duration
	start := time.Unix(0, 0)
	sc, err := sched.New(cfg, func() time.Time { return start.Add(now) })
	if err != nil {
		tb.Fatal(err)
	}
	next := uint64(0)
	add := func() {
		next++
		prompt := make([]int32, 64)
		prompt[0] = int32(next)
		if err := sc.Add(sched.Request{ID: next, Prompt: prompt, MaxTokens: 256}); err != nil {
			tb.Fatal(err)
		}
	}
	for range concurrency {
		add()
	}
	type flying struct {
		st     *pipeline.Step
		result time.Duration // when the result reaches the leader
	}
	var (
		queue    []flying
		free     = make([]time.Duration, m.stages) // when each stage is next free
		ready    = map[int]time.Duration{}         // hand-off step → when the first stage has it
		handoffs int
		run      simRun
		busy     = make([]time.Duration, m.stages)
		steps    int
		seqs     int
		tokens   int
	)
	for {
		for {
			st, ok := sc.Schedule()
			if !ok {
				break
			}
			if len(st.Batch.Seqs) == 0 {
				continue
			}
			t := now + m.rtt/2
			dev := (m.fixed + m.perToken*time.Duration(st.Batch.NumTokens())) / time.Duration(m.stages)
			for k := range m.stages {
				begin := max(t, free[k])
				if k == 0 && st.AwaitHandoff > 0 {
					begin = max(begin, ready[st.AwaitHandoff])
				}
				t = begin + m.host + dev
				free[k] = t
				if begin >= warmup && t <= horizon {
					busy[k] += dev
				}
			}
			if st.Batch.Handoff {
				handoffs++
				ready[handoffs] = t
				if m.stages > 1 {
					ready[handoffs] += m.handoffLat
				}
			}
			if now >= warmup {
				steps++
				seqs += len(st.Batch.Seqs)
			}
			queue = append(queue, flying{st, t + m.rtt/2})
		}
		run.running = max(run.running, sc.Stats().Running)
		f := queue[0]
		queue = queue[1:]
		if f.result > horizon {
			break
		}
		now = f.result
		r := &pipeline.Result{Batch: f.st.Batch.ID}
		for _, q := range f.st.Batch.Seqs {
			if q.Sample {
				r.Sampled = append(r.Sampled, stage.Sampled{Seq: q.ID, Token: 1})
			}
		}
		outs, err := sc.Complete(r)
		if err != nil {
			tb.Fatal(err)
		}
		for _, o := range outs {
			if now >= warmup {
				tokens++
			}
			if o.Finish != "" {
				add()
			}
		}
	}
	window := horizon - warmup
	run.tokensPerS = float64(tokens) / window.Seconds()
	for _, b := range busy {
		run.busy = append(run.busy, float64(b)/float64(window))
	}
	if steps > 0 {
		run.seqs = float64(seqs) / float64(steps)
	}
	return run
}

// pipelineConfig is the scheduler configuration the leader uses for a
// pipeline of p stages with up to seqs sequences a step: hand-off on (p+1
// steps in flight, p groups of up to seqs requests taking turns; one
// stage: 2) or off (p steps in flight; one stage: 2).
func pipelineConfig(p, seqs int, handoff bool) sched.Config {
	c := sched.Config{MaxNumBatchedTokens: 512, MaxNumSeqs: seqs, NumBlocks: 1 << 16, MaxConcurrentBatches: max(2, p), OnDeviceHandoff: handoff}
	if handoff && p > 1 {
		c.MaxConcurrentBatches, c.HandoffSlots = p+1, p*seqs
	}
	return c
}

// BenchmarkPipelineVsOneGPU reports, for the Llama-3.2-1B shape on H200s
// as h200Llama1B models them, the decode throughput of a two-stage
// pipeline against one GPU (speedup) at 8, 64, 128 and 256 concurrent
// requests with up to 64 sequences a step, hand-off on and off, with each
// stage's device-busy fraction and the mean sequences a step. Simulated
// time: ns/op is the scheduler's cost of the whole run.
func BenchmarkPipelineVsOneGPU(b *testing.B) {
	const seqs = 64
	for _, c := range []int{8, 64, 128, 256} {
		one := simulatePipeline(b, h200Llama1B(1), pipelineConfig(1, seqs, true), c)
		for _, handoff := range []bool{true, false} {
			b.Run(fmt.Sprintf("concurrency=%d/handoff=%v", c, handoff), func(b *testing.B) {
				var r simRun
				for b.Loop() {
					r = simulatePipeline(b, h200Llama1B(2), pipelineConfig(2, seqs, handoff), c)
				}
				b.ReportMetric(r.tokensPerS, "tok/simsec")
				b.ReportMetric(r.tokensPerS/one.tokensPerS, "speedup")
				b.ReportMetric(r.busy[0], "busy0")
				b.ReportMetric(r.busy[1], "busy1")
				b.ReportMetric(r.seqs, "seqs/step")
			})
		}
	}
}

// TestPipelineSaturates checks, in simulated time, the two-GPU targets on
// the Llama-3.2-1B shape as h200Llama1B models it, with the stages' host
// work hidden behind their device work (as on CUDA stages whose NCCL links
// are stream-ordered, which pipeline's workers keep launched ahead:
// stage.LinkedLauncher): with hand-off, two stages deliver
// at least 1.9 times the tokens of one GPU when saturated (128 and 256
// concurrent requests: two groups of 64 a step) and at least 0.95 times at
// 8; each stage's device is then at least 90% busy. Sized by the requests
// waiting, or with only max-seqs hand-off slots, the groups would hold 32
// and two stages would deliver what one does.
func TestPipelineSaturates(t *testing.T) {
	const seqs = 64
	model := func(stages int) pipeModel {
		m := h200Llama1B(stages)
		m.host = 0
		return m
	}
	for _, c := range []int{8, 128, 256} {
		one := simulatePipeline(t, model(1), pipelineConfig(1, seqs, true), c)
		two := simulatePipeline(t, model(2), pipelineConfig(2, seqs, true), c)
		ratio := two.tokensPerS / one.tokensPerS
		t.Logf("%d concurrent: one GPU %.0f tok/s, two stages %.0f tok/s (×%.3f), %.1f sequences a step, busy %.3f %.3f",
			c, one.tokensPerS, two.tokensPerS, ratio, two.seqs, two.busy[0], two.busy[1])
		want := 1.9
		if c < seqs {
			want = 0.95
		}
		if ratio < want {
			t.Errorf("%d concurrent: two stages ×%.3f one GPU, want at least ×%.2f", c, ratio, want)
		}
		if c > seqs && min(two.busy[0], two.busy[1]) < 0.9 {
			t.Errorf("%d concurrent: stages busy %.3f and %.3f, want at least 0.9", c, two.busy[0], two.busy[1])
		}
	}
}
