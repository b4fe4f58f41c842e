package steptrace

import (
	"context"
	"errors"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/randinit"
	"github.com/tandem-llm/tandem/pipeline"
	"github.com/tandem-llm/tandem/sched"
	"github.com/tandem-llm/tandem/stage"
	"github.com/tandem-llm/tandem/stage/cpu"
)

// localLoop serves a two-stage CPU pipeline with hand-off in this process,
// observed by rec.
func localLoop(t *testing.T, rec *Recorder) *sched.Loop {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "m")
	if err := randinit.Write(dir, randinit.DefaultOptions()); err != nil {
		t.Fatal(err)
	}
	ckpt, err := model.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ckpt.Close() })
	cfg := ckpt.Config()
	var stages []stage.Stage
	for _, r := range [][2]int{{0, 2}, {2, cfg.NumLayers}} {
		st, err := cpu.New(cpu.Config{Model: cfg, Lo: r[0], Hi: r[1], Weights: ckpt, MaxTokens: 64, MaxSeqs: 8, NumBlocks: 256, BlockSize: 16, Threads: 1})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		stages = append(stages, st)
	}
	d, err := pipeline.LocalOptions{Handoff: true, Observer: rec.Pipeline(7, []string{"a", "b"})}.Start(context.Background(), stages)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	l, err := sched.LoopOptions{Observer: rec}.Start(sched.Config{MaxNumBatchedTokens: 64, MaxNumSeqs: 8, BlockSize: 16, NumBlocks: 256,
		MaxConcurrentBatches: 3, OnDeviceHandoff: true}, d)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// TestRecord records steps of an in-process pipeline serving a stream of
// requests: the summary counts the steps asked for on both stages, busy
// in (0, 1]; every step has a forward span per stage; a second recording
// meanwhile is refused; and outside a recording a step asks the stages
// for their timings once every StatsPeriod at most.
func TestRecord(t *testing.T) {
	rec := New()
	l := localLoop(t, rec)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	for k := range 4 {
		wg.Go(func() {
			for i := 0; ctx.Err() == nil; i++ {
				s, err := l.Submit(ctx, sched.Request{Prompt: []int32{int32(k + 1), int32(i%30 + 2), 5}, MaxTokens: 10})
				if err != nil {
					return
				}
				for {
					if _, err := s.Recv(ctx); err != nil {
						break
					}
				}
			}
		})
	}
	type result struct {
		tr  *Trace
		err error
	}
	done := make(chan result, 1)
	go func() {
		tr, err := rec.Record(ctx, 40)
		done <- result{tr, err}
	}()
	for !rec.on.Load() {
		time.Sleep(time.Millisecond)
	}
	if _, err := rec.Record(ctx, 5); !errors.Is(err, ErrBusy) {
		t.Errorf("a second recording: %v, want ErrBusy", err)
	}
	res := <-done
	if res.err != nil {
		t.Fatal(res.err)
	}
	sum := res.tr.Summary
	if sum.Steps != 40 || sum.Partial || sum.Epoch != 7 || len(sum.Stages) != 2 || sum.Tokens == 0 {
		t.Errorf("summary %+v: want 40 steps of epoch 7 on 2 stages, tokens", sum)
	}
	forwards := map[int]map[uint64]bool{}
	for _, e := range res.tr.Events {
		if e.Name == "forward" {
			if forwards[e.Pid] == nil {
				forwards[e.Pid] = map[uint64]bool{}
			}
			forwards[e.Pid][e.Args.(map[string]any)["batch"].(uint64)] = true
		}
	}
	for i, s := range sum.Stages {
		if s.Steps != 40 || s.Busy <= 0 || s.Busy > 1 || s.Node != []string{"a", "b"}[i] {
			t.Errorf("stage %+v: want 40 steps, busy in (0, 1]", s)
		}
		for _, b := range res.tr.Steps {
			if !forwards[stagePid+i][b] {
				t.Errorf("stage %d: no forward span of step %d", i, b)
			}
		}
	}
	if _, err := res.tr.JSON(); err != nil {
		t.Error(err)
	}

	// Outside a recording: at most one step every StatsPeriod reports.
	o := rec.Pipeline(8, []string{"a"})
	t0 := time.Now().Add(time.Hour)
	asked := 0
	for k := range 100 {
		if o.Submitting(&pipeline.Step{}, t0.Add(time.Duration(k)*StatsPeriod/4)) {
			asked++
		}
	}
	if asked != 25 {
		t.Errorf("100 steps a quarter of StatsPeriod apart: %d asked for timings, want 25", asked)
	}
	if epoch, busy := rec.Busy(time.Now()); epoch != 8 || len(busy) != 1 {
		t.Errorf("busy follows epoch %d with %d stages, want the newest, 8, with 1", epoch, len(busy))
	}
}

// TestBusyRecent checks the recent busy fraction against reports of a
// stage busy half of the time, then idle, then restarted.
func TestBusyRecent(t *testing.T) {
	var b busyState
	t0 := time.Unix(1000, 0)
	for k := range 300 { // 3 s of reports every 10ms, half of it busy
		at := t0.Add(time.Duration(k) * 10 * time.Millisecond)
		b.add(&pipeline.StageTiming{Busy: time.Duration(k) * 5 * time.Millisecond}, at)
	}
	end := t0.Add(2990 * time.Millisecond)
	if busy, _ := b.recent(end); busy < 0.49 || busy > 0.51 {
		t.Errorf("busy half the time: recent %.3f, want 0.5", busy)
	}
	// Idle for a second: the fraction decays with no new report.
	if busy, _ := b.recent(end.Add(2 * BusyWindow)); busy > 0.26 {
		t.Errorf("idle for two windows: recent %.3f, want at most 0.25", busy)
	}
	// A new worker's counts start again.
	b.add(&pipeline.StageTiming{Busy: time.Millisecond, DeviceBusy: time.Millisecond}, end.Add(time.Second))
	if b.last.busy != time.Millisecond || b.n != 1 {
		t.Errorf("after a restart: last %v, %d samples; want 1ms and 1", b.last.busy, b.n)
	}
}

// TestRecordNothing: a recording during which no step completes ends with
// ctx and an error saying so, and the recorder records again afterwards.
func TestRecordNothing(t *testing.T) {
	rec := New()
	rec.Pipeline(1, []string{"a"})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := rec.Record(ctx, 3); err == nil || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("a recording with no step: %v, want the deadline", err)
	}
	if rec.on.Load() || rec.rec != nil {
		t.Error("the recording is still on after Record returned")
	}
	if _, err := rec.Record(context.Background(), 0); err == nil {
		t.Error("a recording of 0 steps: no error")
	}
}

// TestNodeBusyOutlivesPipelines checks that a node's busy time only grows
// across pipelines and across a worker that starts its counts again,
// against the sum of what its stages reported.
func TestNodeBusyOutlivesPipelines(t *testing.T) {
	rec := New()
	at := time.Now()
	report := func(o pipeline.Observer, stage int, busy, device time.Duration) {
		o.Reported(stage, 0, &pipeline.StageTiming{Busy: busy, DeviceBusy: device}, at)
	}
	p1 := rec.Pipeline(1, []string{"a", "b"})
	report(p1, 0, 5*time.Millisecond, time.Millisecond)
	report(p1, 1, 7*time.Millisecond, 0)
	p2 := rec.Pipeline(2, []string{"b"}) // b now holds every layer
	report(p2, 0, 2*time.Millisecond, 0)
	report(p1, 1, 100*time.Millisecond, 0) // the old pipeline's late report counts nowhere
	report(p2, 0, 3*time.Millisecond, 0)
	report(p2, 0, time.Millisecond, 0) // b's worker started again
	want := []NodeBusy{
		{Node: "a", Busy: 5 * time.Millisecond, DeviceBusy: time.Millisecond},
		{Node: "b", Busy: 11 * time.Millisecond}, // 7 in epoch 1, 3 before the restart, 1 after
	}
	if got := rec.NodeBusy(); !slices.Equal(got, want) {
		t.Errorf("NodeBusy = %+v, want %+v", got, want)
	}
}
