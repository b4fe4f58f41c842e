package pipeline_test

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/randinit"
	"github.com/tandem-llm/tandem/pipeline"
	"github.com/tandem-llm/tandem/stage"
	"github.com/tandem-llm/tandem/stage/cpu"
)

// newPipeline builds a local pipeline of CPU stages over a small random
// checkpoint, split at the given layers.
func newPipeline(t *testing.T, ckpt *model.Checkpoint, splits ...int) *pipeline.Driver {
	t.Helper()
	cfg := ckpt.Config()
	bounds := append(append([]int{0}, splits...), cfg.NumLayers)
	var stages []stage.Stage
	for i := 0; i+1 < len(bounds); i++ {
		st, err := cpu.New(cpu.Config{Model: cfg, Lo: bounds[i], Hi: bounds[i+1], Weights: ckpt, MaxTokens: 64, MaxSeqs: 8})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		stages = append(stages, st)
	}
	d, err := pipeline.StartLocal(context.Background(), stages)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := d.Close(); err != nil {
			t.Error(err)
		}
	})
	return d
}

func openModel(t *testing.T) *model.Checkpoint {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "m")
	o := randinit.DefaultOptions()
	o.Seed = 3
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

func requests(vocab int) []pipeline.Request {
	var reqs []pipeline.Request
	for i, n := range []int{9, 3, 17, 1} {
		p := make([]int32, n)
		for j := range p {
			p[j] = int32((i*101 + j*7 + 5) % vocab)
		}
		reqs = append(reqs, pipeline.Request{
			ID: uint64(i + 10), Prompt: p, MaxTokens: 6 + i,
			Sampling: stage.Sampling{Temperature: float32(i % 2), TopK: 20, Seed: uint64(i)},
		})
	}
	return reqs
}

func collect(t *testing.T, d *pipeline.Driver, reqs []pipeline.Request, o pipeline.GenerateOptions) map[uint64][]pipeline.Event {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	got := map[uint64][]pipeline.Event{}
	err := pipeline.Generate(ctx, d, reqs, o, func(ev pipeline.Event) error {
		got[ev.Request] = append(got[ev.Request], ev)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return got
}

func tokens(evs []pipeline.Event) []int32 {
	var out []int32
	for _, ev := range evs {
		out = append(out, ev.Token.Token)
	}
	return out
}

// TestGenerateBatchingInvariant checks that batching and chunking do not
// change results: each request run alone with whole prefills is the
// reference; all requests together, with prompts chunked by a small token
// budget over a 2-stage pipeline, must give the same tokens (greedy and
// seeded sampling alike).
func TestGenerateBatchingInvariant(t *testing.T) {
	ckpt := openModel(t)
	reqs := requests(ckpt.Config().VocabSize)
	want := map[uint64][]int32{}
	alone := newPipeline(t, ckpt)
	for _, r := range reqs {
		evs := collect(t, alone, []pipeline.Request{r}, pipeline.GenerateOptions{})[r.ID]
		want[r.ID] = tokens(evs)
		if len(evs) != r.MaxTokens || evs[len(evs)-1].Finish != "length" {
			t.Fatalf("request %d alone: %d tokens, last finish %q; want %d ending in length", r.ID, len(evs), evs[len(evs)-1].Finish, r.MaxTokens)
		}
	}
	for _, budget := range []int{0, 4, 7} {
		t.Run(fmt.Sprintf("budget=%d", budget), func(t *testing.T) {
			got := collect(t, newPipeline(t, ckpt, 2), reqs, pipeline.GenerateOptions{MaxBatchTokens: budget})
			for _, r := range reqs {
				if g := tokens(got[r.ID]); !slices.Equal(g, want[r.ID]) {
					t.Errorf("request %d: tokens %v, want %v (alone)", r.ID, g, want[r.ID])
				}
			}
		})
	}
}

// TestGenerateStopToken checks that a stop token ends a request at once,
// is reported with finish "stop", and leaves other requests running.
func TestGenerateStopToken(t *testing.T) {
	ckpt := openModel(t)
	reqs := requests(ckpt.Config().VocabSize)[:2]
	d := newPipeline(t, ckpt)
	free := collect(t, d, reqs, pipeline.GenerateOptions{})
	// Stop request 0 on its third free-running token.
	stopAt := free[reqs[0].ID][2].Token.Token
	cut := slices.Index(tokens(free[reqs[0].ID]), stopAt) // first occurrence
	reqs[0].StopTokens = []int32{stopAt}
	got := collect(t, d, reqs, pipeline.GenerateOptions{})
	evs := got[reqs[0].ID]
	if len(evs) != cut+1 || evs[cut].Finish != "stop" || evs[cut].Token.Token != stopAt {
		t.Errorf("request %d: %d tokens ending %+v; want %d ending with stop token %d", reqs[0].ID, len(evs), evs[len(evs)-1], cut+1, stopAt)
	}
	if g, w := tokens(got[reqs[1].ID]), tokens(free[reqs[1].ID]); !slices.Equal(g, w) {
		t.Errorf("request %d changed by another's stop: %v, want %v", reqs[1].ID, g, w)
	}
}

func TestGenerateRejectsBadRequests(t *testing.T) {
	ckpt := openModel(t)
	d := newPipeline(t, ckpt)
	ok := pipeline.Request{ID: 1, Prompt: []int32{1, 2}, MaxTokens: 2}
	for _, tc := range []struct {
		name string
		reqs []pipeline.Request
		o    pipeline.GenerateOptions
		want string
	}{
		{"empty prompt", []pipeline.Request{{ID: 1, MaxTokens: 2}}, pipeline.GenerateOptions{}, "empty prompt"},
		{"no tokens to generate", []pipeline.Request{{ID: 1, Prompt: []int32{1}}}, pipeline.GenerateOptions{}, "max tokens 0"},
		{"past the context", []pipeline.Request{ok}, pipeline.GenerateOptions{MaxContext: 3}, "exceeds the context length 3"},
		{"duplicate id", []pipeline.Request{ok, ok}, pipeline.GenerateOptions{}, "duplicate id"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := pipeline.Generate(context.Background(), d, tc.reqs, tc.o, func(pipeline.Event) error { return nil })
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
	// The pipeline still serves after refusing them.
	if got := collect(t, d, []pipeline.Request{ok}, pipeline.GenerateOptions{}); len(got[1]) != 2 {
		t.Errorf("after bad requests: %d tokens, want 2", len(got[1]))
	}
}

// TestStageFailureReported checks that a batch a stage refuses is an error
// naming the stage, not a hang.
func TestStageFailureReported(t *testing.T) {
	ckpt := openModel(t)
	d := newPipeline(t, ckpt, 1, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b := stage.Batch{ID: 1, Seqs: []stage.Seq{{ID: 1, Pos: 5, Tokens: []int32{1}, Sample: true}}} // position gap
	_, err := d.Step(ctx, &pipeline.Step{Batch: b})
	if err == nil || !strings.Contains(err.Error(), "stage 0") {
		t.Fatalf("error %v, want a failure of stage 0", err)
	}
	t.Log(err)
}
