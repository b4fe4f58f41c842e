package main

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// TestTinyStageLeftOut runs a leader and two CPU stage daemons, stage-1
// and stage-2, then a third, stage-1b, whose memory budget (48 MiB) is
// below a stage's workspace: it cannot hold one layer. The leader must
// place over the others and say why it left stage-1b out. Then stage-2 is
// SIGKILLed under 4 streams: the recovery must place the model over
// stage-1 alone (stage-1b left out again, not failing the placement) and
// every request complete with the tokens of a healthy run; restarted,
// stage-2 must rejoin the pipeline (auto-rebalance, which stage-1b must
// not block either), and a dry-run rebalance name stage-1b left out.
func TestTinyStageLeftOut(t *testing.T) {
	if testing.Short() {
		t.Skip("a multi-process run: not in -short")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := testModel(t)
	reqs, want := chaosRequests(t, dir, 4, 100)
	c, logs := startClusterSpec(t, ctx, clusterSpec{model: dir, stages: 2})
	admin := tandemv1.NewAdminClient(c.Conn)
	healthy := awaitStatus(t, ctx, admin, "serving", func(st *tandemv1.StatusResponse) bool { return st.GetServing() })
	tiny, err := startDaemon(ctx, c.spec, "stage-1b", append(c.spec.stageArgs("stage-1b", c.Leader.Gossip), "--memory", "48MiB"))
	if err != nil {
		t.Fatal(err)
	}
	c.Stages = append(c.Stages, tiny)
	awaitStatus(t, ctx, admin, "stage-1b a member", func(st *tandemv1.StatusResponse) bool {
		return slices.ContainsFunc(st.GetMembers(), func(m *tandemv1.Member) bool {
			return m.GetName() == "stage-1b" && m.GetState() == tandemv1.MemberState_MEMBER_STATE_ALIVE
		})
	})

	ss := startStreams(ctx, c.Conn, reqs)
	ss.midway(t, ctx, 20)
	c.Stages[1].kill()
	killed := time.Now()
	leftOut := func(st *tandemv1.StatusResponse) string {
		for _, l := range st.GetLeftOut() {
			if l.GetNode() == "stage-1b" {
				return l.GetReason()
			}
		}
		return ""
	}
	st := awaitStatus(t, ctx, admin, "a pipeline over stage-1 alone", func(st *tandemv1.StatusResponse) bool {
		return st.GetServing() && st.GetEpoch() != healthy.GetEpoch() && slices.Equal(stageNodes(st), []string{"stage-1"}) && leftOut(st) != ""
	})
	t.Logf("stage-2 SIGKILLed; the leader serves again %v later over %v, left out: stage-1b %s", time.Since(killed).Round(time.Millisecond), stageNodes(st), leftOut(st))
	if why := leftOut(st); !strings.Contains(why, "cannot hold one layer: has 50331648 bytes usable") {
		t.Errorf("stage-1b left out because %q, want that it cannot hold one layer in its 48 MiB", why)
	}
	survived, pause := ss.check(t, want)
	t.Logf("%d of %d requests survived with the tokens of the healthy run; the longest pause a stream saw: %v", survived, len(reqs), pause.Round(time.Millisecond))
	if !strings.Contains(logs.String(), "left out of placement: stage-1b") {
		t.Error("the leader's log does not say it left stage-1b out")
	}

	restarted, err := c.restart(ctx, c.Stages[1])
	if err != nil {
		t.Fatal(err)
	}
	st = awaitStatus(t, ctx, admin, "the restarted stage rejoins", func(st *tandemv1.StatusResponse) bool {
		return st.GetServing() && slices.Contains(stageNodes(st), restarted.Name)
	})
	t.Logf("restarted stage-2 rejoined: %v (epoch %d), stage-1b still left out: %t", stageNodes(st), st.GetEpoch(), leftOut(st) != "")
	if slices.Contains(stageNodes(st), "stage-1b") || leftOut(st) == "" {
		t.Errorf("after the rejoin: stages %v, left out %v; want stage-1b left out", stageNodes(st), st.GetLeftOut())
	}
	// A dry-run rebalance names it too, as tandemctl rebalance prints.
	r, err := admin.Rebalance(ctx, &tandemv1.RebalanceRequest{DryRun: true})
	if err != nil || len(r.GetLeftOut()) != 1 || r.GetLeftOut()[0].GetNode() != "stage-1b" || !strings.Contains(r.GetLeftOut()[0].GetReason(), "cannot hold one layer") {
		t.Errorf("dry-run rebalance: %v (%v), want stage-1b left out", r, err)
	}
	if got, err := generate(ctx, c.Conn, reqs[0]); err != nil || !slices.Equal(got.ids, want[0]) {
		t.Errorf("after the rejoin: %d tokens (%v), want request 0's %d", len(got.ids), err, len(want[0]))
	}
}
