package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/protobuf/proto"

	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// benchOptions are the bench command's flags.
type benchOptions struct {
	concurrency  int
	requests     int
	promptTokens int
	maxTokens    uint32
	vocab        int
	seed         uint64
	asJSON       bool
}

// benchResult is what bench prints. Latencies are in milliseconds.
type benchResult struct {
	Concurrency     int     `json:"concurrency"`
	Requests        int     `json:"requests"`
	PromptTokens    int     `json:"prompt_tokens"`
	GeneratedTokens int     `json:"generated_tokens"`
	WallS           float64 `json:"wall_s"`
	TokensPerS      float64 `json:"tokens_per_s"`
	TTFTP50Ms       float64 `json:"ttft_p50_ms"`
	TTFTP99Ms       float64 `json:"ttft_p99_ms"`
	ITLP50Ms        float64 `json:"itl_p50_ms"`
	ITLP99Ms        float64 `json:"itl_p99_ms"`
	// Failed requests are left out of every figure above but Requests
	// and WallS; Failures groups their errors, most frequent first.
	Failed   int            `json:"failed"`
	Failures []benchFailure `json:"failures,omitempty"`
	// Stages is how busy each stage of the leader's pipeline was over the
	// run, from the stages' own timing (empty when the leader's status
	// cannot be read: no admin token, or another pipeline at the end).
	Stages []benchStage `json:"stages,omitempty"`
}

// benchStage is a stage's busy fraction over a bench run: its forward
// passes' time, and their device time (0 where not measured), over the
// wall time.
type benchStage struct {
	Stage      int     `json:"stage"`
	Node       string  `json:"node"`
	Busy       float64 `json:"busy"`
	DeviceBusy float64 `json:"device_busy"`
}

// benchFailure is one error and how many requests failed with it.
type benchFailure struct {
	Count int    `json:"count"`
	Error string `json:"error"`
}

// requestTiming is what one streamed request measured.
type requestTiming struct {
	tokens int
	ttft   time.Duration
	// itl holds one gap per token after the first: a message of k tokens
	// arriving d after the previous message (or the request's start)
	// counts a gap of d/k for each of its tokens but the request's first.
	itl []time.Duration
}

func newBenchCmd() *cobra.Command {
	var (
		c clientFlags
		o benchOptions
	)
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Measure the cluster's throughput and latency with concurrent requests",
		Long: `Send --requests Generate calls, --concurrency of them at a time, over one
gRPC connection. Each prompt is --prompt-tokens random token ids below
--vocab (seeded by --seed and the request's index); each request generates
exactly --max-tokens tokens, greedy and past end-of-sequence tokens. Prints
the requests, the tokens generated, the wall time, tokens/s, and the p50
and p99 of the time to first token and of the inter-token latency (--json:
one JSON object). A failed request does not stop the others: the figures
are those of the requests that succeeded, the failures are counted and
their errors listed, and the command then exits with an error.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if o.concurrency < 1 || o.requests < 1 || o.promptTokens < 1 || o.maxTokens < 1 || o.vocab < 1 {
				return errors.New("--concurrency, --requests, --prompt-tokens, --max-tokens and --vocab must be at least 1")
			}
			conn, ctx, done, err := c.open(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			admin := tandemv1.NewAdminClient(conn)
			before, _ := admin.Status(ctx, &tandemv1.StatusRequest{})
			res := runBench(ctx, tandemv1.NewInferenceClient(conn), o)
			if after, err := admin.Status(ctx, &tandemv1.StatusRequest{}); err == nil && before != nil {
				res.Stages = stagesBusy(before, after, res.WallS)
			}
			if err := printBench(cmd.OutOrStdout(), res, o.asJSON); err != nil {
				return err
			}
			if res.Failed > 0 {
				return fmt.Errorf("bench: %d of %d requests failed (%d× %s)", res.Failed, res.Requests, res.Failures[0].Count, res.Failures[0].Error)
			}
			return nil
		},
	}
	c.register(cmd.Flags())
	f := cmd.Flags()
	f.IntVar(&o.concurrency, "concurrency", 8, "requests in flight at a time")
	f.IntVar(&o.requests, "requests", 0, "requests in all (0: --concurrency)")
	f.IntVar(&o.promptTokens, "prompt-tokens", 64, "prompt length in tokens")
	f.Uint32Var(&o.maxTokens, "max-tokens", 128, "tokens to generate per request")
	f.IntVar(&o.vocab, "vocab", 256, "prompt token ids are below this (the model's vocabulary size or less)")
	f.Uint64Var(&o.seed, "seed", 1, "seed of the random prompts")
	f.BoolVar(&o.asJSON, "json", false, "print the figures as one JSON object")
	cmd.PreRun = func(*cobra.Command, []string) {
		if o.requests == 0 {
			o.requests = o.concurrency
		}
	}
	return cmd
}

// printBench prints the figures as a table or as one JSON object.
func printBench(out io.Writer, res benchResult, asJSON bool) error {
	if asJSON {
		b, err := json.Marshal(res)
		if err != nil {
			return err
		}
		_, err = fmt.Fprintln(out, string(b))
		return err
	}
	fmt.Fprintf(out, "requests:          %d (%d at a time, %d prompt tokens each)\n", res.Requests, res.Concurrency, res.PromptTokens)
	if res.Failed > 0 {
		fmt.Fprintf(out, "failed:            %d (the figures below are the other %d's)\n", res.Failed, res.Requests-res.Failed)
		for _, f := range res.Failures {
			fmt.Fprintf(out, "  %d× %s\n", f.Count, f.Error)
		}
	}
	fmt.Fprintf(out, "generated tokens:  %d\n", res.GeneratedTokens)
	fmt.Fprintf(out, "wall time:         %.3f s\n", res.WallS)
	fmt.Fprintf(out, "throughput:        %.1f tokens/s\n", res.TokensPerS)
	fmt.Fprintf(out, "time to 1st token: p50 %.2f ms, p99 %.2f ms\n", res.TTFTP50Ms, res.TTFTP99Ms)
	_, err := fmt.Fprintf(out, "inter-token:       p50 %.2f ms, p99 %.2f ms\n", res.ITLP50Ms, res.ITLP99Ms)
	for _, st := range res.Stages {
		dev := ""
		if st.DeviceBusy > 0 {
			dev = fmt.Sprintf(", device %.1f%%", 100*st.DeviceBusy)
		}
		_, err = fmt.Fprintf(out, "stage %d busy:      %.1f%%%s (%s)\n", st.Stage, 100*st.Busy, dev, st.Node)
	}
	return err
}

// stagesBusy is each stage's busy fraction over wall seconds, from the
// busy times two status reports of the same pipeline give (nil for
// another pipeline).
func stagesBusy(before, after *tandemv1.StatusResponse, wall float64) []benchStage {
	b, a := before.GetStages(), after.GetStages()
	if before.GetEpoch() != after.GetEpoch() || len(b) != len(a) || wall <= 0 {
		return nil
	}
	var out []benchStage
	for i := range a {
		busy := a[i].GetBusy().AsDuration() - b[i].GetBusy().AsDuration()
		dev := a[i].GetDeviceBusy().AsDuration() - b[i].GetDeviceBusy().AsDuration()
		out = append(out, benchStage{Stage: i, Node: a[i].GetNode(), Busy: busy.Seconds() / wall, DeviceBusy: dev.Seconds() / wall})
	}
	return out
}

// runBench sends o.requests requests, o.concurrency at a time, and sums up
// the timings of those that succeed; a failed request is counted with its
// error and the others go on.
func runBench(ctx context.Context, client tandemv1.InferenceClient, o benchOptions) benchResult {
	next := make(chan int)
	timings := make([]requestTiming, o.requests)
	errs := make([]error, o.requests)
	var wg sync.WaitGroup
	start := time.Now()
	for range min(o.concurrency, o.requests) {
		wg.Go(func() {
			for i := range next {
				timings[i], errs[i] = benchRequest(ctx, client, benchPrompt(o, i), o.maxTokens)
			}
		})
	}
	for i := range o.requests {
		next <- i
	}
	close(next)
	wg.Wait()
	wall := time.Since(start)
	res := benchResult{Concurrency: o.concurrency, Requests: o.requests, PromptTokens: o.promptTokens, WallS: wall.Seconds()}
	var ttft, itl []time.Duration
	counts := map[string]int{}
	for i, t := range timings {
		if errs[i] != nil {
			res.Failed++
			counts[errs[i].Error()]++
			continue
		}
		res.GeneratedTokens += t.tokens
		ttft = append(ttft, t.ttft)
		itl = append(itl, t.itl...)
	}
	for msg, n := range counts {
		res.Failures = append(res.Failures, benchFailure{Count: n, Error: msg})
	}
	slices.SortFunc(res.Failures, func(a, b benchFailure) int {
		return cmp.Or(cmp.Compare(b.Count, a.Count), cmp.Compare(a.Error, b.Error))
	})
	res.TokensPerS = float64(res.GeneratedTokens) / wall.Seconds()
	res.TTFTP50Ms, res.TTFTP99Ms = percentileMs(ttft, 50), percentileMs(ttft, 99)
	res.ITLP50Ms, res.ITLP99Ms = percentileMs(itl, 50), percentileMs(itl, 99)
	return res
}

// benchPrompt is request i's prompt: o.promptTokens ids below o.vocab,
// the same for the same seed and index.
func benchPrompt(o benchOptions, i int) []int32 {
	r := rand.New(rand.NewPCG(o.seed, uint64(i)))
	ids := make([]int32, o.promptTokens)
	for k := range ids {
		ids[k] = int32(r.IntN(o.vocab))
	}
	return ids
}

// benchRequest streams one greedy request and times its messages. The
// tokens counted are the final message's completion tokens, which must
// equal the token ids streamed.
func benchRequest(ctx context.Context, client tandemv1.InferenceClient, prompt []int32, maxTokens uint32) (requestTiming, error) {
	var t requestTiming
	start := time.Now()
	stream, err := client.Generate(ctx, &tandemv1.GenerateRequest{PromptTokenIds: prompt, MaxTokens: maxTokens, IgnoreEos: true, Temperature: proto.Float32(0)})
	if err != nil {
		return t, err
	}
	last := start
	var usage *tandemv1.Usage
	for {
		msg, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return t, err
		}
		now := time.Now()
		if n := len(msg.GetTokenIds()); n > 0 {
			if t.tokens == 0 {
				t.ttft = now.Sub(start)
				n--
			}
			for range n {
				t.itl = append(t.itl, now.Sub(last)/time.Duration(len(msg.GetTokenIds())))
			}
			t.tokens += len(msg.GetTokenIds())
			last = now
		}
		if msg.GetUsage() != nil {
			usage = msg.GetUsage()
		}
	}
	if usage == nil {
		return t, errors.New("the stream ended without its final message")
	}
	if int(usage.GetCompletionTokens()) != t.tokens {
		return t, fmt.Errorf("usage reports %d completion tokens, the stream carried %d", usage.GetCompletionTokens(), t.tokens)
	}
	return t, nil
}

// percentileMs is the nearest-rank p-th percentile of ds in milliseconds
// (0 when ds is empty).
func percentileMs(ds []time.Duration, p int) float64 {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	k := (p*len(s) + 99) / 100
	return float64(s[max(k, 1)-1]) / float64(time.Millisecond)
}
