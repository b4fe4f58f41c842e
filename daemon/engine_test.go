package daemon

import (
	"context"
	"errors"
	"io"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tandem-llm/tandem/daemon/apierr"
	"github.com/tandem-llm/tandem/daemon/frontend"
	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/pipeline"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
	"github.com/tandem-llm/tandem/sched"
	"github.com/tandem-llm/tandem/stage"
	"github.com/tandem-llm/tandem/stage/cpu"
)

// freeRecorder is a stage that records the sequences it was told to free.
type freeRecorder struct {
	stage.Stage
	mu    sync.Mutex
	freed []uint64
}

func (f *freeRecorder) Free(seq uint64) {
	f.mu.Lock()
	f.freed = append(f.freed, seq)
	f.mu.Unlock()
	f.Stage.Free(seq)
}

func (f *freeRecorder) freedSeqs() []uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.freed)
}

const testBlocks = 256

// testPipeline runs the model as a 2-stage pipeline in this process; the
// returned recorders wrap its stages.
func testPipeline(t *testing.T, ckpt *model.Checkpoint) (*pipeline.Driver, []*freeRecorder) {
	t.Helper()
	cfg := ckpt.Config()
	var stages []stage.Stage
	var recs []*freeRecorder
	for _, r := range [][2]int{{0, 2}, {2, cfg.NumLayers}} {
		st, err := cpu.New(cpu.Config{Model: cfg, Lo: r[0], Hi: r[1], Weights: ckpt, MaxTokens: 32, MaxSeqs: 4, NumBlocks: testBlocks, BlockSize: sched.DefaultBlockSize})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		rec := &freeRecorder{Stage: st}
		recs = append(recs, rec)
		stages = append(stages, rec)
	}
	d, err := pipeline.StartLocal(context.Background(), stages)
	if err != nil {
		t.Fatal(err)
	}
	return d, recs
}

var testSched = sched.Config{MaxNumBatchedTokens: 32, MaxNumSeqs: 4, BlockSize: sched.DefaultBlockSize, NumBlocks: testBlocks, MaxConcurrentBatches: 2, MaxModelLen: 2048}

// startEngine runs an engine over the pipeline until the test ends and
// returns it with a channel that delivers run's error.
func startEngine(t *testing.T, d *pipeline.Driver, epoch uint64) (*engine, <-chan error) {
	t.Helper()
	e, err := newEngine(d, epoch, testSched, eagerDispatcher(t))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- e.run() }()
	t.Cleanup(func() {
		e.abort(errors.New("test over"))
		<-e.done
	})
	return e, done
}

// eagerDispatcher dispatches every step eagerly (mode NONE), as the leader
// does for CPU stages.
func eagerDispatcher(t *testing.T) *graphs.Dispatcher {
	t.Helper()
	d, err := graphs.NewDispatcher(graphs.Config{Mode: graphs.None, MaxCaptureSize: testSched.MaxNumBatchedTokens})
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// staticEngines serves one engine to a frontend.
type staticEngines struct{ e *engine }

func (s staticEngines) Engine() (frontend.Engine, error) { return s.e, nil }

// collectGenerate runs the Generate handler and puts its messages together.
func collectGenerate(ctx context.Context, s *frontend.Server, req *tandemv1.GenerateRequest) (*tandemv1.GenerateResponse, int, error) {
	all := &tandemv1.GenerateResponse{}
	msgs := 0
	err := s.GenerateTo(ctx, req, func(m *tandemv1.GenerateResponse) error {
		msgs++
		all.Text += m.GetText()
		all.TokenIds = append(all.TokenIds, m.GetTokenIds()...)
		all.Logprobs = append(all.Logprobs, m.GetLogprobs()...)
		if m.GetUsage() != nil {
			all.FinishReason, all.Usage = m.GetFinishReason(), m.GetUsage()
		}
		return nil
	})
	return all, msgs, err
}

// TestEngineEpoch checks that the engine stamps its steps with its epoch:
// a stage assigned in that epoch serves them, one assigned in a newer epoch
// refuses them and the engine stops naming both epochs.
func TestEngineEpoch(t *testing.T) {
	ckpt, _ := openTestModel(t, testModel(t))
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
		e, done := startEngine(t, d, tc.engine)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		stream, err := e.Submit(ctx, sched.Request{Prompt: []int32{1, 2, 3}, MaxTokens: 2})
		if err != nil {
			t.Fatal(err)
		}
		var recvErr error
		for recvErr == nil {
			_, recvErr = stream.Recv(ctx)
		}
		if tc.ok != errors.Is(recvErr, io.EOF) {
			t.Errorf("engine epoch %d, stage epoch %d: stream ended with %v", tc.engine, tc.stage, recvErr)
		}
		if !tc.ok {
			runErr := <-done
			if runErr == nil || !strings.Contains(runErr.Error(), "epoch 9 refused") || !strings.Contains(runErr.Error(), "epoch 10") {
				t.Errorf("engine stopped with %v, want the refusal naming epochs 9 and 10", runErr)
			}
			if _, err := e.Submit(ctx, sched.Request{Prompt: []int32{1}, MaxTokens: 1}); status.Code(apierr.GRPC(err)) != codes.Unavailable {
				t.Errorf("submit to a failed engine: %v, want UNAVAILABLE", err)
			}
		}
		cancel()
		e.abort(errors.New("test over"))
		<-e.done
		<-served
		ln.Close()
		st.Close()
	}
}

// TestEngineDrainAndAbort checks that a drain lets the running request
// finish and refuses new ones, and that an abort fails what runs.
func TestEngineDrainAndAbort(t *testing.T) {
	ckpt, tok := openTestModel(t, testModel(t))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, abort := range []bool{false, true} {
		d, _ := testPipeline(t, ckpt)
		e, done := startEngine(t, d, 1)
		s := frontend.New(ckpt.Config(), tok, staticEngines{e})
		type outcome struct {
			tokens int
			finish tandemv1.FinishReason
			err    error
		}
		gen := make(chan outcome, 1)
		first := make(chan struct{})
		go func() {
			var o outcome
			o.err = s.GenerateTo(ctx, &tandemv1.GenerateRequest{PromptTokenIds: []int32{1, 2, 3}, MaxTokens: 200, IgnoreEos: true}, func(m *tandemv1.GenerateResponse) error {
				if o.tokens == 0 {
					close(first)
				}
				o.tokens += len(m.GetTokenIds())
				o.finish = m.GetFinishReason()
				return nil
			})
			if o.tokens == 0 {
				close(first)
			}
			gen <- o
		}()
		<-first
		if abort {
			e.abort(errors.New("test over"))
		} else {
			e.drain()
		}
		if _, err := e.Submit(ctx, sched.Request{Prompt: []int32{1}, MaxTokens: 1}); apierr.KindOf(err) != apierr.Unavailable {
			t.Errorf("abort %t: request after the stop: %v, want UNAVAILABLE", abort, err)
		}
		runErr := <-done
		o := <-gen
		genErr := o.err
		if abort {
			if apierr.KindOf(genErr) != apierr.Unavailable || !errors.Is(runErr, errAborted) {
				t.Errorf("aborted: request ended with %v; run %v; want UNAVAILABLE and errAborted", genErr, runErr)
			}
		} else if genErr != nil || o.finish != tandemv1.FinishReason_FINISH_REASON_LENGTH || o.tokens != 200 || !errors.Is(runErr, errDrained) {
			t.Errorf("drained: request ended %v after %d tokens, %v; run %v; want it finished", o.finish, o.tokens, genErr, runErr)
		}
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
// sent its activations, fails the request with UNAVAILABLE naming the key
// and stops the engine, promptly, never hanging the pipeline.
func TestUnreplayableStepFails(t *testing.T) {
	ckpt, tok := openTestModel(t, testModel(t))
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
	disp, err := graphs.NewDispatcher(graphs.Config{Mode: graphs.FullAndPiecewise, MaxCaptureSize: testSched.MaxNumBatchedTokens, MaxNumSeqs: testSched.MaxNumSeqs})
	if err != nil {
		t.Fatal(err)
	}
	e, err := newEngine(d, 1, testSched, disp)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- e.run() }()
	t.Cleanup(func() {
		e.abort(errors.New("test over"))
		<-e.done
	})
	s := frontend.New(cfg, tok, staticEngines{e})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	_, _, err = collectGenerate(ctx, s, &tandemv1.GenerateRequest{Prompt: "Hello", MaxTokens: 4})
	err = apierr.GRPC(err) // as the Generate RPC answers it
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "stage cpu [2,4) cannot replay key PIECEWISE tokens=4") {
		t.Fatalf("generate: %v (code %v), want UNAVAILABLE naming the key the stage cannot replay", err, status.Code(err))
	}
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "stage 1 failed") {
			t.Errorf("engine stopped with %v, want stage 1's failure", err)
		}
	case <-ctx.Done():
		t.Fatal("the engine did not stop after the failed step")
	}
	rows := e.graphs.Snapshot()
	if len(rows) != 1 || rows[0] != (graphs.Row{Unpadded: 4, Padded: 4, Mode: graphs.Piecewise, Count: 1}) {
		t.Errorf("dispatch statistics %+v, want the prompt's one PIECEWISE step of 4 tokens", rows)
	}
	t.Logf("the failed step ended the request and the engine in %v", time.Since(start).Round(time.Millisecond))
}
