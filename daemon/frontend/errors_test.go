package frontend

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/tandem-llm/tandem/daemon/apierr"
	"github.com/tandem-llm/tandem/daemon/openai"
	"github.com/tandem-llm/tandem/pipeline"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
	"github.com/tandem-llm/tandem/sched"
	"github.com/tandem-llm/tandem/stage"
	"github.com/tandem-llm/tandem/stage/cpu"
)

// TestOpenAIError checks the mapping of the frontend's domain errors onto
// the OpenAI API's kinds: each kind to its own, the message kept as it
// is, context errors and errors of no kind unchanged.
func TestOpenAIError(t *testing.T) {
	for _, tc := range []struct {
		err  error
		kind error // nil: none of the API's kinds
	}{
		{apierr.Invalidf("prompt is empty"), openai.ErrInvalid},
		{apierr.Exhaustedf("too large to ever run: 9000 positions"), openai.ErrInvalid},
		{apierr.Overloadedf("1024 requests wait"), openai.ErrOverloaded},
		{apierr.Unavailablef("node a is draining"), openai.ErrUnavailable},
		{NotLeader("b", "10.0.0.2:7400"), openai.ErrUnavailable},
		{apierr.Preconditionf("stale epoch"), openai.ErrUnavailable},
		{apierr.Internalf("stage 1 failed the request"), nil},
		{context.Canceled, nil},
		{fmt.Errorf("wrapped: %w", context.DeadlineExceeded), nil},
		{errors.New("something else"), nil},
		{nil, nil},
	} {
		got := openaiError(tc.err)
		for _, k := range []error{openai.ErrInvalid, openai.ErrUnavailable, openai.ErrOverloaded} {
			if errors.Is(got, k) != (k == tc.kind) {
				t.Errorf("%v: maps to %v, want kind %v", tc.err, got, tc.kind)
			}
		}
		if tc.err != nil && (got.Error() != tc.err.Error() || !errors.Is(got, tc.err)) {
			t.Errorf("%v: mapped to %q, want the same message, wrapping it", tc.err, got)
		}
	}
}

// failingLast is a last stage that cannot sample any row: every sampled
// row comes back with an error, as a row of non-finite logits does.
type failingLast struct{ stage.Stage }

func (f failingLast) Forward(ctx context.Context, b *stage.Batch) (*stage.Output, error) {
	out, err := f.Stage.Forward(ctx, b)
	if err != nil {
		return nil, err
	}
	for i := range out.Sampled {
		out.Sampled[i].Err = "cpu stage [2,4): sequence " + strconv.FormatUint(out.Sampled[i].Seq, 10) + ": logits row holds NaN"
	}
	return out, nil
}

// TestRequestFailedOnAStage: a request a stage failed alone
// (sched.ErrRequestFailed) ends as INTERNAL over gRPC and 500 over HTTP,
// the message naming the stage.
func TestRequestFailedOnAStage(t *testing.T) {
	dir := testModel(t)
	ckpt, tok := openTestModel(t, dir)
	cfg := ckpt.Config()
	var stages []stage.Stage
	for _, r := range [][2]int{{0, 2}, {2, cfg.NumLayers}} {
		st, err := cpu.New(cpu.Config{Model: cfg, Lo: r[0], Hi: r[1], Weights: ckpt, MaxTokens: 32, MaxSeqs: 4, NumBlocks: testBlocks, BlockSize: sched.DefaultBlockSize})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		stages = append(stages, st)
	}
	stages[1] = failingLast{stages[1]}
	d, err := pipeline.StartLocal(context.Background(), stages)
	if err != nil {
		t.Fatal(err)
	}
	l, err := sched.Start(sched.Config{MaxNumBatchedTokens: 32, MaxNumSeqs: 4, NumBlocks: testBlocks, MaxConcurrentBatches: 2}, d)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		l.Close()
		d.Close()
	})
	s := New(testConfig(t, dir, ckpt, tok, loopEngine{l}))
	_, _, err = collectGenerate(context.Background(), s, &tandemv1.GenerateRequest{Prompt: "Hello", MaxTokens: 4})
	if st := status.Convert(apierr.GRPC(err)); st.Code() != codes.Internal || !strings.Contains(st.Message(), "stage 1: cpu stage [2,4)") {
		t.Errorf("gRPC: %v, want INTERNAL naming the stage", err)
	}
	api := httptest.NewServer(openai.New(openai.Config{Engine: s.OpenAI()}))
	defer api.Close()
	resp, err := http.Post(api.URL+"/v1/completions", "application/json", strings.NewReader(`{"model":"tiny","prompt":"Hello","max_tokens":4}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusInternalServerError || !strings.Contains(string(body), "stage 1: cpu stage [2,4)") {
		t.Errorf("HTTP: %d %s, want 500 naming the stage", resp.StatusCode, body)
	}
}
