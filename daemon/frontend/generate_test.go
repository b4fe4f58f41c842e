package frontend

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

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

// loopEngine runs a frontend's requests on a scheduler loop over a
// 2-stage pipeline in this process, whose stages the recorders wrap.
type loopEngine struct{ *sched.Loop }

func (e loopEngine) Engine() (Engine, error) { return e.Loop, nil }
func (e loopEngine) Ready() error            { return nil }

func startEngine(t *testing.T, ckpt *model.Checkpoint) (loopEngine, []*freeRecorder) {
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
	l, err := sched.Start(sched.Config{MaxNumBatchedTokens: 32, MaxNumSeqs: 4, BlockSize: sched.DefaultBlockSize, NumBlocks: testBlocks, MaxConcurrentBatches: 2, MaxModelLen: 2048}, d)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		l.Close()
		d.Close()
	})
	return loopEngine{l}, recs
}

// collectGenerate runs a request through the frontend and puts its
// messages together.
func collectGenerate(ctx context.Context, s *Server, req *tandemv1.GenerateRequest) (*tandemv1.GenerateResponse, int, error) {
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

// reference runs one request alone through the plain generation loop on a
// single-stage pipeline.
func referenceRun(t *testing.T, ckpt *model.Checkpoint, prompt []int32, maxTokens int, sp stage.Sampling) []stage.Sampled {
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
	err = pipeline.Generate(context.Background(), d, []pipeline.Request{{ID: 1, Prompt: prompt, MaxTokens: maxTokens, Sampling: sp}}, pipeline.GenerateOptions{MaxBatchTokens: 64}, func(ev pipeline.Event) error {
		out = append(out, ev.Token)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestGenerateHandler runs the Generate handler over a 2-stage pipeline:
// concurrent requests get the tokens and log-probabilities each gets alone
// from the plain generation loop, their text is the tokenizer's decode of
// their tokens, and a stop string ends a request on the token that
// completes it, freeing it on every stage.
func TestGenerateHandler(t *testing.T) {
	dir := testModel(t)
	ckpt, tok := openTestModel(t, dir)
	e, recs := startEngine(t, ckpt)
	s := New(testConfig(t, dir, ckpt, tok, e))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	reqs := []*tandemv1.GenerateRequest{
		{Prompt: "Hello there, general", MaxTokens: 9, Temperature: proto.Float32(0), IgnoreEos: true, Logprobs: proto.Uint32(3)},
		{PromptTokenIds: []int32{7, 8, 9, 200, 300, 301, 302, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 9}, MaxTokens: 12, Temperature: proto.Float32(0.8), TopK: proto.Int32(50), Seed: 3, IgnoreEos: true, Logprobs: proto.Uint32(1)},
		{Prompt: "x", MaxTokens: 5, Temperature: proto.Float32(1.5), TopP: proto.Float32(0.9), Seed: 8, IgnoreEos: true, Logprobs: proto.Uint32(0)},
	}
	got := make([]*tandemv1.GenerateResponse, len(reqs))
	errs := make([]error, len(reqs))
	var wg sync.WaitGroup
	for i, r := range reqs {
		wg.Go(func() { got[i], _, errs[i] = collectGenerate(ctx, s, r) })
	}
	wg.Wait()
	for i, r := range reqs {
		if errs[i] != nil {
			t.Fatalf("request %d: %v", i, errs[i])
		}
		g, _ := s.validate(r)
		want := referenceRun(t, ckpt, g.req.Prompt, int(r.GetMaxTokens()), g.req.Sampling)
		if len(got[i].GetTokenIds()) != len(want) || got[i].GetFinishReason() != tandemv1.FinishReason_FINISH_REASON_LENGTH {
			t.Fatalf("request %d: %d tokens, finish %v; want %d, length", i, len(got[i].GetTokenIds()), got[i].GetFinishReason(), len(want))
		}
		for j, w := range want {
			lp := got[i].GetLogprobs()[j]
			if got[i].GetTokenIds()[j] != w.Token || lp.GetLogprob() != w.Logprob || len(lp.GetTop()) != len(w.Top) {
				t.Fatalf("request %d token %d: %d %v, want %+v", i, j, got[i].GetTokenIds()[j], lp, w)
			}
		}
		if dec := tok.Decode(got[i].GetTokenIds(), true); got[i].GetText() != dec {
			t.Errorf("request %d: text %q, want the decode %q", i, got[i].GetText(), dec)
		}
	}

	// Stop on a piece of the first request's text: the text ends before
	// it, the tokens end with the one completing it.
	full := got[0]
	runes := []rune(full.GetText())
	stop := string(runes[len(runes)/2 : len(runes)/2+2])
	r := proto.Clone(reqs[0]).(*tandemv1.GenerateRequest)
	r.Stop = []string{stop}
	res, _, err := collectGenerate(ctx, s, r)
	if err != nil {
		t.Fatal(err)
	}
	wantText := full.GetText()[:strings.Index(full.GetText(), stop)]
	n := len(res.GetTokenIds())
	if res.GetText() != wantText || res.GetFinishReason() != tandemv1.FinishReason_FINISH_REASON_STOP || !slices.Equal(res.GetTokenIds(), full.GetTokenIds()[:n]) ||
		!strings.Contains(tok.Decode(res.GetTokenIds(), true), stop) || strings.Contains(tok.Decode(res.GetTokenIds()[:n-1], true), stop) {
		t.Errorf("stop %q: text %q, tokens %v, finish %v; want text %q ending at the token completing the stop", stop, res.GetText(), res.GetTokenIds(), res.GetFinishReason(), wantText)
	}
	deadline := time.Now().Add(5 * time.Second)
	for _, rec := range recs {
		for len(rec.freedSeqs()) < len(reqs)+1 && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		if len(rec.freedSeqs()) != len(reqs)+1 {
			t.Errorf("a stage freed %v, want all %d requests", rec.freedSeqs(), len(reqs)+1)
		}
	}
}

// TestCancelFrees checks that a client leaving mid-stream cancels its
// request: the stages free it and the scheduler holds nothing.
func TestCancelFrees(t *testing.T) {
	dir := testModel(t)
	ckpt, tok := openTestModel(t, dir)
	e, recs := startEngine(t, ckpt)
	s := New(testConfig(t, dir, ckpt, tok, e))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	errGone := errors.New("client gone")
	msgs := 0
	err := s.GenerateTo(ctx, &tandemv1.GenerateRequest{Prompt: "Go", MaxTokens: 1000, IgnoreEos: true}, func(*tandemv1.GenerateResponse) error {
		if msgs++; msgs == 3 {
			return errGone
		}
		return nil
	})
	if !errors.Is(err, errGone) {
		t.Fatalf("generate: %v, want the send error", err)
	}
	start := time.Now()
	for {
		st := e.Stats()
		freed := 0
		for _, rec := range recs {
			freed += len(rec.freedSeqs())
		}
		if st.Running+st.Waiting+st.KVBlocksUsed == 0 && st.Cancelled == 1 && freed == len(recs) {
			break
		}
		if time.Since(start) > 5*time.Second {
			t.Fatalf("5s after the client left: stats %+v, stages freed %d sequences, want the request freed everywhere", st, freed)
		}
		time.Sleep(2 * time.Millisecond)
	}
	t.Logf("request freed on every stage %v after the client left", time.Since(start).Round(time.Microsecond))
}
