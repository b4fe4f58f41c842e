package main

import (
	"context"
	"encoding/json"
	"io"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// TestBench runs bench against a one-node daemon: 8 requests of 8 tokens,
// 4 at a time, must generate 64 tokens with positive figures, in JSON and
// in the table.
func TestBench(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "m")
	if _, err := run(t, "", "model", "init", "--out", dir, "--vocab", "300"); err != nil {
		t.Fatal(err)
	}
	addr := startDaemon(t, dir, "tok-b")
	args := []string{"bench", "--addr", addr, "--token", "tok-b", "--concurrency", "4", "--requests", "8", "--prompt-tokens", "12", "--max-tokens", "8", "--vocab", "300"}
	out, err := run(t, "", append(args, "--json")...)
	if err != nil {
		t.Fatal(err)
	}
	var r benchResult
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatalf("bench --json printed %q: %v", out, err)
	}
	if r.Requests != 8 || r.Concurrency != 4 || r.GeneratedTokens != 8*8 || r.WallS <= 0 || r.TokensPerS <= 0 ||
		r.TTFTP50Ms <= 0 || r.TTFTP99Ms < r.TTFTP50Ms || r.ITLP50Ms <= 0 || r.ITLP99Ms < r.ITLP50Ms {
		t.Errorf("bench --json: %+v, want 64 tokens of 8 requests and positive, ordered figures", r)
	}
	if got := r.TokensPerS * r.WallS; got < 63.9 || got > 64.1 {
		t.Errorf("tokens/s × wall = %.2f, want 64", got)
	}
	// The one stage's busy fraction over the run, from its own timing.
	if len(r.Stages) != 1 || r.Stages[0].Node != "solo" || r.Stages[0].Busy <= 0 || r.Stages[0].Busy > 1.05 || r.Stages[0].DeviceBusy != 0 {
		t.Errorf("bench --json stages %+v: want the CPU stage on solo, busy in (0, 1], no device time", r.Stages)
	}
	out, err = run(t, "", args...)
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{"requests:          8 (4 at a time, 12 prompt tokens each)", "generated tokens:  64", "tokens/s", "time to 1st token: p50", "stage 0 busy:"} {
		if !strings.Contains(out, w) {
			t.Errorf("bench table lacks %q:\n%s", w, out)
		}
	}
	if _, err := run(t, "", "bench", "--addr", addr, "--token", "tok-b", "--requests", "2", "--vocab", "100000"); err == nil || !strings.Contains(err.Error(), "InvalidArgument") {
		t.Errorf("bench with ids beyond the vocabulary: %v, want InvalidArgument", err)
	}
}

// TestPercentileMs checks the nearest-rank percentile on small lists.
func TestPercentileMs(t *testing.T) {
	ms := func(v ...int) []time.Duration {
		var ds []time.Duration
		for _, x := range v {
			ds = append(ds, time.Duration(x)*time.Millisecond)
		}
		return ds
	}
	for _, c := range []struct {
		ds   []time.Duration
		p    int
		want float64
	}{
		{nil, 50, 0},
		{ms(7), 99, 7},
		{ms(4, 1, 3, 2), 50, 2},
		{ms(4, 1, 3, 2), 99, 4},
		{ms(1, 2, 3, 4, 5, 6, 7, 8, 9, 10), 90, 9},
	} {
		in := slices.Clone(c.ds)
		if got := percentileMs(c.ds, c.p); got != c.want {
			t.Errorf("percentileMs(%v, %d) = %v, want %v", c.ds, c.p, got, c.want)
		}
		if !slices.Equal(in, c.ds) {
			t.Errorf("percentileMs reordered its input")
		}
	}
}

// TestBenchPrompt checks the prompts are seeded, below the vocabulary and
// differ between requests.
func TestBenchPrompt(t *testing.T) {
	o := benchOptions{promptTokens: 50, vocab: 7, seed: 3}
	a, b := benchPrompt(o, 0), benchPrompt(o, 1)
	if !slices.Equal(a, benchPrompt(o, 0)) || slices.Equal(a, b) || len(a) != 50 {
		t.Errorf("prompts %v, %v: want 50 ids, the same for the same index, different between indices", a, b)
	}
	for _, id := range append(a, b...) {
		if id < 0 || id >= 7 {
			t.Errorf("id %d outside the vocabulary of 7", id)
		}
	}
}

// fakeInference answers Generate with maxTokens tokens in one message, but
// refuses every third call with RESOURCE_EXHAUSTED.
type fakeInference struct {
	mu    sync.Mutex
	calls int
}

func (f *fakeInference) Generate(ctx context.Context, in *tandemv1.GenerateRequest, _ ...grpc.CallOption) (grpc.ServerStreamingClient[tandemv1.GenerateResponse], error) {
	f.mu.Lock()
	f.calls++
	n := f.calls
	f.mu.Unlock()
	if n%3 == 0 {
		return nil, status.Error(codes.ResourceExhausted, "too many requests waiting")
	}
	ids := make([]int32, in.GetMaxTokens())
	return &fakeStream{msgs: []*tandemv1.GenerateResponse{{TokenIds: ids, Usage: &tandemv1.Usage{CompletionTokens: uint32(len(ids))}}}}, nil
}

type fakeStream struct {
	grpc.ClientStream
	msgs []*tandemv1.GenerateResponse
}

func (s *fakeStream) Recv() (*tandemv1.GenerateResponse, error) {
	if len(s.msgs) == 0 {
		return nil, io.EOF
	}
	m := s.msgs[0]
	s.msgs = s.msgs[1:]
	return m, nil
}

// TestBenchPartial: failed requests no longer stop bench; the figures are
// those of the requests that succeeded, and the failures are counted and
// grouped by error.
func TestBenchPartial(t *testing.T) {
	o := benchOptions{concurrency: 3, requests: 9, promptTokens: 4, maxTokens: 5, vocab: 10}
	res := runBench(context.Background(), &fakeInference{}, o)
	if res.Failed != 3 || res.GeneratedTokens != 6*5 || len(res.Failures) != 1 || res.Failures[0].Count != 3 ||
		!strings.Contains(res.Failures[0].Error, "ResourceExhausted") || res.TokensPerS <= 0 {
		t.Fatalf("bench with 3 of 9 requests refused: %+v", res)
	}
	var b strings.Builder
	if err := printBench(&b, res, false); err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{"failed:            3 (the figures below are the other 6's)", "3× rpc error: code = ResourceExhausted", "generated tokens:  30"} {
		if !strings.Contains(b.String(), w) {
			t.Errorf("bench table lacks %q:\n%s", w, b.String())
		}
	}
}
