package main

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"

	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/model/randinit"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// TestGPUStageFailover runs, on a machine with a GPU, a leader, a CUDA
// stage daemon and a CPU stage daemon (the layers in that order), sends 8
// concurrent greedy requests of 200 tokens, and SIGKILLs the CPU stage
// mid-generation: the leader must move the whole model to the CUDA stage
// alone, and every request must complete. The tokens generated after the
// recovery must be the one-GPU tokens: for each request, the single CUDA
// stage continuing its prompt and the tokens it had received when the
// recovery was seen (one request at a time) gives exactly the rest of its
// completion. It also reports how many completions equal those of the
// same request run from scratch on the one GPU. scripts/gpu-cluster-check.sh
// (mode failover) runs it on the device; elsewhere it skips, unless
// TANDEM_FAILOVER_BACKEND=cpu runs the "GPU" stage on the CPU (a check of
// the test itself).
func TestGPUStageFailover(t *testing.T) {
	backend := os.Getenv("TANDEM_FAILOVER_BACKEND")
	if backend == "" {
		backend = "cuda"
		if err := gpu.Probe(); err != nil {
			t.Skipf("no GPU: %v (scripts/gpu-cluster-check.sh device failover runs this on a GPU machine)", err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	dir := filepath.Join(t.TempDir(), "model")
	o := randinit.DefaultOptions()
	o.Layers, o.Hidden, o.Heads, o.KVHeads, o.Intermediate, o.Seed = 8, 256, 4, 2, 512, 11
	if err := randinit.Write(dir, o); err != nil {
		t.Fatal(err)
	}
	logs := &logBuffer{}
	if out := os.Getenv("TANDEM_FAILOVER_LOG"); out != "" {
		t.Cleanup(func() { os.WriteFile(out, []byte(logs.String()), 0o644) })
	}
	spec := clusterSpec{exe: os.Args[0], env: []string{asDaemonEnv + "=1", "TANDEM_CACHE_DIR=" + filepath.Join(t.TempDir(), "kernels")},
		model: dir, logLevel: "info", stderr: logs}
	common := []string{"serve", "--model", dir, "--grpc", "127.0.0.1:0", "--gossip", "127.0.0.1:0", "--log-level", "info",
		"--leader", "leader", "--fast-gossip", "--progress", "log"}
	var procs []*daemonProc
	t.Cleanup(func() {
		for _, p := range procs {
			p.stop(30 * time.Second)
		}
		if t.Failed() {
			t.Logf("daemon logs:\n%s", logs)
		}
	})
	start := func(name string, extra ...string) *daemonProc {
		p, err := startDaemon(ctx, spec, name, append(append(slices.Clone(common), "--name", name), extra...))
		if err != nil {
			t.Fatalf("%v\n%s", err, logs)
		}
		procs = append([]*daemonProc{p}, procs...)
		return p
	}
	leader := start("leader", "--stage=false", "--expect-stages", "2")
	start("a-gpu", "--backend", backend, "--seeds", leader.Gossip)
	cpuStage := start("b-cpu", "--backend", "cpu", "--memory", "2GiB", "--seeds", leader.Gossip)
	conn, err := grpc.NewClient(leader.GRPC, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	admin := tandemv1.NewAdminClient(conn)
	mixed := awaitStatus(t, ctx, admin, "serving over the CUDA and the CPU stage", func(st *tandemv1.StatusResponse) bool {
		return st.GetServing() && len(st.GetStages()) == 2
	})
	for _, s := range mixed.GetStages() {
		t.Logf("stage %d: %s layers [%d,%d) %s %s, next link %q", s.GetIndex(), s.GetNode(), s.GetLayerLo(), s.GetLayerHi(), s.GetBackend(), s.GetDevice(), s.GetNextLink())
	}

	const n, tokens = 8, 200
	reqs := make([]*tandemv1.GenerateRequest, n)
	for i := range reqs {
		prompt := make([]int32, 5+(i*11)%40)
		for j := range prompt {
			prompt[j] = int32((i*53 + j*29 + 7) % o.Vocab)
		}
		reqs[i] = &tandemv1.GenerateRequest{PromptTokenIds: prompt, MaxTokens: tokens, IgnoreEos: true, Temperature: proto.Float32(0), Logprobs: proto.Uint32(0)}
	}
	ss := startStreams(ctx, conn, reqs)
	ss.midway(t, ctx, 30)
	cpuStage.kill()
	killed := time.Now()
	st := awaitStatus(t, ctx, admin, "the model moved to the CUDA stage alone", func(st *tandemv1.StatusResponse) bool {
		return st.GetServing() && st.GetEpoch() != mixed.GetEpoch()
	})
	recovered := time.Now()
	t.Logf("b-cpu SIGKILLed mid-generation; the leader serves again %v later over %v", recovered.Sub(killed).Round(time.Millisecond), stageNodes(st))
	if got := stageNodes(st); !slices.Equal(got, []string{"a-gpu"}) || st.GetStages()[0].GetLayerHi() != uint32(o.Layers) {
		t.Fatalf("the pipeline after the kill is %v, want a-gpu alone with every layer", got)
	}
	{
		s := st.GetStages()[0]
		t.Logf("after the recovery: %s layers [%d,%d) %s %s, KV %d tokens, CUDA-graph mode %s, %d graphs", s.GetNode(), s.GetLayerLo(), s.GetLayerHi(),
			s.GetBackend(), s.GetDevice(), s.GetKvTokens(), st.GetGraphMode(), s.GetGraphs())
	}
	ss.wg.Wait()
	// The split: tokens received before the recovery was seen may come
	// from either pipeline; every later one came from the GPU alone.
	split := make([]int, n)
	for i, s := range ss.s {
		for _, at := range s.at {
			if at.Before(recovered) {
				split[i]++
			}
		}
	}
	// The one GPU continues each prompt and the tokens received before the
	// recovery (all 8 at once, as after the recovery): it must give the
	// rest. And the same requests from scratch, all at once.
	conts := make([]*tandemv1.GenerateRequest, n)
	for i, s := range ss.s {
		k := min(split[i], len(s.ids))
		conts[i] = &tandemv1.GenerateRequest{PromptTokenIds: append(slices.Clone(reqs[i].GetPromptTokenIds()), s.ids[:k]...),
			MaxTokens: uint32(tokens - k), IgnoreEos: true, Temperature: proto.Float32(0)}
	}
	cs := startStreams(ctx, conn, conts)
	cs.wg.Wait()
	fresh := startStreams(ctx, conn, reqs)
	fresh.wg.Wait()
	completed, continued, whole := 0, 0, 0
	var worst time.Duration
	for i, s := range ss.s {
		if s.err != nil || !s.finished || len(s.ids) != tokens {
			t.Errorf("request %d: %d tokens, finished %t, error %v; want %d", i, len(s.ids), s.finished, s.err, tokens)
			continue
		}
		completed++
		for j := 1; j < len(s.at); j++ {
			worst = max(worst, s.at[j].Sub(s.at[j-1]))
		}
		k, g := split[i], cs.s[i]
		if g.err != nil || !slices.Equal(g.ids, s.ids[k:]) {
			first := -1
			for j := range min(len(g.ids), len(s.ids)-k) {
				if g.ids[j] != s.ids[k+j] {
					first = j
					break
				}
			}
			t.Errorf("request %d: the %d tokens after the recovery (from token %d) are not the one GPU's continuation (%d tokens, first difference at %d, %v)", i, tokens-k, k, len(g.ids), first, g.err)
		} else {
			continued++
		}
		if f := fresh.s[i]; f.err == nil && slices.Equal(f.ids, s.ids) {
			whole++
		}
	}
	t.Logf("%d of %d requests in flight completed; %d of %d continue after the recovery exactly as the one GPU does; %d of %d equal the one-GPU run from scratch in full; the longest pause a stream saw %v",
		completed, n, continued, n, whole, n, worst.Round(time.Millisecond))
	t.Logf("split points (tokens received before the recovery was seen): %v", split)
}
