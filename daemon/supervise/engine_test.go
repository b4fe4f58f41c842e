package supervise

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tandem-llm/tandem/daemon/apierr"
	"github.com/tandem-llm/tandem/daemon/placement"
	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/randinit"
	"github.com/tandem-llm/tandem/pipeline"
	"github.com/tandem-llm/tandem/sched"
	"github.com/tandem-llm/tandem/stage"
	"github.com/tandem-llm/tandem/stage/cpu"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const testBlocks = 256

// openTestModel writes a tiny random checkpoint of 4 layers and opens it.
func openTestModel(t testing.TB) *model.Checkpoint {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "model")
	o := randinit.DefaultOptions()
	o.Seed = 5
	if err := randinit.Write(dir, o); err != nil {
		t.Fatal(err)
	}
	ckpt, err := model.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ckpt.Close() })
	return ckpt
}

// eagerDispatcher dispatches every step eagerly (mode NONE), as the leader
// does for CPU stages.
func eagerDispatcher(t *testing.T) *graphs.Dispatcher {
	t.Helper()
	d, err := graphs.NewDispatcher(graphs.Config{Mode: graphs.None, MaxCaptureSize: 32})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// localPipeline runs the model split at bounds as a pipeline of CPU stages
// in this process, with hand-off, as the supervisor's Pipeline of epoch;
// wrap (nil: none) may replace any stage but the first.
func localPipeline(t *testing.T, ckpt *model.Checkpoint, epoch uint64, disp *graphs.Dispatcher, bounds []int, wrap func(i int, st stage.Stage) stage.Stage) *Pipeline {
	t.Helper()
	cfg := ckpt.Config()
	var stages []stage.Stage
	p := &Pipeline{Epoch: epoch, Steps: &graphs.Stats{}, Graphs: &Graphs{Dispatch: disp}}
	for i := 0; i+1 < len(bounds); i++ {
		st, err := cpu.New(cpu.Config{Model: cfg, Lo: bounds[i], Hi: bounds[i+1], Weights: ckpt, MaxTokens: 32, MaxSeqs: 4, NumBlocks: testBlocks, BlockSize: sched.DefaultBlockSize})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		var s stage.Stage = st
		if wrap != nil && i > 0 {
			s = wrap(i, st)
		}
		stages = append(stages, s)
		p.Stages = append(p.Stages, Stage{Stage: placement.Stage{Node: fmt.Sprintf("n%d", i), Lo: bounds[i], Hi: bounds[i+1]}})
	}
	drv, err := pipeline.LocalOptions{Handoff: true}.Start(context.Background(), stages)
	if err != nil {
		t.Fatal(err)
	}
	p.drv = drv
	p.MaxInFlight, p.Handoff = len(stages)+1, true
	p.Sched = sched.Config{MaxNumBatchedTokens: 32, MaxNumSeqs: 4, BlockSize: sched.DefaultBlockSize, NumBlocks: testBlocks,
		MaxConcurrentBatches: p.MaxInFlight, MaxModelLen: 2048, OnDeviceHandoff: true}
	p.ex = &stepExecutor{Driver: drv, epoch: epoch, dispatch: disp, stats: p.Steps}
	return p
}

// failing is a stage whose forward pass fails from its nth call on, as a
// stage that broke.
type failing struct {
	stage.Stage
	after int32
	calls atomic.Int32
}

func (f *failing) Forward(ctx context.Context, b *stage.Batch) (*stage.Output, error) {
	if f.calls.Add(1) > f.after {
		return nil, errors.New("injected fault")
	}
	return f.Stage.Forward(ctx, b)
}

// referenceRun is one request alone through the plain generation loop on a
// single-stage pipeline.
func referenceRun(t *testing.T, ckpt *model.Checkpoint, r sched.Request) []stage.Sampled {
	t.Helper()
	cfg := ckpt.Config()
	st, err := cpu.New(cpu.Config{Model: cfg, Lo: 0, Hi: cfg.NumLayers, Weights: ckpt, MaxTokens: 64, MaxSeqs: 2, NumBlocks: 64})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	d, err := pipeline.StartLocal(context.Background(), []stage.Stage{st})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	var out []stage.Sampled
	err = pipeline.Generate(context.Background(), d, []pipeline.Request{{ID: 1, Prompt: r.Prompt, MaxTokens: r.MaxTokens, Sampling: r.Sampling}}, pipeline.GenerateOptions{MaxBatchTokens: 64}, func(ev pipeline.Event) error {
		out = append(out, ev.Token)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestEngineSurvivesAStage runs concurrent greedy and seeded requests on a
// 3-stage pipeline whose last stage breaks mid-generation: the engine
// reports the failure blaming that stage, the requests wait, and once the
// engine switches to a new pipeline (another split, as a recovery over
// the stages left builds) they continue there, re-prefilled, and end with
// exactly the tokens and log-probabilities each gets alone.
func TestEngineSurvivesAStage(t *testing.T) {
	ckpt := openTestModel(t)
	disp := eagerDispatcher(t)
	type failure struct {
		p   *Pipeline
		err error
	}
	failures := make(chan failure, 4)
	e := newEngine(func(p *Pipeline, err error) { failures <- failure{p, err} })
	var reqs []sched.Request
	for i := range 6 {
		r := sched.Request{Prompt: []int32{int32(3 + i), 50, int32(7 * i), 9}, MaxTokens: 24 + 3*i}
		if i%2 == 1 {
			r.Sampling = stage.Sampling{Temperature: 0.9, TopK: 40, TopP: 0.95, Seed: uint64(100 + i), Logprobs: 2}
		}
		reqs = append(reqs, r)
	}
	want := make([][]stage.Sampled, len(reqs))
	for i, r := range reqs {
		want[i] = referenceRun(t, ckpt, r)
	}
	first := localPipeline(t, ckpt, 1, disp, []int{0, 1, 3, 4}, func(i int, st stage.Stage) stage.Stage {
		if i == 2 {
			return &failing{Stage: st, after: 12}
		}
		return st
	})
	e.admit(true, "")
	if err := e.switchTo(first); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	got := make([][]stage.Sampled, len(reqs))
	errs := make([]error, len(reqs))
	var wg sync.WaitGroup
	for i, r := range reqs {
		s, err := e.Submit(ctx, r)
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() {
			for {
				o, err := s.Recv(ctx)
				if err != nil {
					errs[i] = err
					return
				}
				if o.Index != len(got[i]) {
					errs[i] = fmt.Errorf("token #%d after %d tokens", o.Index, len(got[i]))
					return
				}
				got[i] = append(got[i], o.Token)
			}
		})
	}
	f := <-failures
	var se *pipeline.StageError
	if f.p != first || !errors.As(f.err, &se) || se.Stage != 2 || !strings.Contains(f.err.Error(), "injected fault") {
		t.Fatalf("failure %v of pipeline %v, want stage 2's injected fault on the first pipeline", f.err, f.p.Epoch)
	}
	e.detach(first)
	first.drv.Close()
	if st := e.Stats(); st.Finished == uint64(len(reqs)) {
		t.Fatalf("every request finished before the fault: %+v", st)
	}
	second := localPipeline(t, ckpt, 2, disp, []int{0, 3, 4}, nil)
	if err := e.switchTo(second); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	for i := range reqs {
		if !errors.Is(errs[i], io.EOF) || len(got[i]) != len(want[i]) {
			t.Fatalf("request %d: %d tokens, ended with %v; want %d and io.EOF", i, len(got[i]), errs[i], len(want[i]))
		}
		for j, w := range want[i] {
			g := got[i][j]
			if g.Token != w.Token || g.Logprob != w.Logprob || len(g.Top) != len(w.Top) {
				t.Fatalf("request %d token %d: %+v, want %+v (alone)", i, j, g, w)
			}
		}
	}
	st := e.Stats()
	if st.Reprefilled == 0 || st.Running+st.Waiting+st.KVBlocksUsed != 0 || st.Finished != uint64(len(reqs)) {
		t.Errorf("stats %+v: want requests re-prefilled, all finished, nothing held", st)
	}
	t.Logf("%d requests survived the stage: %d re-prefilled, identical to their solo runs", len(reqs), st.Reprefilled)
	e.retire("test over", time.Second)
	second.drv.Close()
}

// TestEngineEpoch checks that the engine stamps its steps with its
// pipeline's epoch: a stage assigned in that epoch serves them; one
// assigned in a newer epoch refuses them, which the engine reports as the
// pipeline's failure naming both epochs, while the request waits.
func TestEngineEpoch(t *testing.T) {
	ckpt := openTestModel(t)
	cfg := ckpt.Config()
	for _, tc := range []struct {
		engine, stage uint64
		ok            bool
	}{{9, 9, true}, {9, 10, false}} {
		st, err := cpu.New(cpu.Config{Model: cfg, Lo: 0, Hi: cfg.NumLayers, Weights: ckpt, MaxTokens: 32, MaxSeqs: 4, NumBlocks: testBlocks, BlockSize: sched.DefaultBlockSize})
		if err != nil {
			t.Fatal(err)
		}
		ln, err := pipeline.ListenControl("127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		served := make(chan error, 1)
		go func() {
			ctl, err := ln.Accept(context.Background())
			if err != nil {
				served <- err
				return
			}
			defer ctl.Close()
			served <- (&pipeline.Worker{Stage: st, Ctl: ctl, Epoch: tc.stage}).Serve(context.Background())
		}()
		link, err := pipeline.DialLink(context.Background(), ln.Addr())
		if err != nil {
			t.Fatal(err)
		}
		d, err := pipeline.NewDriver([]pipeline.Link{link})
		if err != nil {
			t.Fatal(err)
		}
		disp := eagerDispatcher(t)
		p := &Pipeline{Epoch: tc.engine, Steps: &graphs.Stats{}, drv: d,
			Sched: sched.Config{MaxNumBatchedTokens: 32, MaxNumSeqs: 4, NumBlocks: testBlocks, MaxConcurrentBatches: 2}}
		p.ex = &stepExecutor{Driver: d, epoch: tc.engine, dispatch: disp, stats: p.Steps}
		failed := make(chan error, 1)
		e := newEngine(func(_ *Pipeline, err error) { failed <- err })
		e.admit(true, "")
		if err := e.switchTo(p); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		stream, err := e.Submit(ctx, sched.Request{Prompt: []int32{1, 2, 3}, MaxTokens: 2})
		if err != nil {
			t.Fatal(err)
		}
		if tc.ok {
			var recvErr error
			for recvErr == nil {
				_, recvErr = stream.Recv(ctx)
			}
			if !errors.Is(recvErr, io.EOF) {
				t.Errorf("engine epoch %d, stage epoch %d: stream ended with %v", tc.engine, tc.stage, recvErr)
			}
		} else {
			err := <-failed
			if !strings.Contains(err.Error(), "epoch 9 refused") || !strings.Contains(err.Error(), "epoch 10") {
				t.Errorf("failure %v, want the refusal naming epochs 9 and 10", err)
			}
			if st := e.Stats(); st.Running+st.Waiting != 1 {
				t.Errorf("after the failure: %+v, want the request waiting", st)
			}
		}
		cancel()
		e.retire("test over", time.Second)
		d.Close()
		<-served
		ln.Close()
		st.Close()
	}
}

// TestEngineRetire checks that a retiring engine refuses new requests with
// its reason and lets the running one finish; and that past its timeout
// it fails what is left.
func TestEngineRetire(t *testing.T) {
	ckpt := openTestModel(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, timeout := range []time.Duration{time.Minute, 20 * time.Millisecond} {
		p := localPipeline(t, ckpt, 1, eagerDispatcher(t), []int{0, 2, 4}, nil)
		e := newEngine(func(*Pipeline, error) {})
		e.admit(true, "")
		if err := e.switchTo(p); err != nil {
			t.Fatal(err)
		}
		s, err := e.Submit(ctx, sched.Request{Prompt: []int32{1, 2, 3}, MaxTokens: 200})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.Recv(ctx); err != nil {
			t.Fatal(err)
		}
		retired := make(chan struct{})
		go func() {
			e.retire("node x is draining", timeout)
			close(retired)
		}()
		for {
			_, err := e.Submit(ctx, sched.Request{Prompt: []int32{1}, MaxTokens: 1})
			if err != nil {
				if apierr.KindOf(err) != apierr.Unavailable || !strings.Contains(err.Error(), "node x is draining") {
					t.Errorf("request while retiring: %v, want UNAVAILABLE with the reason", err)
				}
				break
			}
			time.Sleep(time.Millisecond) // the retire has not begun yet
		}
		n := 1
		for err == nil {
			if _, err = s.Recv(ctx); err == nil {
				n++
			}
		}
		<-retired
		if timeout == time.Minute && (!errors.Is(err, io.EOF) || n != 200) {
			t.Errorf("retired with time to spare: the request ended after %d tokens with %v, want all 200", n, err)
		}
		if timeout < time.Second && (apierr.KindOf(err) != apierr.Unavailable || !strings.Contains(err.Error(), "took longer than")) {
			t.Errorf("retired past its timeout: the request ended after %d tokens with %v, want UNAVAILABLE", n, err)
		}
		p.drv.Close()
	}
}

// replaysAll stands in for a CUDA stage that captured every key: it runs
// each step it is told to replay (eagerly here, which gives the same
// result).
type replaysAll struct{ stage.Stage }

func (s replaysAll) Forward(ctx context.Context, b *stage.Batch) (*stage.Output, error) {
	eager := *b
	eager.Graph = graphs.Step{}
	return s.Stage.Forward(ctx, &eager)
}

// TestUnreplayableStepFails dispatches CUDA graphs to a pipeline whose
// first stage replays them and whose second, a CPU stage, has none: the
// second's refusal of the first step, after the first stage ran it and
// sent its activations, fails the pipeline promptly (never hanging it),
// blaming stage 1 and naming the key; the request waits for a new
// pipeline, and fails with the reason given when none comes.
func TestUnreplayableStepFails(t *testing.T) {
	ckpt := openTestModel(t)
	cfg := ckpt.Config()
	var stages []stage.Stage
	for i, r := range [][2]int{{0, 2}, {2, cfg.NumLayers}} {
		st, err := cpu.New(cpu.Config{Model: cfg, Lo: r[0], Hi: r[1], Weights: ckpt, MaxTokens: 32, MaxSeqs: 4, NumBlocks: testBlocks, BlockSize: sched.DefaultBlockSize})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		if i == 0 {
			stages = append(stages, replaysAll{st})
		} else {
			stages = append(stages, st)
		}
	}
	d, err := pipeline.StartLocal(context.Background(), stages)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	disp, err := graphs.NewDispatcher(graphs.Config{Mode: graphs.FullAndPiecewise, MaxCaptureSize: 32, MaxNumSeqs: 4})
	if err != nil {
		t.Fatal(err)
	}
	p := &Pipeline{Epoch: 1, Steps: &graphs.Stats{}, drv: d, Sched: sched.Config{MaxNumBatchedTokens: 32, MaxNumSeqs: 4, NumBlocks: testBlocks, MaxConcurrentBatches: 2}}
	p.ex = &stepExecutor{Driver: d, epoch: 1, dispatch: disp, stats: p.Steps}
	failed := make(chan error, 1)
	e := newEngine(func(_ *Pipeline, err error) { failed <- err })
	e.admit(true, "")
	if err := e.switchTo(p); err != nil {
		t.Fatal(err)
	}
	defer e.retire("test over", 10*time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	s, err := e.Submit(ctx, sched.Request{Prompt: []int32{5, 6, 7, 8}, MaxTokens: 4})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-failed:
		var se *pipeline.StageError
		if !errors.As(err, &se) || se.Stage != 1 || !strings.Contains(err.Error(), "stage cpu [2,4) cannot replay key PIECEWISE tokens=4") {
			t.Fatalf("failure %v, want stage 1 naming the key it cannot replay", err)
		}
	case <-ctx.Done():
		t.Fatal("the failed step was never reported")
	}
	t.Logf("the failed step was reported in %v", time.Since(start).Round(time.Millisecond))
	reason := apierr.Unavailablef("no pipeline could be rebuilt within 1m0s")
	e.failAll(reason)
	if _, err := s.Recv(ctx); !errors.Is(err, reason) {
		t.Errorf("request after FailAll: %v, want the reason", err)
	}
	rows := p.Steps.Snapshot()
	if len(rows) != 1 || rows[0] != (graphs.Row{Unpadded: 4, Padded: 4, Mode: graphs.Piecewise, Count: 1}) {
		t.Errorf("dispatch statistics %+v, want the prompt's one PIECEWISE step of 4 tokens", rows)
	}
}

// TestEngineQueueFull: past the scheduler's bound on waiting requests,
// Submit refuses at once with an Overloaded error (RESOURCE_EXHAUSTED,
// HTTP 429) saying how many wait; a request that can never fit is
// Exhausted.
func TestEngineQueueFull(t *testing.T) {
	ckpt := openTestModel(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p := localPipeline(t, ckpt, 1, eagerDispatcher(t), []int{0, 4}, nil)
	p.Sched.MaxNumWaiting, p.Sched.MaxNumSeqs = 2, 1
	defer p.drv.Close()
	e := newEngine(func(*Pipeline, error) {})
	e.admit(true, "")
	if err := e.switchTo(p); err != nil {
		t.Fatal(err)
	}
	defer e.retire("test over", 10*time.Millisecond)
	var err error
	for i := 0; i < 8 && err == nil; i++ {
		_, err = e.Submit(ctx, sched.Request{Prompt: []int32{1, 2, 3}, MaxTokens: 1000})
	}
	if apierr.KindOf(err) != apierr.Overloaded || status.Code(apierr.GRPC(err)) != codes.ResourceExhausted || !strings.Contains(err.Error(), "2 wait for admission") {
		t.Errorf("past the queue bound: %v, want Overloaded (RESOURCE_EXHAUSTED) saying 2 wait", err)
	}
	_, err = e.Submit(ctx, sched.Request{Prompt: []int32{1}, MaxTokens: 1 << 20})
	if apierr.KindOf(err) != apierr.Exhausted {
		t.Errorf("a request that never fits: %v, want Exhausted", err)
	}
}
