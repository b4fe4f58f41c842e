package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	oa "github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/fortune"
	"github.com/tandem-llm/tandem/model/randinit"
	"github.com/tandem-llm/tandem/model/tokenizer"
	"github.com/tandem-llm/tandem/pipeline"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
	"github.com/tandem-llm/tandem/stage"
	"github.com/tandem-llm/tandem/stage/cpu"
)

// The test binary doubles as tandemd: the multi-process tests start it with
// this variable set, and it runs main instead of the tests.
const asDaemonEnv = "TANDEMD_TEST_AS_DAEMON"

func TestMain(m *testing.M) {
	if os.Getenv(asDaemonEnv) == "1" {
		report := emulateDevice()
		main()
		report()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// testModel writes a small random checkpoint with 4 layers.
func testModel(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "model")
	o := randinit.DefaultOptions()
	o.Layers = 4
	o.Seed = 7
	if err := randinit.Write(dir, o); err != nil {
		t.Fatal(err)
	}
	return dir
}

// logBuffer collects the daemons' logs (written concurrently).
type logBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// startCluster starts a cluster of this test binary as tandemd processes
// and stops it when the test ends, showing the logs of a failed test.
func startCluster(t *testing.T, ctx context.Context, dir string, stages int, leaderStage bool) (*localCluster, *logBuffer) {
	t.Helper()
	return startClusterWith(t, ctx, dir, stages, leaderStage)
}

// startClusterWith is startCluster with more flags for every daemon.
func startClusterWith(t *testing.T, ctx context.Context, dir string, stages int, leaderStage bool, extra ...string) (*localCluster, *logBuffer) {
	t.Helper()
	return startClusterSpec(t, ctx, clusterSpec{model: dir, stages: stages, leaderStage: leaderStage, extra: extra})
}

// startClusterSpec is startCluster as spec says, the daemons being this
// test binary logging at level info.
func startClusterSpec(t *testing.T, ctx context.Context, spec clusterSpec) (*localCluster, *logBuffer) {
	t.Helper()
	logs := &logBuffer{}
	start := time.Now()
	spec.exe, spec.env, spec.logLevel, spec.stderr = os.Args[0], []string{asDaemonEnv + "=1"}, "info", logs
	c, err := startLocalCluster(ctx, spec)
	if err != nil {
		t.Fatalf("%v\ndaemon logs:\n%s", err, logs)
	}
	t.Logf("cluster of %d stages (leader holds one: %t) serving %v after start", spec.stages, spec.leaderStage, time.Since(start).Round(time.Millisecond))
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("stop the cluster: %v", err)
		}
		if t.Failed() {
			t.Logf("daemon logs:\n%s", logs)
		}
	})
	return c, logs
}

// genCase is one Generate request with its reference.
type genCase struct {
	name string
	req  *tandemv1.GenerateRequest
}

func genCases() []genCase {
	return []genCase{
		{"greedy", &tandemv1.GenerateRequest{Prompt: "Hello there", MaxTokens: 12, Temperature: proto.Float32(0), TopP: proto.Float32(0), TopK: proto.Int32(0), Logprobs: proto.Uint32(5)}},
		{"sampled", &tandemv1.GenerateRequest{Prompt: "The quick brown fox jumps over", MaxTokens: 10, Temperature: proto.Float32(0.9), TopK: proto.Int32(40), TopP: proto.Float32(0.95), Seed: 11, Logprobs: proto.Uint32(3)}},
		{"ids", &tandemv1.GenerateRequest{PromptTokenIds: []int32{3, 99, 250, 7, 7, 300}, MaxTokens: 8, Temperature: proto.Float32(1.2), TopP: proto.Float32(1), TopK: proto.Int32(0), Seed: 5, IgnoreEos: true, Logprobs: proto.Uint32(0)}},
	}
}

// reference runs the request through a single-stage pipeline in this
// process, with the plain generation loop.
func reference(t *testing.T, dir string, req *tandemv1.GenerateRequest) []stage.Sampled {
	t.Helper()
	ckpt, err := model.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ckpt.Close()
	cfg := ckpt.Config()
	tok, err := tokenizer.Load(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		t.Fatal(err)
	}
	prompt := req.GetPromptTokenIds()
	if len(prompt) == 0 {
		prompt = tok.Encode(req.GetPrompt(), true)
	}
	var stops []int32
	if !req.GetIgnoreEos() {
		for _, id := range cfg.EOS {
			stops = append(stops, int32(id))
		}
	}
	d := localPipeline(t, context.Background(), dir, [][2]int{{0, cfg.NumLayers}})
	defer d.Close()
	var out []stage.Sampled
	r := pipeline.Request{ID: 1, Prompt: prompt, MaxTokens: int(req.GetMaxTokens()), StopTokens: stops, Sampling: stage.Sampling{
		Temperature: req.GetTemperature(), TopK: int(req.GetTopK()), TopP: req.GetTopP(), Seed: req.GetSeed(), Logprobs: int(req.GetLogprobs()),
	}}
	err = pipeline.Generate(context.Background(), d, []pipeline.Request{r}, pipeline.GenerateOptions{}, func(ev pipeline.Event) error {
		out = append(out, ev.Token)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// generated is a Generate call's stream, put together.
type generated struct {
	text     string
	ids      []int32
	logprobs []*tandemv1.TokenLogprobs
	finish   tandemv1.FinishReason
	usage    *tandemv1.Usage
}

func generate(ctx context.Context, conn *grpc.ClientConn, req *tandemv1.GenerateRequest) (generated, error) {
	var g generated
	stream, err := tandemv1.NewInferenceClient(conn).Generate(ctx, req)
	if err != nil {
		return g, err
	}
	for {
		msg, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return g, nil
		}
		if err != nil {
			return g, err
		}
		if g.usage != nil {
			return g, fmt.Errorf("message after the final one: %v", msg)
		}
		g.text += msg.GetText()
		g.ids = append(g.ids, msg.GetTokenIds()...)
		g.logprobs = append(g.logprobs, msg.GetLogprobs()...)
		g.finish, g.usage = msg.GetFinishReason(), msg.GetUsage()
	}
}

// checkAgainst compares a Generate result with the reference tokens.
func checkAgainst(t *testing.T, name string, got generated, want []stage.Sampled, req *tandemv1.GenerateRequest) {
	t.Helper()
	ids := make([]int32, len(want))
	for i, w := range want {
		ids[i] = w.Token
	}
	if !slices.Equal(got.ids, ids) {
		t.Fatalf("%s: tokens %v, want %v", name, got.ids, ids)
	}
	if got.usage == nil || got.usage.GetCompletionTokens() != uint32(len(ids)) {
		t.Errorf("%s: usage %v, want %d completion tokens", name, got.usage, len(ids))
	}
	if len(got.logprobs) != len(want) {
		t.Fatalf("%s: %d logprobs, want one per token (%d)", name, len(got.logprobs), len(want))
	}
	worst := 0.0
	for i, w := range want {
		g := got.logprobs[i]
		if g.GetTokenId() != w.Token || len(g.GetTop()) != len(w.Top) || len(w.Top) != int(req.GetLogprobs()) {
			t.Fatalf("%s: token %d logprobs %v, want token %d with %d alternatives", name, i, g, w.Token, req.GetLogprobs())
		}
		worst = max(worst, math.Abs(float64(g.GetLogprob()-w.Logprob)))
		for j, a := range w.Top {
			if g.GetTop()[j].GetTokenId() != a.Token {
				t.Fatalf("%s: token %d alternative %d is %d, want %d", name, i, j, g.GetTop()[j].GetTokenId(), a.Token)
			}
			worst = max(worst, math.Abs(float64(g.GetTop()[j].GetLogprob()-a.Logprob)))
		}
	}
	t.Logf("%s: tokens identical, logprobs within %.2e of the single-process reference", name, worst)
	if worst > 1e-5 {
		t.Errorf("%s: logprobs differ from the reference by up to %.2e", name, worst)
	}
}

// generateAll runs every case concurrently (so they share steps) and
// checks each against its reference.
func generateAll(t *testing.T, ctx context.Context, conn *grpc.ClientConn, cases []genCase, want map[string][]stage.Sampled) {
	t.Helper()
	got := make([]generated, len(cases))
	errs := make([]error, len(cases))
	var wg sync.WaitGroup
	for i, c := range cases {
		wg.Go(func() { got[i], errs[i] = generate(ctx, conn, c.req) })
	}
	wg.Wait()
	for i, c := range cases {
		if errs[i] != nil {
			t.Fatalf("%s: %v", c.name, errs[i])
		}
		checkAgainst(t, c.name, got[i], want[c.name], c.req)
	}
}

// run is what one pipeline produced for the test workload: per sequence,
// the logits of every position it ran, and its greedy tokens.
type run struct {
	logits map[uint64][][]float32
	tokens map[uint64][]int32
}

// workload prefills three prompts of different lengths in one batch, then
// decodes greedily for a few steps, asking for logits everywhere.
func workload(t *testing.T, ctx context.Context, d *pipeline.Driver, vocab int) run {
	t.Helper()
	prompts := map[uint64][]int32{}
	lens := []int{5, 11, 2}
	for i, n := range lens {
		p := make([]int32, n)
		for j := range p {
			p[j] = int32((i*31 + j*17 + 3) % vocab)
		}
		prompts[uint64(i+1)] = p
	}
	r := run{logits: map[uint64][][]float32{}, tokens: map[uint64][]int32{}}
	pos := map[uint64]int{}
	next := map[uint64][]int32{}
	for id, p := range prompts {
		next[id] = p
	}
	for step := 0; step < 5; step++ {
		b := stage.Batch{ID: uint64(step + 1)}
		for id := uint64(1); id <= uint64(len(lens)); id++ {
			// Two blocks of 16 positions each, ids 2·id and 2·id+1.
			blocks := []int32{int32(2 * id), int32(2*id + 1)}
			b.Seqs = append(b.Seqs, stage.Seq{ID: id, Pos: pos[id], Tokens: next[id], Blocks: blocks, Sample: true, Logits: true, Index: len(r.tokens[id])})
		}
		res, err := d.Step(ctx, &pipeline.Step{Batch: b})
		if err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		for _, l := range res.Logits {
			r.logits[l.Seq] = append(r.logits[l.Seq], l.Rows...)
		}
		for _, s := range res.Sampled {
			r.tokens[s.Seq] = append(r.tokens[s.Seq], s.Token)
			pos[s.Seq] += len(next[s.Seq])
			next[s.Seq] = []int32{s.Token}
		}
	}
	return r
}

func compareRuns(t *testing.T, name string, got, want run) {
	t.Helper()
	worst := 0.0
	for id, rows := range want.logits {
		g := got.logits[id]
		if len(g) != len(rows) {
			t.Fatalf("%s: sequence %d: %d logit rows, want %d", name, id, len(g), len(rows))
		}
		for i := range rows {
			worst = max(worst, relErr(g[i], rows[i]))
		}
		if fmt.Sprint(got.tokens[id]) != fmt.Sprint(want.tokens[id]) {
			t.Errorf("%s: sequence %d: greedy tokens %v, want %v", name, id, got.tokens[id], want.tokens[id])
		}
	}
	t.Logf("%s: worst relative logit error %.2e", name, worst)
	if worst > 1e-6 {
		t.Errorf("%s: relative logit error %.2e > 1e-6", name, worst)
	}
}

func relErr(a, b []float32) float64 {
	var num, den float64
	for i := range b {
		d := float64(a[i]) - float64(b[i])
		num += d * d
		den += float64(b[i]) * float64(b[i])
	}
	return math.Sqrt(num / den)
}

func localPipeline(t *testing.T, ctx context.Context, dir string, ranges [][2]int) *pipeline.Driver {
	t.Helper()
	ckpt, err := model.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ckpt.Close() })
	var stages []stage.Stage
	for _, r := range ranges {
		st, err := cpu.New(cpu.Config{Model: ckpt.Config(), Lo: r[0], Hi: r[1], Weights: ckpt, MaxTokens: 64, MaxSeqs: 8})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		stages = append(stages, st)
	}
	d, err := pipeline.StartLocal(ctx, stages)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// splitLayers divides layers into n contiguous ranges whose sizes differ by
// at most one, the larger ones first.
func splitLayers(layers, n int) [][2]int {
	ranges := make([][2]int, n)
	lo := 0
	for i := range n {
		size := layers / n
		if i < layers%n {
			size++
		}
		ranges[i] = [2]int{lo, lo + size}
		lo += size
	}
	return ranges
}

// TestStageSplits checks that the same checkpoint split into 1, 2, 3 and 4
// stages gives the single-stage results: in one process, the logits of
// every position; as a cluster of daemon processes (the leader holding the
// first stage), the tokens and log-probabilities Generate streams.
func TestStageSplits(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := testModel(t)
	ckpt, err := model.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	cfg := ckpt.Config()
	ckpt.Close()

	ref := localPipeline(t, ctx, dir, [][2]int{{0, cfg.NumLayers}})
	want := workload(t, ctx, ref, cfg.VocabSize)
	if err := ref.Close(); err != nil {
		t.Fatal(err)
	}
	cases := genCases()
	wantGen := map[string][]stage.Sampled{}
	for _, c := range cases {
		wantGen[c.name] = reference(t, dir, c.req)
	}
	for n := 1; n <= 4; n++ {
		t.Run(fmt.Sprintf("in-process/%d", n), func(t *testing.T) {
			d := localPipeline(t, ctx, dir, splitLayers(cfg.NumLayers, n))
			got := workload(t, ctx, d, cfg.VocabSize)
			if err := d.Close(); err != nil {
				t.Fatal(err)
			}
			compareRuns(t, fmt.Sprintf("%d stages in one process", n), got, want)
		})
		t.Run(fmt.Sprintf("daemons/%d", n), func(t *testing.T) {
			c, _ := startCluster(t, ctx, dir, n, true)
			st, err := tandemv1.NewAdminClient(c.Conn).Status(ctx, &tandemv1.StatusRequest{})
			if err != nil {
				t.Fatal(err)
			}
			// The CPU stages take hand-offs: one more step in flight than
			// there are stages, and no CUDA graphs.
			if !st.GetHandoff() || st.GetMaxInFlight() != uint32(n+1) || st.GetGraphMode() != "NONE" {
				t.Errorf("status: hand-off %t, %d steps in flight, graph mode %q; want hand-off on, %d in flight, NONE", st.GetHandoff(), st.GetMaxInFlight(), st.GetGraphMode(), n+1)
			}
			var got [][2]int
			next := 0
			for _, s := range st.GetStages() {
				got = append(got, [2]int{int(s.GetLayerLo()), int(s.GetLayerHi())})
				if int(s.GetLayerLo()) != next || s.GetLayerHi() <= s.GetLayerLo() {
					t.Errorf("stages %v are not contiguous", got)
				}
				next = int(s.GetLayerHi())
			}
			if len(got) != n || next != cfg.NumLayers {
				t.Errorf("stages %v: want %d covering [0, %d)", got, n, cfg.NumLayers)
			}
			t.Logf("daemons' stages %v", got)
			generateAll(t, ctx, c.Conn, cases, wantGen)
			checkEagerDispatch(t, ctx, c.Conn)
		})
	}
	// Without hand-off, and with KV blocks of 5 positions (so sequences
	// span blocks at odd places): the same tokens.
	t.Run("daemons/2/handoff-off", func(t *testing.T) {
		c, _ := startClusterWith(t, ctx, dir, 2, true, "--handoff=false", "--block-size=5")
		st, err := tandemv1.NewAdminClient(c.Conn).Status(ctx, &tandemv1.StatusRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if st.GetHandoff() || st.GetMaxInFlight() != 2 {
			t.Errorf("status with --handoff=false: hand-off %t, %d steps in flight; want off, 2", st.GetHandoff(), st.GetMaxInFlight())
		}
		if bs := st.GetScheduler().GetBlockSize(); bs != 5 {
			t.Errorf("status with --block-size=5: blocks of %d positions", bs)
		}
		generateAll(t, ctx, c.Conn, cases, wantGen)
	})
}

// checkEagerDispatch checks the leader's CUDA-graph statistics of a CPU
// cluster that has served requests: the mode resolved to NONE because of a
// CPU stage, and every step ran eagerly at its own token count.
func checkEagerDispatch(t *testing.T, ctx context.Context, conn *grpc.ClientConn) {
	t.Helper()
	g, err := tandemv1.NewAdminClient(conn).Graphs(ctx, &tandemv1.GraphsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if g.GetMode() != "NONE" || g.GetConfiguredMode() != "FULL_AND_PIECEWISE" || len(g.GetDowngrades()) != 1 || !strings.Contains(g.GetDowngrades()[0], "(cpu) supports NEVER") {
		t.Errorf("graphs: mode %s (configured %s), downgrades %q; want NONE from FULL_AND_PIECEWISE because of a cpu stage", g.GetMode(), g.GetConfiguredMode(), g.GetDowngrades())
	}
	steps := uint64(0)
	for _, r := range g.GetSteps() {
		if r.GetMode() != "NONE" || r.GetPadded() != r.GetUnpadded() {
			t.Errorf("graphs: step count %v, want only NONE steps without padding", r)
		}
		steps += r.GetCount()
	}
	if steps == 0 {
		t.Error("graphs: no step counted after the requests")
	}
}

// TestCluster runs a leader and two stage daemons as processes, checks
// the API against the single-process reference and its refusals, then
// kills a stage daemon: the leader serves again over the other alone.
func TestCluster(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := testModel(t)
	cases := genCases()
	want := map[string][]stage.Sampled{}
	for _, c := range cases {
		want[c.name] = reference(t, dir, c.req)
	}
	c, logs := startCluster(t, ctx, dir, 2, false)
	admin := tandemv1.NewAdminClient(c.Conn)

	t.Run("status", func(t *testing.T) {
		st, err := admin.Status(ctx, &tandemv1.StatusRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if !st.GetServing() || st.GetLeader() != "leader" || st.GetEpoch() == 0 || st.GetKvTokens() == 0 {
			t.Errorf("status %v: want the leader serving with an epoch and KV capacity", st)
		}
		var names []string
		for _, m := range st.GetMembers() {
			names = append(names, m.GetName())
			if m.GetState() != tandemv1.MemberState_MEMBER_STATE_ALIVE || m.GetModelId() != st.GetModelId() {
				t.Errorf("member %v: want alive with model %s", m, st.GetModelId())
			}
		}
		if !slices.Equal(names, []string{"leader", "stage-1", "stage-2"}) {
			t.Errorf("members %v", names)
		}
		if s := st.GetStages(); len(s) != 2 || s[0].GetNode() != "stage-1" || s[0].GetLayerLo() != 0 || s[1].GetLayerHi() != 4 || s[0].GetLayerHi() != s[1].GetLayerLo() {
			t.Errorf("stages %v: want stage-1 then stage-2 covering [0, 4)", s)
		}
	})
	t.Run("generate", func(t *testing.T) { generateAll(t, ctx, c.Conn, cases, want) })
	t.Run("reflection", func(t *testing.T) {
		stream, err := reflectionpb.NewServerReflectionClient(c.Conn).ServerReflectionInfo(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := stream.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}}); err != nil {
			t.Fatal(err)
		}
		resp, err := stream.Recv()
		if err != nil {
			t.Fatal(err)
		}
		stream.CloseSend()
		var got []string
		for _, s := range resp.GetListServicesResponse().GetService() {
			got = append(got, s.GetName())
		}
		for _, w := range []string{"tandem.v1.Inference", "tandem.v1.Admin", "grpc.health.v1.Health"} {
			if !slices.Contains(got, w) {
				t.Errorf("reflection lists %v, missing %s", got, w)
			}
		}
	})
	t.Run("bad requests", func(t *testing.T) {
		for _, tc := range []struct {
			name string
			req  *tandemv1.GenerateRequest
			want string
		}{
			{"empty prompt", &tandemv1.GenerateRequest{MaxTokens: 4}, "empty prompt"},
			{"both prompts", &tandemv1.GenerateRequest{Prompt: "a", PromptTokenIds: []int32{1}}, "both set"},
			{"past the context", &tandemv1.GenerateRequest{Prompt: "Hello", MaxTokens: 5000}, "context length 2048"},
			{"id out of vocab", &tandemv1.GenerateRequest{PromptTokenIds: []int32{1, 512}}, "prompt_token_ids[1] = 512"},
			{"negative id", &tandemv1.GenerateRequest{PromptTokenIds: []int32{-1}}, "prompt_token_ids[0] = -1"},
			{"stop id out of vocab", &tandemv1.GenerateRequest{Prompt: "a", StopTokenIds: []int32{9999}}, "stop_token_ids[0]"},
			{"negative temperature", &tandemv1.GenerateRequest{Prompt: "a", Temperature: proto.Float32(-1)}, "temperature"},
			{"NaN temperature", &tandemv1.GenerateRequest{Prompt: "a", Temperature: proto.Float32(float32(math.NaN()))}, "temperature"},
			{"top_p above 1", &tandemv1.GenerateRequest{Prompt: "a", TopP: proto.Float32(1.5)}, "top_p"},
			{"negative top_k", &tandemv1.GenerateRequest{Prompt: "a", TopK: proto.Int32(-3)}, "top_k"},
			{"too many logprobs", &tandemv1.GenerateRequest{Prompt: "a", Logprobs: proto.Uint32(21)}, "logprobs 21"},
			{"empty stop string", &tandemv1.GenerateRequest{Prompt: "a", Stop: []string{""}}, "stop[0]"},
		} {
			_, err := generate(ctx, c.Conn, tc.req)
			if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%s: %v, want INVALID_ARGUMENT mentioning %q", tc.name, err, tc.want)
			}
		}
		// The cluster keeps serving.
		got, err := generate(ctx, c.Conn, cases[0].req)
		if err != nil {
			t.Fatal(err)
		}
		checkAgainst(t, "after bad requests", got, want[cases[0].name], cases[0].req)
	})
	t.Run("cancel frees the request", func(t *testing.T) {
		cctx, ccancel := context.WithCancel(ctx)
		stream, err := tandemv1.NewInferenceClient(c.Conn).Generate(cctx, &tandemv1.GenerateRequest{Prompt: "Go on", MaxTokens: 2000, IgnoreEos: true})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := stream.Recv(); err != nil {
			t.Fatal(err)
		}
		st, err := admin.Status(ctx, &tandemv1.StatusRequest{})
		if err != nil || st.GetRequestsRunning() != 1 {
			t.Fatalf("while generating: %v running (%v), want 1", st.GetRequestsRunning(), err)
		}
		ccancel()
		start := time.Now()
		for st.GetRequestsRunning() != 0 {
			if time.Since(start) > 5*time.Second {
				t.Fatalf("%d requests still running %v after the cancel", st.GetRequestsRunning(), time.Since(start))
			}
			time.Sleep(10 * time.Millisecond)
			if st, err = admin.Status(ctx, &tandemv1.StatusRequest{}); err != nil {
				t.Fatal(err)
			}
		}
		t.Logf("request freed %v after the cancel", time.Since(start).Round(time.Millisecond))
	})
	t.Run("stage daemon refuses Generate", func(t *testing.T) {
		conn, err := grpc.NewClient(c.Stages[0].GRPC, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		_, err = generate(ctx, conn, cases[0].req)
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), c.Leader.GRPC) {
			t.Errorf("Generate on a stage daemon: %v, want UNAVAILABLE naming the leader at %s", err, c.Leader.GRPC)
		}
	})
	t.Run("stage killed: the leader rebuilds over the other", func(t *testing.T) {
		before, err := admin.Status(ctx, &tandemv1.StatusRequest{})
		if err != nil {
			t.Fatal(err)
		}
		victim := c.Stages[1]
		c.Stages = c.Stages[:1] // Close must not stop it again
		victim.kill()
		killed := time.Now()
		for {
			st, err := admin.Status(ctx, &tandemv1.StatusRequest{})
			if err == nil && st.GetServing() && st.GetEpoch() != before.GetEpoch() {
				if s := st.GetStages(); len(s) != 1 || s[0].GetNode() != "stage-1" || s[0].GetLayerLo() != 0 || s[0].GetLayerHi() != 4 {
					t.Fatalf("stages after the kill: %v, want stage-1 holding every layer", s)
				}
				t.Logf("stage daemon SIGKILLed: the leader serves again over stage-1 alone, epoch %d, %v after the kill", st.GetEpoch(), time.Since(killed).Round(time.Millisecond))
				break
			}
			if time.Since(killed) > 30*time.Second {
				t.Fatalf("30s after the kill: status %v (%v), want a new pipeline serving", st, err)
			}
			time.Sleep(20 * time.Millisecond)
		}
		got, err := generate(ctx, c.Conn, cases[0].req)
		if err != nil {
			t.Fatal(err)
		}
		checkAgainst(t, "after the kill", got, want[cases[0].name], cases[0].req)
		if strings.Contains(logs.String(), "panic") {
			t.Errorf("a daemon panicked")
		}
	})
}

// TestDemo runs the README's first command end to end with the demo's
// defaults: the built-in model completes the default prompt with the
// greedy continuation transformers recorded, up to the end of its text.
func TestDemo(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var want string
	for _, g := range readFortuneGolden(t).Greedy {
		if g.Prompt == demoPrompt {
			want, _, _ = strings.Cut(g.Text, "<|end_of_text|>")
		}
	}
	if want == "" {
		t.Fatalf("golden.json has no continuation of the demo's prompt %q", demoPrompt)
	}
	var out bytes.Buffer
	logs := &logBuffer{}
	o := demoOptions{stages: 2, prompt: demoPrompt, maxTokens: 32, seed: 1, logLevel: "warn", exe: os.Args[0], env: []string{asDaemonEnv + "=1"}}
	if err := runDemo(ctx, o, &out, logs); err != nil {
		t.Fatalf("%v\nlogs:\n%s", err, logs)
	}
	t.Logf("demo output:\n%s", out.String())
	for _, w := range []string{"model:   built-in fortune model", "cluster: leader + 2 stage daemons", "\n" + demoPrompt + want + "\n", "stopped at the end of the text", "exited cleanly"} {
		if !strings.Contains(out.String(), w) {
			t.Errorf("demo output lacks %q:\n%s", w, out.String())
		}
	}
	if strings.ContainsRune(out.String(), '\uFFFD') {
		t.Errorf("demo output holds a replacement character:\n%s", out.String())
	}
	// The daemons log at warn level, as the demo's default does: a run
	// and a clean stop warn of nothing (stopping the stages before the
	// leader made it try to move their layers and warn it could not).
	if l := logs.String(); l != "" {
		t.Errorf("the demo's daemons warned:\n%s", l)
	}
}

// TestDemoKeep checks that demo --keep prints the leader's gRPC address
// and its OpenAI base URL on lines of their own, serves on both until
// cancelled (the built-in model is listed by its name and answers a chat
// turn through openai-go), and then stops cleanly.
func TestDemoKeep(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pr, pw := io.Pipe()
	logs := &logBuffer{}
	demoCtx, stopDemo := context.WithCancel(ctx)
	o := demoOptions{stages: 1, prompt: "Hi", maxTokens: 2, keep: true, logLevel: "warn", exe: os.Args[0], env: []string{asDaemonEnv + "=1"}}
	done := make(chan error, 1)
	go func() {
		err := runDemo(demoCtx, o, pw, logs)
		pw.CloseWithError(err)
		done <- err
	}()
	var out strings.Builder
	leader, api := "", ""
	buf := make([]byte, 4096)
	for leader == "" || api == "" {
		n, err := pr.Read(buf)
		out.Write(buf[:n])
		if err != nil {
			t.Fatalf("demo ended before printing the leader and the API: %v\n%s\nlogs:\n%s", err, out.String(), logs)
		}
		for line := range strings.Lines(out.String()) {
			if !strings.HasSuffix(line, "\n") {
				continue
			}
			if a, ok := strings.CutPrefix(strings.TrimSpace(line), "leader: "); ok {
				leader = a
			}
			if a, ok := strings.CutPrefix(strings.TrimSpace(line), "openai: "); ok {
				api = a
			}
		}
	}
	go io.Copy(io.Discard, pr)
	conn, err := grpc.NewClient(leader, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	st, err := tandemv1.NewAdminClient(conn).Status(ctx, &tandemv1.StatusRequest{})
	if err != nil || !st.GetServing() {
		t.Fatalf("status of the kept cluster at %s: %v %v", leader, st, err)
	}
	if !strings.HasPrefix(api, "http://127.0.0.1:") || !strings.HasSuffix(api, "/v1") {
		t.Fatalf("openai: %q, want http://127.0.0.1:PORT/v1", api)
	}
	client := oa.NewClient(option.WithBaseURL(api+"/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	models, err := client.Models.List(ctx)
	if err != nil || len(models.Data) != 1 || models.Data[0].ID != fortune.Name {
		t.Fatalf("models at %s: %+v, %v; want the built-in %s", api, models, err, fortune.Name)
	}
	resp, err := client.Chat.Completions.New(ctx, oa.ChatCompletionNewParams{
		Model: fortune.Name, Messages: []oa.ChatCompletionMessageParamUnion{oa.UserMessage("Tell me my fortune.")}, MaxCompletionTokens: oa.Int(8),
	})
	if err != nil || len(resp.Choices) != 1 || resp.Usage.CompletionTokens == 0 {
		t.Fatalf("chat with the kept cluster: %+v, %v", resp, err)
	}
	t.Logf("%s answers %q (%s)", api, resp.Choices[0].Message.Content, resp.Choices[0].FinishReason)
	stopDemo()
	if err := <-done; err != nil {
		t.Fatalf("demo after Ctrl-C: %v\nlogs:\n%s", err, logs)
	}
}

// TestDemoRefusals: --stages 0 is refused at once (it used to fail 60 s
// later), and a refused request's error is not printed glued to the prompt
// text (the prompt is printed once the request is accepted).
func TestDemoRefusals(t *testing.T) {
	start := time.Now()
	if err := runDemo(context.Background(), demoOptions{stages: 0}, io.Discard, io.Discard); err == nil || !strings.Contains(err.Error(), "--stages 0") || time.Since(start) > 5*time.Second {
		t.Errorf("demo --stages 0: %v after %v, want an error at once", err, time.Since(start))
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out bytes.Buffer
	logs := &logBuffer{}
	o := demoOptions{stages: 1, prompt: "Hello there", maxTokens: 5000, seed: 1, logLevel: "warn", exe: os.Args[0], env: []string{asDaemonEnv + "=1"}}
	err := runDemo(ctx, o, &out, logs)
	if status.Code(errors.Unwrap(err)) != codes.InvalidArgument && !strings.Contains(fmt.Sprint(err), "InvalidArgument") {
		t.Fatalf("demo --max-tokens 5000: %v, want InvalidArgument\nlogs:\n%s", err, logs)
	}
	if s := out.String(); strings.Contains(s, "Hello there") || !strings.HasSuffix(s, "\n") {
		t.Errorf("demo --max-tokens 5000 printed %q: the error would follow the prompt on its line", s)
	}
}
