package main

import (
	"context"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// TestLeaderFailover runs three tandemd processes, a, b and c, that each
// hold a stage and may lead, with no leader configured and gossip at its
// default (LAN) timings: a, the smallest name, leads. It SIGKILLs a while
// 12 streams run on it. The requests in flight on a fail at their client
// (the leader held their tokens: they die with it); b must lead and serve
// within 10s, over its own stage and c's, with the tokens of a healthy
// run, and c must answer a Generate with UNAVAILABLE naming b.
func TestLeaderFailover(t *testing.T) {
	if testing.Short() {
		t.Skip("a multi-process run: not in -short")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := testModel(t)
	const n = 12
	reqs, want := chaosRequests(t, dir, n, 300)
	logs := &logBuffer{}
	spec := clusterSpec{exe: os.Args[0], env: []string{asDaemonEnv + "=1"}, model: dir, logLevel: "info", stderr: logs}
	common := []string{"serve", "--model", dir, "--grpc", "127.0.0.1:0", "--gossip", "127.0.0.1:0", "--log-level", "info",
		"--memory", "1GiB", "--backend", "cpu", "--progress", "log", "--expect-stages", "3"}
	var procs []*daemonProc
	t.Cleanup(func() {
		for _, p := range slices.Backward(procs) {
			if err := p.stop(30 * time.Second); err != nil && p.Name != "a" {
				t.Errorf("stop %s: %v", p.Name, err)
			}
		}
		if t.Failed() {
			t.Logf("daemon logs:\n%s", logs)
		}
	})
	var seeds []string
	for _, name := range []string{"a", "b", "c"} {
		args := append(slices.Clone(common), "--name", name)
		if len(seeds) > 0 {
			args = append(args, "--seeds", strings.Join(seeds, ","))
		}
		p, err := startDaemon(ctx, spec, name, args)
		if err != nil {
			t.Fatalf("%v\n%s", err, logs)
		}
		procs = append(procs, p)
		seeds = append(seeds, p.Gossip)
	}
	dial := func(p *daemonProc) *grpc.ClientConn {
		conn, err := grpc.NewClient(p.GRPC, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return conn
	}
	a, b, c := procs[0], procs[1], procs[2]
	connA, connB, connC := dial(a), dial(b), dial(c)
	st := awaitStatus(t, ctx, tandemv1.NewAdminClient(connA), "a leads and serves", func(st *tandemv1.StatusResponse) bool {
		return st.GetServing() && len(st.GetStages()) == 3
	})
	t.Logf("a leads a pipeline over %v", stageNodes(st))

	ss := startStreams(ctx, connA, reqs)
	ss.midway(t, ctx, 20)
	a.kill()
	killed := time.Now()
	procs = procs[1:]
	// b leads and serves within 10s: a Generate on b gives the healthy
	// tokens.
	st = awaitStatus(t, ctx, tandemv1.NewAdminClient(connB), "b leads and serves", func(st *tandemv1.StatusResponse) bool {
		return st.GetServing() && st.GetLeader() == "b"
	})
	serving := time.Since(killed)
	got, err := generate(ctx, connB, reqs[0])
	answered := time.Since(killed)
	if err != nil || !slices.Equal(got.ids, want[0]) {
		t.Errorf("a request on b after the failover: %d tokens, %v; want the %d of the healthy run", len(got.ids), err, len(want[0]))
	}
	t.Logf("a SIGKILLed mid-generation; b leads and serves %v later over %v (a request answered %v after the kill)",
		serving.Round(time.Millisecond), stageNodes(st), answered.Round(time.Millisecond))
	if serving > 10*time.Second {
		t.Errorf("b served %v after the leader died, want within 10s", serving)
	}
	if slices.Contains(stageNodes(st), "a") {
		t.Errorf("b's pipeline %v holds the dead node", stageNodes(st))
	}
	// The requests in flight on a failed at their clients.
	ss.wg.Wait()
	failed := 0
	for i, s := range ss.s {
		switch {
		case s.err != nil:
			failed++
		case s.finished && slices.Equal(s.ids, want[i]):
			// Finished before the kill.
		default:
			t.Errorf("request %d on the dead leader: %d tokens, no error", i, len(s.ids))
		}
	}
	t.Logf("%d of the %d requests in flight on a failed at their client (the leader's death ends its requests)", failed, n)
	if failed == 0 {
		t.Error("no request in flight on the killed leader failed")
	}
	// c is not the leader: it names b.
	_, err = generate(ctx, connC, reqs[0])
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "the leader is b at "+b.GRPC) {
		t.Errorf("Generate on c: %v, want UNAVAILABLE naming the leader b at %s", err, b.GRPC)
	}
}
