package main

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// gapStats are the inter-token gaps of streams, split into those before a
// move began (steady state) and those overlapping it.
type gapStats struct {
	steady, during []time.Duration
}

// gaps sorts each stream's inter-token gaps by whether they overlap the
// move [from, to]: a gap overlapping it is one the move may have
// lengthened.
func (ss *streams) gaps(from, to time.Time) gapStats {
	var g gapStats
	for _, s := range ss.s {
		for j := 1; j < len(s.at); j++ {
			a, b := s.at[j-1], s.at[j]
			switch {
			case !b.Before(from) && !a.After(to):
				g.during = append(g.during, b.Sub(a))
			case b.Before(from):
				g.steady = append(g.steady, b.Sub(a))
			}
		}
	}
	return g
}

// quantile is the q-quantile of ds (nearest rank; 0 when empty).
func quantile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	i := int(math.Ceil(q*float64(len(s)))) - 1
	return s[max(i, 0)]
}

// layerMap writes a MoveResponse's stages as node[lo,hi) with "*" on the
// reused ones.
func layerMap(stages []*tandemv1.PlannedStage) string {
	var parts []string
	for _, s := range stages {
		r := ""
		if s.GetReused() {
			r = "*"
		}
		parts = append(parts, fmt.Sprintf("%s[%d,%d)%s", s.GetNode(), s.GetLayerLo(), s.GetLayerHi(), r))
	}
	return strings.Join(parts, " ")
}

// checkReuse checks that exactly the stages whose node and layers did not
// change were reused (kept their weights), and returns how many.
func checkReuse(t *testing.T, what string, r *tandemv1.MoveResponse) int {
	t.Helper()
	n := 0
	for _, a := range r.GetAfter() {
		same := slices.ContainsFunc(r.GetBefore(), func(b *tandemv1.PlannedStage) bool {
			return b.GetNode() == a.GetNode() && b.GetLayerLo() == a.GetLayerLo() && b.GetLayerHi() == a.GetLayerHi()
		})
		if a.GetReused() != same {
			t.Errorf("%s: stage %s[%d,%d) reused %t, want %t (before: %s)", what, a.GetNode(), a.GetLayerLo(), a.GetLayerHi(), a.GetReused(), same, layerMap(r.GetBefore()))
		}
		if same {
			n++
		}
	}
	return n
}

// moveUnderLoad runs n chaos requests on the cluster, applies a move
// midway (move returns the admin answer, once the requests run on the new
// pipeline), and checks every request completes with the tokens of the
// healthy run. It logs and returns the move's figures.
func moveUnderLoad(t *testing.T, ctx context.Context, c *localCluster, reqs []*tandemv1.GenerateRequest, want [][]int32, what string,
	move func() (*tandemv1.MoveResponse, error)) *tandemv1.MoveResponse {
	t.Helper()
	ss := startStreams(ctx, c.Conn, reqs)
	ss.midway(t, ctx, 30)
	start := time.Now()
	r, err := move()
	end := time.Now()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	if r.GetMoveTime() != nil && (r.GetRequestsReprefilled() == 0 || int(r.GetRequestsReprefilled()) > len(reqs)) {
		t.Errorf("%s: %d running requests re-prefilled, want some of the %d under way", what, r.GetRequestsReprefilled(), len(reqs))
	}
	survived, pause := ss.check(t, want)
	g := ss.gaps(start, end)
	t.Logf("%s: moved %t to epoch %d in %v (the call: %v): [%s] -> [%s] (* reused), KV %d -> %d tokens, %d running requests re-prefilled; %s",
		what, r.GetMoved(), r.GetEpoch(), r.GetMoveTime().AsDuration().Round(time.Millisecond), end.Sub(start).Round(time.Millisecond),
		layerMap(r.GetBefore()), layerMap(r.GetAfter()), r.GetBeforeKvTokens(), r.GetAfterKvTokens(), r.GetRequestsReprefilled(), r.GetNote())
	t.Logf("%s: %d of %d requests completed with the tokens of the healthy run; inter-token latency p50/p99 %v/%v in steady state (%d gaps), p99 %v and max %v over the move (%d gaps); longest pause a stream saw %v",
		what, survived, len(reqs), quantile(g.steady, 0.5).Round(time.Microsecond), quantile(g.steady, 0.99).Round(time.Microsecond), len(g.steady),
		quantile(g.during, 0.99).Round(time.Millisecond), quantile(g.during, 1).Round(time.Millisecond), len(g.during), pause.Round(time.Millisecond))
	return r
}

// TestChaosDrainUndrainRebalance moves the pipeline of a leader and 3 CPU
// stage daemons (separate processes) three times, each under a load of 12
// concurrent streams (greedy and seeded) of 200 tokens: (b) drains the
// middle stage node, (c) undrains it, which auto-rebalance follows at
// once (the membership has been stable), and rebalances to an explicit
// plan. Each move is built beside the serving pipeline, a stage whose
// layers do not change keeps its weights, the requests switch at a step
// boundary and re-prefill: every request must complete with the tokens
// of the healthy run, the status must show the drained node and the last
// change, the metrics must count the moves and the re-prefilled tokens,
// and nothing may leak (requests, KV blocks, goroutines). It reports the
// pause each move caused (p99 inter-token latency over the move against
// steady state) and the time to move.
func TestChaosDrainUndrainRebalance(t *testing.T) {
	if testing.Short() {
		t.Skip("a multi-process chaos run: not in -short")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dir := testModel(t)
	const n = 12
	reqs, want := chaosRequests(t, dir, n, 200)
	metrics := freeAddr(t)
	c, logs := startClusterSpec(t, ctx, clusterSpec{model: dir, stages: 3, leaderExtra: []string{"--metrics", metrics}})
	admin := tandemv1.NewAdminClient(c.Conn)
	healthy := awaitStatus(t, ctx, admin, "serving", func(st *tandemv1.StatusResponse) bool { return st.GetServing() && len(st.GetStages()) == 3 })
	before := servedGoroutines(t, ctx, c, metrics)

	// (b) Drain the middle stage node under load.
	r := moveUnderLoad(t, ctx, c, reqs, want, "drain stage-2", func() (*tandemv1.MoveResponse, error) {
		return admin.Drain(ctx, &tandemv1.DrainRequest{Node: "stage-2"})
	})
	if !r.GetMoved() || len(r.GetAfter()) != 2 || slices.ContainsFunc(r.GetAfter(), func(s *tandemv1.PlannedStage) bool { return s.GetNode() == "stage-2" }) {
		t.Fatalf("drain: %v, want a move to the two other stage nodes", r)
	}
	checkReuse(t, "drain", r)
	st, err := admin.Status(ctx, &tandemv1.StatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(st.GetDrained(), []string{"stage-2"}) || !slices.ContainsFunc(st.GetMembers(), func(m *tandemv1.Member) bool {
		return m.GetName() == "stage-2" && m.GetState() == tandemv1.MemberState_MEMBER_STATE_ALIVE
	}) {
		t.Errorf("after the drain: drained %v, members %v; want stage-2 drained and still an alive member", st.GetDrained(), st.GetMembers())
	}
	if lc := st.GetLastChange(); lc.GetKind() != "move" || lc.GetInProgress() || lc.GetEpoch() != r.GetEpoch() || lc.GetRequestsReprefilled() != r.GetRequestsReprefilled() {
		t.Errorf("after the drain: last change %v, want the move to epoch %d", lc, r.GetEpoch())
	}
	// The drained node released its stage.
	awaitLog(t, ctx, logs, "stage-2 released its stage", func(l string) bool {
		return strings.Contains(l, "node=stage-2") && strings.Contains(l, fmt.Sprintf("epoch=%d", healthy.GetEpoch())) &&
			(strings.Contains(l, `msg="stage released"`) || strings.Contains(l, `msg="stage finished`))
	})

	// (c) Undrain it: auto-rebalance takes it back in at once, since the
	// membership has been stable for longer than 5s; if not yet, the move
	// follows within seconds.
	moved := r.GetEpoch()
	r = moveUnderLoad(t, ctx, c, reqs, want, "undrain stage-2", func() (*tandemv1.MoveResponse, error) {
		r, err := admin.Undrain(ctx, &tandemv1.UndrainRequest{Node: "stage-2"})
		if err != nil || r.GetMoved() {
			return r, err
		}
		st := awaitStatus(t, ctx, admin, "auto-rebalance takes stage-2 back", func(st *tandemv1.StatusResponse) bool {
			return st.GetServing() && st.GetEpoch() != moved && slices.Contains(stageNodes(st), "stage-2")
		})
		r.Moved, r.Epoch, r.After = true, st.GetEpoch(), nil
		for _, s := range st.GetStages() {
			r.After = append(r.After, &tandemv1.PlannedStage{Node: s.GetNode(), LayerLo: s.GetLayerLo(), LayerHi: s.GetLayerHi(), KvTokens: s.GetKvTokens(), Reused: s.GetReused()})
		}
		return r, nil
	})
	if !r.GetMoved() || !slices.ContainsFunc(r.GetAfter(), func(s *tandemv1.PlannedStage) bool { return s.GetNode() == "stage-2" }) {
		t.Fatalf("undrain: %v, want stage-2 back in the pipeline", r)
	}
	checkReuse(t, "undrain", r)

	// (c) An explicit rebalance that keeps the last stage's layers.
	plan := rebalancePlan(t, r.GetAfter())
	r = moveUnderLoad(t, ctx, c, reqs, want, "rebalance "+planText(plan), func() (*tandemv1.MoveResponse, error) {
		return admin.Rebalance(ctx, &tandemv1.RebalanceRequest{Plan: plan})
	})
	if !r.GetMoved() || checkReuse(t, "rebalance", r) == 0 {
		t.Errorf("rebalance: %v, want a move that reuses a stage", r)
	}
	for i, s := range r.GetAfter() {
		if p := plan[i]; s.GetNode() != p.GetNode() || s.GetLayerLo() != p.GetLayerLo() || s.GetLayerHi() != p.GetLayerHi() {
			t.Errorf("rebalance: stage %d is %s[%d,%d), want the plan's %s", i, s.GetNode(), s.GetLayerLo(), s.GetLayerHi(), planText(plan))
		}
	}
	// A dry run to the same placement moves nothing.
	dry, err := admin.Rebalance(ctx, &tandemv1.RebalanceRequest{Plan: plan, DryRun: true})
	if err != nil || dry.GetMoved() || !strings.Contains(dry.GetNote(), "already has this placement") {
		t.Errorf("dry run to the placement in place: %v, %v", dry, err)
	}

	// The metrics count the moves (drain: a move; undrain and the
	// explicit plan: rebalances) and the re-prefilled requests and tokens.
	st, err = admin.Status(ctx, &tandemv1.StatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	body := metricsText(t, ctx, metrics)
	for _, w := range []string{`tandem_pipeline_changes_total{kind="move"} 1`, `tandem_pipeline_changes_total{kind="rebalance"} 2`, `tandem_pipeline_changes_total{kind="recovery"} 0`} {
		if !strings.Contains(body, w) {
			t.Errorf("metrics lack %q", w)
		}
	}
	if sc := st.GetScheduler(); sc.GetReprefilled() == 0 || !strings.Contains(body, fmt.Sprintf("tandem_reprefilled_requests_total %d", sc.GetReprefilled())) ||
		!strings.Contains(body, fmt.Sprintf("tandem_reprefilled_tokens_total %d", sc.GetReprefilledTokens())) {
		t.Errorf("metrics do not count the %d re-prefilled requests (%d tokens) the status reports", sc.GetReprefilled(), sc.GetReprefilledTokens())
	}
	t.Logf("after three moves: %d moves counted, %d requests re-prefilled (%d tokens)", st.GetMoves(), st.GetScheduler().GetReprefilled(), st.GetScheduler().GetReprefilledTokens())
	checkNothingHeld(t, ctx, admin, metrics, before, uint64(3*n+1))
}

// rebalancePlan is a plan over the stages of after that keeps the last
// stage's layers and moves the boundary between the first two.
func rebalancePlan(t *testing.T, after []*tandemv1.PlannedStage) []*tandemv1.LayerRange {
	t.Helper()
	if len(after) != 3 {
		t.Fatalf("want 3 stages to rebalance, have %s", layerMap(after))
	}
	a, b, last := after[0], after[1], after[2]
	cut := a.GetLayerLo() + 1
	if cut == a.GetLayerHi() {
		cut++
	}
	if cut >= b.GetLayerHi() {
		t.Fatalf("no other cut between %s", layerMap(after))
	}
	return []*tandemv1.LayerRange{
		{Node: a.GetNode(), LayerLo: 0, LayerHi: cut},
		{Node: b.GetNode(), LayerLo: cut, LayerHi: b.GetLayerHi()},
		{Node: last.GetNode(), LayerLo: last.GetLayerLo(), LayerHi: last.GetLayerHi()},
	}
}

func planText(p []*tandemv1.LayerRange) string {
	var parts []string
	for _, r := range p {
		parts = append(parts, fmt.Sprintf("%s=%d-%d", r.GetNode(), r.GetLayerLo(), r.GetLayerHi()))
	}
	return strings.Join(parts, ",")
}

// awaitLog waits until a line of the daemons' logs satisfies cond, for at
// most 10s.
func awaitLog(t *testing.T, ctx context.Context, logs *logBuffer, what string, cond func(line string) bool) {
	t.Helper()
	for start := time.Now(); ; {
		if slices.ContainsFunc(strings.Split(logs.String(), "\n"), cond) {
			return
		}
		if time.Since(start) > 10*time.Second || ctx.Err() != nil {
			t.Fatalf("%s: not in the logs within 10s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// servedGoroutines has the leader serve a request, so that the goroutines
// counted are those of a leader that has served, and returns its
// goroutines (go_goroutines of its /metrics at metrics).
func servedGoroutines(t *testing.T, ctx context.Context, c *localCluster, metrics string) int {
	t.Helper()
	if _, err := generate(ctx, c.Conn, &tandemv1.GenerateRequest{PromptTokenIds: []int32{1, 2}, MaxTokens: 4}); err != nil {
		t.Fatal(err)
	}
	n, err := goroutines(ctx, metrics)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// checkNothingHeld waits until the leader holds no request, step or KV
// block, has finished the requests it was sent, and its goroutines are
// back to before.
func checkNothingHeld(t *testing.T, ctx context.Context, admin tandemv1.AdminClient, metrics string, before int, finished uint64) {
	t.Helper()
	var after int
	var err error
	awaitStatus(t, ctx, admin, "nothing held and the goroutines back", func(st *tandemv1.StatusResponse) bool {
		sc := st.GetScheduler()
		if after, err = goroutines(ctx, metrics); err != nil {
			t.Fatal(err)
		}
		return sc.GetRunning()+sc.GetWaiting()+sc.GetInFlight() == 0 && sc.GetKvBlocksUsed() == 0 && after <= before+3 && sc.GetFinished() == finished
	})
	t.Logf("nothing held after the chaos: no request, no KV block; the leader's goroutines %d (%d before)", after, before)
}
