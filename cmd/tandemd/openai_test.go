package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	oa "github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	pmodel "github.com/prometheus/common/model"
	"google.golang.org/protobuf/proto"

	"github.com/tandem-llm/tandem/daemon/frontend"
	"github.com/tandem-llm/tandem/daemon/textout"
	"github.com/tandem-llm/tandem/model/fortune"
	"github.com/tandem-llm/tandem/model/tokenizer"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// openaiCluster is a cluster of real daemons serving the built-in model,
// its leader with the OpenAI API on, and what the tests sent it.
type openaiCluster struct {
	*localCluster
	logs   *logBuffer
	dir    string
	tok    *tokenizer.Tokenizer
	base   string // the API's base URL, http://HOST:PORT/v1
	client oa.Client
	sent   apiWorkload
}

// apiWorkload counts what the requests sent so far should show in the
// metrics.
type apiWorkload struct {
	prompt, generated  int            // tokens
	firstTokens        int            // requests that got a token
	interTokens        int            // gaps between two tokens of a request
	finished           map[string]int // by reason
	completeByLifetime int            // requests that finished with a reason
}

// add counts a request that finished with reason after generating
// generated tokens from a prompt of prompt tokens.
func (w *apiWorkload) add(prompt, generated int, reason string) {
	w.prompt += prompt
	w.generated += generated
	w.firstTokens++
	w.interTokens += generated - 1
	w.finished[reason]++
	w.completeByLifetime++
}

// defaultTemperature is the temperature the test writes into the model's
// generation_config.json, with defaultTopP: requests that leave them unset
// sample with them.
const (
	defaultTemperature = 0.8
	defaultTopP        = 0.9
)

// startOpenAICluster serves the built-in model on a leader and two stage
// daemons; the leader serves the OpenAI API with vLLM's metric names.
// The model's generation_config.json gains sampling defaults.
func startOpenAICluster(t *testing.T, ctx context.Context) *openaiCluster {
	t.Helper()
	dir := filepath.Join(t.TempDir(), fortune.Name)
	if err := fortune.Write(dir); err != nil {
		t.Fatal(err)
	}
	genPath := filepath.Join(dir, "generation_config.json")
	var gen map[string]any
	b, err := os.ReadFile(genPath)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &gen); err != nil {
		t.Fatal(err)
	}
	gen["temperature"], gen["top_p"] = defaultTemperature, defaultTopP
	if b, err = json.Marshal(gen); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(genPath, b, 0o644); err != nil {
		t.Fatal(err)
	}
	tok, err := tokenizer.Load(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		t.Fatal(err)
	}
	spec := clusterSpec{model: dir, stages: 2, leaderExtra: []string{"--http", "127.0.0.1:0", "--vllm-metric-names"}}
	c, logs := startClusterSpec(t, ctx, spec)
	if c.Leader.HTTP == "" {
		t.Fatal("the leader printed no http= address")
	}
	base := "http://" + c.Leader.HTTP + "/v1"
	return &openaiCluster{
		localCluster: c, logs: logs, dir: dir, tok: tok, base: base,
		client: oa.NewClient(option.WithBaseURL(base+"/"), option.WithAPIKey("unused"), option.WithMaxRetries(0)),
		sent:   apiWorkload{finished: map[string]int{}},
	}
}

// grpcGreedy runs a greedy Generate of prompt token ids with max tokens,
// the reference the HTTP API must match.
func (c *openaiCluster) grpcGreedy(t *testing.T, ctx context.Context, ids []int32, maxTokens int, ignoreEOS bool) generated {
	t.Helper()
	g, err := generate(ctx, c.Conn, &tandemv1.GenerateRequest{PromptTokenIds: ids, MaxTokens: uint32(maxTokens), IgnoreEos: ignoreEOS,
		Temperature: proto.Float32(0), Logprobs: proto.Uint32(2)})
	if err != nil {
		t.Fatal(err)
	}
	c.sent.add(len(ids), len(g.ids), finishName(g.finish))
	return g
}

func finishName(f tandemv1.FinishReason) string {
	return strings.ToLower(strings.TrimPrefix(f.String(), "FINISH_REASON_"))
}

// tokenize asks the API's /tokenize for what a chat renders to.
func (c *openaiCluster) tokenize(t *testing.T, body string) []int32 {
	t.Helper()
	code, resp := httpPost(t, "http://"+c.Leader.HTTP+"/tokenize", body)
	var got struct {
		Tokens []int32 `json:"tokens"`
	}
	if code != 200 || json.Unmarshal([]byte(resp), &got) != nil || len(got.Tokens) == 0 {
		t.Fatalf("/tokenize %s: %d %s", body, code, resp)
	}
	return got.Tokens
}

func httpPost(t *testing.T, url, body string) (int, string) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

func httpGet(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

// scrape parses the leader's /metrics (on the API's listener) with the
// Prometheus text parser.
func (c *openaiCluster) scrape(t *testing.T) map[string]*dto.MetricFamily {
	t.Helper()
	code, body := httpGet(t, "http://"+c.Leader.HTTP+"/metrics")
	if code != 200 {
		t.Fatalf("/metrics: %d %s", code, body)
	}
	parser := expfmt.NewTextParser(pmodel.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(strings.NewReader(body))
	if err != nil {
		t.Fatalf("parse /metrics: %v\n%s", err, body)
	}
	return fams
}

// scrapeIdle scrapes until no request runs or waits and the KV cache is
// empty: the scheduler publishes its state between steps, a moment after
// a request's last token reached its client.
func (c *openaiCluster) scrapeIdle(t *testing.T) map[string]*dto.MetricFamily {
	t.Helper()
	for start := time.Now(); ; time.Sleep(5 * time.Millisecond) {
		fams := c.scrape(t)
		idle := true
		for _, n := range []frontend.MetricName{frontend.NameRunning, frontend.NameWaiting, frontend.NameKVUsage} {
			idle = idle && value(sample(fams, n.Tandem, nil)) == 0
		}
		if idle {
			return fams
		}
		if time.Since(start) > 5*time.Second {
			return fams // checkMetrics reports what is left
		}
	}
}

// sample is the family's metric whose labels include want (nil: none).
func sample(fams map[string]*dto.MetricFamily, name string, want map[string]string) *dto.Metric {
next:
	for _, m := range fams[name].GetMetric() {
		labels := map[string]string{}
		for _, l := range m.GetLabel() {
			labels[l.GetName()] = l.GetValue()
		}
		for k, v := range want {
			if labels[k] != v {
				continue next
			}
		}
		return m
	}
	return nil
}

// value is a counter's or gauge's value, a histogram's count.
func value(m *dto.Metric) float64 {
	switch {
	case m.GetCounter() != nil:
		return m.GetCounter().GetValue()
	case m.GetGauge() != nil:
		return m.GetGauge().GetValue()
	case m.GetHistogram() != nil:
		return float64(m.GetHistogram().GetSampleCount())
	}
	return -1
}

// TestOpenAIAPI serves the built-in model on real tandemd processes with
// the leader's OpenAI API on, and drives it with the official client,
// github.com/openai/openai-go: streamed chat and non-streamed completions
// give the tokens and text greedy gRPC Generate gives for the same prompt
// tokens; stop strings, the checkpoint's sampling defaults (both APIs),
// errors with OpenAI's statuses; the SSE bytes of a stream; a client that
// leaves frees its request at once; /metrics parsed after the known
// apiWorkload (counts equal what was sent, under tandem's and vLLM's names)
// and still counting after the pipeline is rebuilt; 503 while no pipeline
// serves and while the leader drains.
func TestOpenAIAPI(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	c := startOpenAICluster(t, ctx)
	vllmLabels := map[string]string{"model_name": fortune.Name, "engine": "0"}

	t.Run("models and health", func(t *testing.T) {
		page, err := c.client.Models.List(ctx)
		if err != nil || len(page.Data) != 1 || page.Data[0].ID != fortune.Name {
			t.Fatalf("models: %+v, %v", page, err)
		}
		if code, body := httpGet(t, "http://"+c.Leader.HTTP+"/health"); code != 200 {
			t.Errorf("/health: %d %s", code, body)
		}
	})

	t.Run("chat streaming", func(t *testing.T) {
		msgs := `[{"role":"system","content":"Be wise."},{"role":"user","content":"What will happen to me?"}]`
		ids := c.tokenize(t, `{"model":"fortune","messages":`+msgs+`}`)
		want := c.grpcGreedy(t, ctx, ids, 24, false)
		stream := c.client.Chat.Completions.NewStreaming(ctx, oa.ChatCompletionNewParams{
			Model:               fortune.Name,
			Messages:            []oa.ChatCompletionMessageParamUnion{oa.SystemMessage("Be wise."), oa.UserMessage("What will happen to me?")},
			Temperature:         oa.Float(0),
			MaxCompletionTokens: oa.Int(24),
			StreamOptions:       oa.ChatCompletionStreamOptionsParam{IncludeUsage: oa.Bool(true)},
		})
		acc := oa.ChatCompletionAccumulator{}
		chunks := 0
		for stream.Next() {
			acc.AddChunk(stream.Current())
			chunks++
		}
		if err := stream.Err(); err != nil {
			t.Fatal(err)
		}
		ch := acc.Choices[0]
		if ch.Message.Content != want.text || string(ch.FinishReason) != finishName(want.finish) {
			t.Errorf("chat: %q (%s), gRPC gave %q (%s) for the same prompt tokens", ch.Message.Content, ch.FinishReason, want.text, finishName(want.finish))
		}
		if acc.Usage.PromptTokens != int64(len(ids)) || acc.Usage.CompletionTokens != int64(len(want.ids)) {
			t.Errorf("usage %+v, want %d prompt and %d completion tokens", acc.Usage, len(ids), len(want.ids))
		}
		c.sent.add(len(ids), int(acc.Usage.CompletionTokens), string(ch.FinishReason))
		t.Logf("streamed %d chunks: %q (%s)", chunks, ch.Message.Content, ch.FinishReason)
	})

	var greedy string // a greedy completion of "A wise man", for the stop test
	t.Run("completion", func(t *testing.T) {
		ids := c.tokenize(t, `{"prompt":"A wise man"}`)
		want := c.grpcGreedy(t, ctx, ids, 16, true)
		resp, err := c.client.Completions.New(ctx, oa.CompletionNewParams{
			Model:     fortune.Name,
			Prompt:    oa.CompletionNewParamsPromptUnion{OfString: oa.String("A wise man")},
			MaxTokens: oa.Int(16), Temperature: oa.Float(0), Logprobs: oa.Int(2),
		}, option.WithJSONSet("ignore_eos", true))
		if err != nil {
			t.Fatal(err)
		}
		got := resp.Choices[0]
		if got.Text != want.text || got.FinishReason != "length" || resp.Usage.PromptTokens != int64(len(ids)) || resp.Usage.CompletionTokens != 16 {
			t.Fatalf("completion %q (%s), usage %+v; gRPC gave %q for %d prompt tokens", got.Text, got.FinishReason, resp.Usage, want.text, len(ids))
		}
		for i, lp := range got.Logprobs.TokenLogprobs {
			if d := lp - float64(want.logprobs[i].GetLogprob()); d > 1e-4 || d < -1e-4 || len(got.Logprobs.TopLogprobs[i]) == 0 {
				t.Errorf("token %d: logprob %v, gRPC %v", i, lp, want.logprobs[i].GetLogprob())
			}
		}
		c.sent.add(len(ids), 16, "length")
		greedy = got.Text
		t.Logf("%q -> %q", "A wise man", got.Text)
	})

	t.Run("stop string", func(t *testing.T) {
		words := strings.Fields(greedy)
		if len(words) < 3 {
			t.Skipf("greedy completion %q too short to stop in", greedy)
		}
		stop := " " + words[2]
		stream := c.client.Completions.NewStreaming(ctx, oa.CompletionNewParams{
			Model:     fortune.Name,
			Prompt:    oa.CompletionNewParamsPromptUnion{OfString: oa.String("A wise man")},
			MaxTokens: oa.Int(16), Temperature: oa.Float(0),
			Stop:          oa.CompletionNewParamsStopUnion{OfString: oa.String(stop)},
			StreamOptions: oa.ChatCompletionStreamOptionsParam{IncludeUsage: oa.Bool(true)},
		}, option.WithJSONSet("ignore_eos", true))
		var text, finish string
		var usage oa.CompletionUsage
		for stream.Next() {
			ch := stream.Current()
			for _, c := range ch.Choices {
				text += c.Text
				if c.FinishReason != "" {
					finish = string(c.FinishReason)
				}
			}
			if ch.Usage.TotalTokens > 0 {
				usage = ch.Usage
			}
		}
		if err := stream.Err(); err != nil {
			t.Fatal(err)
		}
		if want := greedy[:strings.Index(greedy, stop)]; text != want || finish != "stop" {
			t.Errorf("stop %q: %q (%s), want %q (stop)", stop, text, finish, want)
		}
		c.sent.add(int(usage.PromptTokens), int(usage.CompletionTokens), "stop")
	})

	t.Run("sampling defaults", func(t *testing.T) {
		// Unset temperature and top_p take the checkpoint's (written into
		// its generation_config.json), in both APIs: the same tokens as
		// a request that sets them, for the same seed.
		ids := c.tokenize(t, `{"prompt":"Your lucky number"}`)
		explicit, err := generate(ctx, c.Conn, &tandemv1.GenerateRequest{PromptTokenIds: ids, MaxTokens: 12, IgnoreEos: true, Seed: 7,
			Temperature: proto.Float32(defaultTemperature), TopP: proto.Float32(defaultTopP)})
		if err != nil {
			t.Fatal(err)
		}
		unset, err := generate(ctx, c.Conn, &tandemv1.GenerateRequest{PromptTokenIds: ids, MaxTokens: 12, IgnoreEos: true, Seed: 7})
		if err != nil {
			t.Fatal(err)
		}
		greedyRun, err := generate(ctx, c.Conn, &tandemv1.GenerateRequest{PromptTokenIds: ids, MaxTokens: 12, IgnoreEos: true, Seed: 7, Temperature: proto.Float32(0)})
		if err != nil {
			t.Fatal(err)
		}
		for _, g := range []generated{explicit, unset, greedyRun} {
			c.sent.add(len(ids), len(g.ids), "length")
		}
		resp, err := c.client.Completions.New(ctx, oa.CompletionNewParams{
			Model: fortune.Name, Prompt: oa.CompletionNewParamsPromptUnion{OfArrayOfTokens: int64s(ids)}, MaxTokens: oa.Int(12), Seed: oa.Int(7),
		}, option.WithJSONSet("ignore_eos", true))
		if err != nil {
			t.Fatal(err)
		}
		c.sent.add(len(ids), int(resp.Usage.CompletionTokens), "length")
		if !slices.Equal(unset.ids, explicit.ids) || resp.Choices[0].Text != explicit.text {
			t.Errorf("unset sampling: gRPC %q, HTTP %q; explicit defaults %q", unset.text, resp.Choices[0].Text, explicit.text)
		}
		if slices.Equal(explicit.ids, greedyRun.ids) {
			t.Errorf("sampling at temperature %v gave the greedy tokens %v: the test cannot tell the defaults from greedy", defaultTemperature, greedyRun.ids)
		}
		t.Logf("defaults: %q; greedy: %q", explicit.text, greedyRun.text)
	})

	t.Run("errors", func(t *testing.T) {
		msgs := []oa.ChatCompletionMessageParamUnion{oa.UserMessage("Hi")}
		for _, tc := range []struct {
			name   string
			params oa.ChatCompletionNewParams
			status int
			param  string
		}{
			{"n", oa.ChatCompletionNewParams{Model: fortune.Name, Messages: msgs, N: oa.Int(2)}, 400, "n"},
			{"unknown model", oa.ChatCompletionNewParams{Model: "gpt-17", Messages: msgs}, 404, "model"},
			{"temperature", oa.ChatCompletionNewParams{Model: fortune.Name, Messages: msgs, Temperature: oa.Float(-1)}, 400, "temperature"},
			{"past the context", oa.ChatCompletionNewParams{Model: fortune.Name, Messages: msgs, MaxCompletionTokens: oa.Int(1 << 20)}, 400, "max_completion_tokens"},
			{"logprobs", oa.ChatCompletionNewParams{Model: fortune.Name, Messages: msgs, Logprobs: oa.Bool(true), TopLogprobs: oa.Int(21)}, 400, "top_logprobs"},
		} {
			_, err := c.client.Chat.Completions.New(ctx, tc.params)
			var apiErr *oa.Error
			if !errors.As(err, &apiErr) || apiErr.StatusCode != tc.status || apiErr.Param != tc.param {
				t.Errorf("%s: %v, want status %d naming %q", tc.name, err, tc.status, tc.param)
			}
		}
	})

	t.Run("SSE bytes", func(t *testing.T) {
		ids := c.tokenize(t, `{"prompt":"The meaning of life"}`)
		want := c.grpcGreedy(t, ctx, ids, 6, true)
		code, body := httpPost(t, c.base+"/completions", fmt.Sprintf(`{"model":"fortune","prompt":%s,"max_tokens":6,"temperature":0,"ignore_eos":true,"stream":true}`, jsonOf(ids)))
		c.sent.add(len(ids), 6, "length")
		m := regexp.MustCompile(`^data: \{"id":"(cmpl-[0-9a-f]{24})","object":"text_completion","created":(\d+),`).FindStringSubmatch(body)
		if code != 200 || m == nil {
			t.Fatalf("%d %q", code, body)
		}
		head := `data: {"id":"` + m[1] + `","object":"text_completion","created":` + m[2] + `,"model":"fortune","choices":[{"index":0,`
		// The text of each token, as the output processor releases it.
		text := textout.New(c.tok, textout.Config{})
		var exp strings.Builder
		for i, id := range want.ids {
			s := text.Add(id).Text
			if i == len(want.ids)-1 {
				s += text.Finish()
			}
			if s != "" {
				exp.WriteString(head + `"text":` + jsonOf(s) + `,"logprobs":null,"finish_reason":null}]}` + "\n\n")
			}
		}
		exp.WriteString(head + `"text":"","logprobs":null,"finish_reason":"length"}]}` + "\n\n" + "data: [DONE]\n\n")
		if body != exp.String() {
			t.Errorf("stream\n%s\nwant\n%s", body, exp.String())
		}
	})

	// The apiWorkload so far, against a scrape.
	checkMetrics := func(t *testing.T, fams map[string]*dto.MetricFamily, w apiWorkload) {
		t.Helper()
		for _, c := range []struct {
			name   frontend.MetricName
			labels map[string]string
			want   float64
		}{
			{frontend.NamePromptTokens, nil, float64(w.prompt)},
			{frontend.NameGenerationTokens, nil, float64(w.generated)},
			{frontend.NameFinished, map[string]string{"reason": "stop"}, float64(w.finished["stop"])},
			{frontend.NameFinished, map[string]string{"reason": "length"}, float64(w.finished["length"])},
			{frontend.NameFinished, map[string]string{"reason": "abort"}, float64(w.finished["abort"])},
			{frontend.NameTTFT, nil, float64(w.firstTokens)},
			{frontend.NameITL, nil, float64(w.interTokens)},
			{frontend.NameE2E, nil, float64(w.completeByLifetime)},
			{frontend.NameQueue, nil, float64(w.completeByLifetime)},
			{frontend.NamePrefill, nil, float64(w.completeByLifetime)},
			{frontend.NameDecode, nil, float64(w.completeByLifetime)},
			{frontend.NameInference, nil, float64(w.completeByLifetime)},
			{frontend.NameRunning, nil, 0},
			{frontend.NameWaiting, nil, 0},
			{frontend.NameKVUsage, nil, 0},
		} {
			tm := sample(fams, c.name.Tandem, c.labels)
			vl := map[string]string{}
			for k, v := range vllmLabels {
				vl[k] = v
			}
			if r, ok := c.labels["reason"]; ok {
				vl["finished_reason"] = r
			}
			vm := sample(fams, c.name.VLLM, vl)
			if tm == nil || vm == nil || value(tm) != c.want || value(vm) != c.want {
				t.Errorf("%s%v = %v, %s%v = %v; want %v", c.name.Tandem, c.labels, value(tm), c.name.VLLM, vl, value(vm), c.want)
			}
			if h := tm.GetHistogram(); h != nil && h.GetSampleSum() != vm.GetHistogram().GetSampleSum() {
				t.Errorf("%s sums to %v, %s to %v", c.name.Tandem, h.GetSampleSum(), c.name.VLLM, vm.GetHistogram().GetSampleSum())
			}
		}
		// vLLM's buckets.
		for name, want := range map[string][]float64{
			"vllm:time_to_first_token_seconds": {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0},
			"vllm:inter_token_latency_seconds": {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0},
			"vllm:e2e_request_latency_seconds": {0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0},
		} {
			var got []float64
			for _, b := range sample(fams, name, nil).GetHistogram().GetBucket() {
				if !math.IsInf(b.GetUpperBound(), 1) {
					got = append(got, b.GetUpperBound())
				}
			}
			if !slices.Equal(got, want) {
				t.Errorf("%s buckets %v, want vLLM's %v", name, got, want)
			}
		}
	}

	t.Run("metrics", func(t *testing.T) {
		fams := c.scrapeIdle(t)
		checkMetrics(t, fams, c.sent)
		for _, n := range frontend.MetricNames {
			if fams[n.Tandem] == nil || fams[n.VLLM] == nil {
				t.Errorf("%s or %s missing from the scrape", n.Tandem, n.VLLM)
			}
		}
		t.Logf("%d requests: %d prompt and %d generated tokens; TTFT sum %.4fs", c.sent.firstTokens, c.sent.prompt, c.sent.generated,
			sample(fams, frontend.NameTTFT.Tandem, nil).GetHistogram().GetSampleSum())
	})

	t.Run("client leaves", func(t *testing.T) {
		// A client that reads two chunks of a long stream and hangs up:
		// its request is freed at once, counted as aborted.
		ids := c.tokenize(t, `{"prompt":"Once upon a time"}`)
		cctx, leave := context.WithCancel(ctx)
		stream := c.client.Completions.NewStreaming(cctx, oa.CompletionNewParams{
			Model: fortune.Name, Prompt: oa.CompletionNewParamsPromptUnion{OfString: oa.String("Once upon a time")}, MaxTokens: oa.Int(400),
		}, option.WithJSONSet("ignore_eos", true))
		for range 2 {
			if !stream.Next() {
				t.Fatalf("stream ended: %v", stream.Err())
			}
		}
		fams := c.scrape(t)
		if v := value(sample(fams, frontend.NameRunning.Tandem, nil)); v != 1 {
			t.Errorf("while streaming: %v requests running, want 1", v)
		}
		leave()
		stream.Close()
		start := time.Now()
		for {
			fams = c.scrape(t)
			if value(sample(fams, frontend.NameRunning.Tandem, nil)) == 0 && value(sample(fams, frontend.NameKVUsage.Tandem, nil)) == 0 &&
				value(sample(fams, frontend.NameFinished.Tandem, map[string]string{"reason": "abort"})) == 1 {
				break
			}
			if time.Since(start) > 5*time.Second {
				t.Fatalf("5s after the client left: running %v, KV usage %v, aborted %v", value(sample(fams, frontend.NameRunning.Tandem, nil)),
					value(sample(fams, frontend.NameKVUsage.Tandem, nil)), value(sample(fams, frontend.NameFinished.Tandem, map[string]string{"reason": "abort"})))
			}
			time.Sleep(5 * time.Millisecond)
		}
		t.Logf("the request was freed (nothing running, KV cache empty) %v after the client left", time.Since(start).Round(time.Millisecond))
		// The tokens it generated before the frontend saw it leave are
		// counted, but only the scrape knows how many (at least the two
		// read).
		gen := int(value(sample(fams, frontend.NameGenerationTokens.Tandem, nil))) - c.sent.generated
		if gen < 2 {
			t.Errorf("%d tokens of the aborted request counted, want at least the 2 read", gen)
		}
		c.sent.finished["abort"]++
		c.sent.firstTokens++
		c.sent.generated += gen
		c.sent.interTokens += gen - 1
		c.sent.prompt += len(ids)
		checkMetrics(t, fams, c.sent)
	})

	t.Run("no pipeline, then rebuilt", func(t *testing.T) {
		// The leader's counters of the pipeline before: they must go on
		// counting on the next.
		sum := func(fams map[string]*dto.MetricFamily, name string) float64 {
			var v float64
			for _, m := range fams[name].GetMetric() {
				v += value(m)
			}
			return v
		}
		before := c.scrapeIdle(t)
		// Both stage daemons leave: no pipeline can serve.
		for _, p := range c.Stages {
			if err := p.stop(30 * time.Second); err != nil {
				t.Fatal(err)
			}
		}
		for start := time.Now(); ; time.Sleep(20 * time.Millisecond) {
			code, body := httpGet(t, "http://"+c.Leader.HTTP+"/health")
			if code == 503 && strings.Contains(body, "service_unavailable") {
				break
			}
			if time.Since(start) > 20*time.Second {
				t.Fatalf("/health with no stage left: %d %s", code, body)
			}
		}
		_, err := c.client.Chat.Completions.New(ctx, oa.ChatCompletionNewParams{Model: fortune.Name, Messages: []oa.ChatCompletionMessageParamUnion{oa.UserMessage("Hi")}})
		var apiErr *oa.Error
		if !errors.As(err, &apiErr) || apiErr.StatusCode != 503 {
			t.Fatalf("chat with no pipeline: %v, want 503", err)
		}
		t.Logf("no pipeline: %d %s", apiErr.StatusCode, apiErr.Message)
		// Two new stage daemons: the leader builds a new pipeline; the
		// counters go on from where they were.
		for i := range 2 {
			name := fmt.Sprintf("stage-new-%d", i+1)
			p, err := startDaemon(ctx, c.spec, name, c.spec.stageArgs(name, c.Leader.Gossip))
			if err != nil {
				t.Fatal(err)
			}
			c.Stages = append(c.Stages, p)
		}
		if err := waitServing(ctx, c.Conn, time.Minute); err != nil {
			t.Fatal(err)
		}
		ids := c.tokenize(t, `{"prompt":"A wise man"}`)
		c.grpcGreedy(t, ctx, ids, 5, true)
		resp, err := c.client.Completions.New(ctx, oa.CompletionNewParams{
			Model: fortune.Name, Prompt: oa.CompletionNewParamsPromptUnion{OfString: oa.String("A wise man")}, MaxTokens: oa.Int(5), Temperature: oa.Float(0),
		}, option.WithJSONSet("ignore_eos", true))
		if err != nil {
			t.Fatal(err)
		}
		c.sent.add(int(resp.Usage.PromptTokens), int(resp.Usage.CompletionTokens), "length")
		after := c.scrapeIdle(t)
		checkMetrics(t, after, c.sent)
		for _, name := range []string{"tandem_steps_total", "tandem_graph_steps_total", "tandem_discarded_tokens_total", "tandem_preemptions_total", "tandem_requests_failed_total", "tandem_requests_refused_total"} {
			b, a := sum(before, name), sum(after, name)
			if before[name] == nil || a < b || (a == b && (name == "tandem_steps_total" || name == "tandem_graph_steps_total")) {
				t.Errorf("%s: %v before the rebuild, %v after (present %t): want it to go on counting", name, b, a, before[name] != nil)
			}
		}
	})

	t.Run("drain", func(t *testing.T) {
		// SIGTERM to the leader while a long request streams: new requests
		// get 503 (the node drains), the one in flight finishes.
		stream := c.client.Completions.NewStreaming(ctx, oa.CompletionNewParams{
			Model: fortune.Name, Prompt: oa.CompletionNewParamsPromptUnion{OfString: oa.String("In the beginning")}, MaxTokens: oa.Int(400),
		}, option.WithJSONSet("ignore_eos", true))
		if !stream.Next() {
			t.Fatalf("stream ended: %v", stream.Err())
		}
		if err := c.Leader.cmd.Process.Signal(os.Interrupt); err != nil {
			t.Fatal(err)
		}
		var code int
		var body string
		for start := time.Now(); ; time.Sleep(2 * time.Millisecond) {
			code, body = httpPost(t, c.base+"/completions", `{"model":"fortune","prompt":"Hi","max_tokens":2}`)
			if code == 503 {
				break
			}
			if time.Since(start) > 10*time.Second {
				t.Fatalf("10s after SIGTERM: %d %s", code, body)
			}
		}
		finish := ""
		n := 1
		for stream.Next() {
			n++
			for _, ch := range stream.Current().Choices {
				if ch.FinishReason != "" {
					finish = string(ch.FinishReason)
				}
			}
		}
		if err := stream.Err(); err != nil || finish != "length" {
			t.Errorf("the request in flight during the drain: %v, finish %q after %d chunks; want it finished", err, finish, n)
		}
		if !strings.Contains(body, "draining") {
			t.Errorf("503 while draining: %s, want it to say the node drains", body)
		}
		if err := c.Leader.wait(); err != nil {
			t.Errorf("leader after the drain: %v", err)
		}
		t.Logf("while draining: %d %s", code, strings.TrimSpace(body))
	})
}

func int64s(ids []int32) []int64 {
	out := make([]int64, len(ids))
	for i, id := range ids {
		out[i] = int64(id)
	}
	return out
}

// jsonOf is v as the API writes it: JSON without HTML escaping.
func jsonOf(v any) string {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		panic(err)
	}
	return strings.TrimSuffix(b.String(), "\n")
}
