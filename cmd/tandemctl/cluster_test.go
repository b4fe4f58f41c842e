package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/tandem-llm/tandem/daemon"
	"github.com/tandem-llm/tandem/model/tokenizer"
)

// startDaemon runs a one-node cluster (leader and only stage) in this
// process with an admin token, and returns its gRPC address once it serves.
func startDaemon(t *testing.T, modelDir, token string) string {
	t.Helper()
	return startDaemonAddrs(t, modelDir, token).GRPC
}

// startDaemonAddrs is startDaemon with the OpenAI endpoint on; it returns
// every address.
func startDaemonAddrs(t *testing.T, modelDir, token string) daemon.Addrs {
	t.Helper()
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte(token), 0o600); err != nil {
		t.Fatal(err)
	}
	d, err := daemon.New(daemon.Config{
		Name:     "solo",
		Model:    modelDir,
		Listen:   daemon.ListenConfig{GRPC: "127.0.0.1:0", Gossip: "127.0.0.1:0", HTTP: "127.0.0.1:0"},
		Cluster:  daemon.ClusterConfig{FastFailureDetection: true},
		Stage:    daemon.StageConfig{Memory: 1 << 30, Backend: daemon.BackendCPU},
		Security: daemon.SecurityConfig{AdminTokenFile: tokenFile},
	}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("daemon: %v", err)
		}
	})
	select {
	case <-d.Listening():
	case err := <-done:
		t.Fatal(err)
	}
	addr := d.Addrs().GRPC
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	for start := time.Now(); ; time.Sleep(20 * time.Millisecond) {
		r, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
		if err == nil && r.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return d.Addrs()
		}
		if time.Since(start) > 20*time.Second {
			t.Fatalf("daemon not serving: %v %v", r, err)
		}
	}
}

// TestStatusAndGenerate runs the status and generate commands against a
// daemon: the table and JSON status, the admin token from the environment,
// and generate's streamed text against its JSON response and the
// tokenizer.
func TestStatusAndGenerate(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "m")
	if _, err := run(t, "", "model", "init", "--out", dir); err != nil {
		t.Fatal(err)
	}
	addr := startDaemon(t, dir, "tok-123")

	if _, err := run(t, "", "status", "--addr", addr); err == nil || !strings.Contains(err.Error(), "Unauthenticated") {
		t.Errorf("status without the token: %v, want Unauthenticated", err)
	}
	t.Setenv(addrEnv, addr)
	t.Setenv(tokenEnv, "tok-123")
	out, err := run(t, "", "status")
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{"leader:    solo at " + addr, "pipeline:  serving", "MEMBER", "solo", "alive", "STAGE", "[0, 4)"} {
		if !strings.Contains(out, w) {
			t.Errorf("status table lacks %q:\n%s", w, out)
		}
	}
	out, err = run(t, "", "status", "--json")
	if err != nil {
		t.Fatal(err)
	}
	var st struct {
		Leader  string
		Serving bool
		Stages  []struct {
			Node                 string
			WeightBytes, KvBytes string // uint64 in protojson
		}
	}
	if err := json.Unmarshal([]byte(out), &st); err != nil || st.Leader != "solo" || !st.Serving || len(st.Stages) != 1 {
		t.Errorf("status --json: %+v, %v:\n%s", st, err, out)
	}
	// A CPU stage reports the memory of its weights and KV cache (it showed
	// "0 B").
	if len(st.Stages) == 1 && (st.Stages[0].WeightBytes == "" || st.Stages[0].WeightBytes == "0" || st.Stages[0].KvBytes == "" || st.Stages[0].KvBytes == "0") {
		t.Errorf("status --json: stage memory %+v, want the weights' and KV cache's bytes", st.Stages[0])
	}

	out, err = run(t, "", "generate", "--max-tokens", "6", "--json", "--logprobs", "2", "--ignore-eos", "Hello", "world")
	if err != nil {
		t.Fatal(err)
	}
	var resp struct {
		Text         string
		TokenIDs     []int32 `json:"tokenIds"`
		Logprobs     []struct{ Top []json.RawMessage }
		FinishReason string
		Usage        struct{ PromptTokens, CompletionTokens int }
	}
	if err := json.Unmarshal([]byte(out), &resp); err != nil {
		t.Fatalf("generate --json: %v:\n%s", err, out)
	}
	tok, err := tokenizer.Load(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.TokenIDs) != 6 || len(resp.Logprobs) != 6 || len(resp.Logprobs[0].Top) != 2 || resp.FinishReason != "FINISH_REASON_LENGTH" ||
		resp.Usage.CompletionTokens != 6 || resp.Usage.PromptTokens != len(tok.Encode("Hello world", true)) {
		t.Errorf("generate --json: %+v", resp)
	}
	if want := tok.Decode(resp.TokenIDs, true); resp.Text != want {
		t.Errorf("text %q, want the decoded tokens %q", resp.Text, want)
	}
	out, err = run(t, "", "generate", "--max-tokens", "6", "--ignore-eos", "Hello", "world")
	if err != nil {
		t.Fatal(err)
	}
	if want := resp.Text + "\nfinish: length; "; !strings.HasPrefix(out, want) {
		t.Errorf("streamed generate printed %q, want it to start with %q", out, want)
	}
	if _, err := run(t, "", "generate", "--ids", "1,99999"); err == nil || !strings.Contains(err.Error(), "InvalidArgument") {
		t.Errorf("generate with an id out of the vocabulary: %v, want InvalidArgument", err)
	}
	checkSchedulerStatus(t)
	checkGraphs(t)
	checkMoves(t)
}

// checkMoves runs rebalance, drain and undrain against the one-node
// cluster of TestStatusAndGenerate, where nothing can move: a dry run
// prints the layer maps, a rebalance to the placement in place and an
// impossible plan are refused, a drain of the only stage node keeps it
// serving and says why, and undrain puts it back. (Moves under load are
// cmd/tandemd's TestChaosDrainUndrainRebalance.)
func checkMoves(t *testing.T) {
	out, err := run(t, "", "rebalance", "--dry-run")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("tandemctl rebalance --dry-run:\n%s", out)
	for _, w := range []string{"before: KV capacity", "after: KV capacity about", "placement's estimate", "solo", "[0, 4)", "dry run: the pipeline of epoch", "already has this placement"} {
		if !strings.Contains(out, w) {
			t.Errorf("rebalance --dry-run lacks %q:\n%s", w, out)
		}
	}
	out, err = run(t, "", "rebalance", "--dry-run", "--json")
	var mv struct {
		Before, After []struct {
			Node             string
			LayerLo, LayerHi uint32
			Estimate, Reused bool
		}
		Moved bool
		Note  string
	}
	if err != nil || json.Unmarshal([]byte(out), &mv) != nil || mv.Moved || len(mv.Before) != 1 || len(mv.After) != 1 || !mv.After[0].Estimate || mv.After[0].LayerHi != 4 {
		t.Errorf("rebalance --dry-run --json: %+v, %v:\n%s", mv, err, out)
	}
	if _, err := run(t, "", "rebalance"); err == nil || !strings.Contains(err.Error(), "already has this placement") {
		t.Errorf("rebalance to the placement in place: %v, want it refused", err)
	}
	if _, err := run(t, "", "rebalance", "--plan", "solo=0-2,ghost=2-4"); err == nil || !strings.Contains(err.Error(), "ghost") {
		t.Errorf("rebalance to a plan naming no member: %v, want it refused naming the node", err)
	}
	if _, err := run(t, "", "rebalance", "--plan", "solo=3-1"); err == nil || !strings.Contains(err.Error(), "--plan") {
		t.Errorf("rebalance --plan solo=3-1: %v, want a plan error", err)
	}
	if _, err := run(t, "", "rebalance", "--by-time"); err == nil || !strings.Contains(err.Error(), "two stages or more") {
		t.Errorf("rebalance --by-time of a single stage: %v, want it refused", err)
	}
	if _, err := run(t, "", "rebalance", "--by-time", "--plan", "solo=0-4"); err == nil || !strings.Contains(err.Error(), "give one") {
		t.Errorf("rebalance --by-time --plan: %v, want it refused", err)
	}
	out, err = run(t, "", "drain", "solo")
	t.Logf("tandemctl drain solo:\n%s", out)
	if err != nil || !strings.Contains(out, "solo drained, but no placement without it is possible") || !strings.Contains(out, "keeps serving") {
		t.Errorf("drain of the only stage node: %v:\n%s", err, out)
	}
	out, err = run(t, "", "status")
	if err != nil || !strings.Contains(out, "drained:   solo") || !strings.Contains(out, "alive, drained") || !strings.Contains(out, "pipeline:  serving") {
		t.Errorf("status after the drain: %v:\n%s", err, out)
	}
	out, err = run(t, "", "undrain", "solo")
	if err != nil || !strings.Contains(out, "solo undrained: back in placement") {
		t.Errorf("undrain: %v:\n%s", err, out)
	}
	if _, err := run(t, "", "undrain", "solo"); err == nil || !strings.Contains(err.Error(), "not drained") {
		t.Errorf("undrain of a node not drained: %v, want it refused", err)
	}
}

// TestParsePlan checks the --plan syntax of rebalance.
func TestParsePlan(t *testing.T) {
	for _, tt := range []struct {
		in, want, err string
	}{
		{"", "", ""},
		{"a=0-2,b=2-4", "a[0,2) b[2,4)", ""},
		{" a=0-1 , b=1-8", "a[0,1) b[1,8)", ""},
		{"a=0-2,b", "", `"b": want NODE=LO-HI`},
		{"=0-2", "", "want NODE=LO-HI"},
		{"a=2-2", "", "are empty"},
		{"a=x-2", "", "want NODE=LO-HI"},
		{"a=-1-2", "", "want NODE=LO-HI"},
	} {
		got, err := parsePlan(tt.in)
		var parts []string
		for _, r := range got {
			parts = append(parts, fmt.Sprintf("%s[%d,%d)", r.GetNode(), r.GetLayerLo(), r.GetLayerHi()))
		}
		if tt.err != "" {
			if err == nil || !strings.Contains(err.Error(), tt.err) {
				t.Errorf("parsePlan(%q): %v, want an error with %q", tt.in, err, tt.err)
			}
			continue
		}
		if err != nil || strings.Join(parts, " ") != tt.want {
			t.Errorf("parsePlan(%q) = %v, %v; want %s", tt.in, parts, err, tt.want)
		}
	}
}

// checkGraphs checks the graphs command after the requests of
// TestStatusAndGenerate on a CPU stage: mode NONE, and a row per eager
// step size whose counts add up to the steps the JSON reports.
func checkGraphs(t *testing.T) {
	out, err := run(t, "", "graphs", "--json")
	if err != nil {
		t.Fatal(err)
	}
	var g struct {
		Mode, ConfiguredMode string
		Downgrades           []string
		Steps                []struct {
			Unpadded, Padded uint32
			Mode             string
			Count            uint64 `json:",string"`
		}
	}
	if err := json.Unmarshal([]byte(out), &g); err != nil {
		t.Fatalf("graphs --json: %v:\n%s", err, out)
	}
	var total uint64
	for _, r := range g.Steps {
		if r.Mode != "NONE" || r.Padded != r.Unpadded || r.Count == 0 {
			t.Errorf("graphs --json: row %+v, want NONE steps without padding", r)
		}
		total += r.Count
	}
	if g.Mode != "NONE" || g.ConfiguredMode != "FULL_AND_PIECEWISE" || len(g.Downgrades) != 1 || len(g.Steps) == 0 {
		t.Errorf("graphs --json: %+v, want mode NONE reduced from FULL_AND_PIECEWISE by the cpu stage, with steps", g)
	}
	out, err = run(t, "", "graphs")
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"mode: NONE (configured FULL_AND_PIECEWISE)", "downgraded: stage 0 on solo (cpu) supports NEVER", fmt.Sprintf("CUDA graph dispatch: %d steps", total)}
	for _, r := range g.Steps {
		want = append(want, fmt.Sprintf("%d| %d| 0| NONE| %d|", r.Unpadded, r.Padded, r.Count))
	}
	for _, w := range want {
		if !strings.Contains(strings.ReplaceAll(out, " ", ""), strings.ReplaceAll(w, " ", "")) {
			t.Errorf("graphs table lacks %q:\n%s", w, out)
		}
	}
	out, err = run(t, "", "status")
	if err != nil {
		t.Fatal(err)
	}
	if w := "CUDA-graph mode NONE; on-device hand-off on, up to 2 steps in flight"; !strings.Contains(out, w) {
		t.Errorf("status table lacks %q:\n%s", w, out)
	}
}

// checkSchedulerStatus checks the scheduler's figures in status after the
// two generate requests of TestStatusAndGenerate: both finished, at least
// one step per token, their KV blocks freed.
func checkSchedulerStatus(t *testing.T) {
	type schedJSON struct {
		Running, Waiting, InFlight   uint32
		KVBlocksUsed                 uint64 `json:"kvBlocksUsed,string"`
		KVBlocks                     uint64 `json:"kvBlocks,string"`
		BlockSize                    uint32
		Finished                     uint64 `json:",string"`
		Steps                        uint64 `json:",string"`
		LastStepTime, MeanStepTime   string
		Preemptions, DiscardedTokens string
	}
	var sc schedJSON
	// The figures are a snapshot taken between steps: the last one may
	// reach the client before its step's snapshot.
	for start := time.Now(); ; time.Sleep(20 * time.Millisecond) {
		out, err := run(t, "", "status", "--json")
		if err != nil {
			t.Fatal(err)
		}
		var st struct{ Scheduler schedJSON }
		if err := json.Unmarshal([]byte(out), &st); err != nil {
			t.Fatalf("status --json: %v:\n%s", err, out)
		}
		sc = st.Scheduler
		if sc.Finished == 2 || time.Since(start) > 5*time.Second {
			break
		}
	}
	if sc.Finished != 2 || sc.Running != 0 || sc.Waiting != 0 || sc.Steps < 6 || sc.KVBlocks == 0 || sc.KVBlocksUsed != 0 ||
		sc.BlockSize != 16 || sc.LastStepTime == "" || sc.LastStepTime == "0s" || sc.MeanStepTime == "0s" || sc.Preemptions != "0" {
		t.Errorf("status --json scheduler %+v: want 2 finished, none running or waiting, at least 6 steps, no KV block used, blocks of 16, step times", sc)
	}
	out, err := run(t, "", "status")
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{"requests:  0 running, 0 waiting, 2 finished, 0 cancelled", fmt.Sprintf("KV cache:  0 of %d blocks used (0.0%%), 16 positions a block", sc.KVBlocks),
		fmt.Sprintf("steps:     %d done, 0 in flight", sc.Steps)} {
		if !strings.Contains(out, w) {
			t.Errorf("status table lacks %q:\n%s", w, out)
		}
	}
}
