package main

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tandem-llm/tandem/model/randinit"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// TestBalanceByTime runs a leader with --balance-by-time-after and two CPU
// stage daemons over a model whose LM head (a 16,384-token vocabulary over
// a hidden size of 64) takes several layers' time: placed by memory, its
// 8 layers split 4/4 and the last stage, which also runs the head and the
// sampler, is the slowest by far. Under load the leader must move the
// pipeline by itself to the split the stages' own times call for (more
// layers on stage-1), every request completing with the tokens of a
// healthy run, and then keep it (pinned until the membership changes).
func TestBalanceByTime(t *testing.T) {
	if testing.Short() {
		t.Skip("a multi-process run: not in -short")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dir := filepath.Join(t.TempDir(), "model")
	o := randinit.DefaultOptions()
	o.Layers, o.Vocab, o.Seed = 8, 16384, 11
	if err := randinit.Write(dir, o); err != nil {
		t.Fatal(err)
	}
	reqs, want := chaosRequests(t, dir, 8, 400)
	c, _ := startClusterSpec(t, ctx, clusterSpec{model: dir, stages: 2, leaderExtra: []string{"--balance-by-time-after=200ms"}})
	admin := tandemv1.NewAdminClient(c.Conn)
	layers := func(st *tandemv1.StatusResponse) []uint32 {
		var l []uint32
		for _, s := range st.GetStages() {
			l = append(l, s.GetLayerHi()-s.GetLayerLo())
		}
		return l
	}
	healthy := awaitStatus(t, ctx, admin, "serving", func(st *tandemv1.StatusResponse) bool {
		return st.GetServing() && len(st.GetStages()) == 2
	})
	before := layers(healthy)
	if before[0] != 4 || before[1] != 4 {
		t.Fatalf("placed by memory: %v layers on %v, want 4 and 4", before, stageNodes(healthy))
	}

	ss := startStreams(ctx, c.Conn, reqs)
	st := awaitStatus(t, ctx, admin, "the leader balancing the stages by time", func(st *tandemv1.StatusResponse) bool {
		return st.GetServing() && st.GetEpoch() != healthy.GetEpoch() && strings.Contains(st.GetLastChange().GetWhy(), "balances the stages' times")
	})
	after := layers(st)
	t.Logf("layers %v -> %v on %v: %s", before, after, stageNodes(st), st.GetLastChange().GetWhy())
	if after[0] <= before[0] || after[0]+after[1] != 8 {
		t.Errorf("balanced by time: %v layers, want more than %d on stage-1 (the last stage runs the head)", after, before[0])
	}
	survived, pause := ss.check(t, want)
	t.Logf("%d of %d requests completed with the tokens of a healthy run; the longest pause a stream saw: %v", survived, len(reqs), pause.Round(time.Millisecond))

	// Pinned: more load measures the new placement, but nothing moves.
	ss = startStreams(ctx, c.Conn, reqs[:4])
	ss.check(t, want[:4])
	if now, err := admin.Status(ctx, &tandemv1.StatusRequest{}); err != nil || now.GetEpoch() != st.GetEpoch() {
		t.Errorf("after more load: epoch %d (%v), want the balanced pipeline's %d kept", now.GetEpoch(), err, st.GetEpoch())
	}
}
