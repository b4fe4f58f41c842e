package main

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"

	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// freeAddr is a loopback address with a port that was free a moment ago.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// scrape reads a daemon's /metrics.
func scrape(ctx context.Context, addr string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

// metricsText is a daemon's /metrics, failing t when it cannot be read.
func metricsText(t *testing.T, ctx context.Context, addr string) string {
	t.Helper()
	body, err := scrape(ctx, addr)
	if err != nil {
		t.Fatal(err)
	}
	return body
}

// goroutines reads go_goroutines from a daemon's /metrics.
func goroutines(ctx context.Context, addr string) (int, error) {
	body, err := scrape(ctx, addr)
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(body, "\n") {
		if v, ok := strings.CutPrefix(l, "go_goroutines "); ok {
			return strconv.Atoi(v)
		}
	}
	return 0, errors.New("no go_goroutines in /metrics")
}

// chaosRequests are n requests of maxTokens tokens each (ignoring EOS),
// prompts of 3 to 31 tokens, every other one sampled with a seed, and the
// tokens of each in a healthy run: the single-process reference, which a
// cluster gives (TestStageSplits).
func chaosRequests(t *testing.T, dir string, n, maxTokens int) ([]*tandemv1.GenerateRequest, [][]int32) {
	t.Helper()
	reqs := make([]*tandemv1.GenerateRequest, n)
	want := make([][]int32, n)
	for i := range reqs {
		prompt := make([]int32, 3+(i*7)%29)
		for j := range prompt {
			prompt[j] = int32((i*37 + j*11 + 1) % 512)
		}
		// Greedy, or sampled: every sampling field set, so that the
		// model's generation defaults play no part.
		reqs[i] = &tandemv1.GenerateRequest{PromptTokenIds: prompt, MaxTokens: uint32(maxTokens), IgnoreEos: true, Logprobs: proto.Uint32(0),
			Temperature: proto.Float32(0), TopK: proto.Int32(0), TopP: proto.Float32(0)}
		if i%2 == 1 {
			reqs[i].Temperature, reqs[i].TopK, reqs[i].TopP, reqs[i].Seed = proto.Float32(0.8), proto.Int32(40), proto.Float32(0.95), uint64(1000+i)
		}
		for _, s := range reference(t, dir, reqs[i]) {
			want[i] = append(want[i], s.Token)
		}
	}
	return reqs, want
}

// stream is one chaos request as its client saw it.
type stream struct {
	ids      []int32
	lps      []*tandemv1.TokenLogprobs // with each token, when the request asks for log-probabilities
	at       []time.Time               // when each token arrived
	err      error
	finished bool
}

// streams are chaos requests in flight, each read by a goroutine.
type streams struct {
	s        []*stream
	progress chan int // a stream's index, for each message it received
	wg       sync.WaitGroup
}

// startStreams sends every request to the leader behind conn at once.
func startStreams(ctx context.Context, conn *grpc.ClientConn, reqs []*tandemv1.GenerateRequest) *streams {
	ss := &streams{progress: make(chan int, 1<<16)}
	for i, r := range reqs {
		s := &stream{}
		ss.s = append(ss.s, s)
		ss.wg.Go(func() {
			st, err := tandemv1.NewInferenceClient(conn).Generate(ctx, r)
			if err != nil {
				s.err = err
				return
			}
			for {
				msg, err := st.Recv()
				if errors.Is(err, io.EOF) {
					return
				}
				if err != nil {
					s.err = err
					return
				}
				for range msg.GetTokenIds() {
					s.at = append(s.at, time.Now())
				}
				s.ids = append(s.ids, msg.GetTokenIds()...)
				s.lps = append(s.lps, msg.GetLogprobs()...)
				s.finished = s.finished || msg.GetFinishReason() == tandemv1.FinishReason_FINISH_REASON_LENGTH
				select {
				case ss.progress <- i:
				default:
				}
			}
		})
	}
	return ss
}

// midway waits until every stream has k tokens.
func (ss *streams) midway(t *testing.T, ctx context.Context, k int) {
	t.Helper()
	counts := make([]int, len(ss.s))
	for slices.Min(counts) < k {
		select {
		case i := <-ss.progress:
			counts[i]++
		case <-ctx.Done():
			t.Fatalf("the streams did not reach %d tokens: %v", k, counts)
		}
	}
}

// check waits for every stream to end and checks each got exactly the
// tokens of the healthy run, with no error; it returns how many did and
// the longest pause between two tokens any stream saw.
func (ss *streams) check(t *testing.T, want [][]int32) (survived int, pause time.Duration) {
	t.Helper()
	ss.wg.Wait()
	for i, s := range ss.s {
		if s.err != nil || !s.finished || !slices.Equal(s.ids, want[i]) {
			t.Errorf("request %d: %d tokens, finished %t, error %v; want the %d tokens of the healthy run", i, len(s.ids), s.finished, s.err, len(want[i]))
			continue
		}
		survived++
		for j := 1; j < len(s.at); j++ {
			pause = max(pause, s.at[j].Sub(s.at[j-1]))
		}
	}
	return survived, pause
}

// restart starts a daemon that exited again, with the same flags (its
// ports, chosen by the system, differ), in place of the old one.
func (c *localCluster) restart(ctx context.Context, p *daemonProc) (*daemonProc, error) {
	n, err := startDaemon(ctx, c.spec, p.Name, p.args)
	if err != nil {
		return nil, err
	}
	for i, s := range c.Stages {
		if s == p {
			c.Stages[i] = n
		}
	}
	return n, nil
}

// stageNodes are the nodes of the leader's pipeline, in order.
func stageNodes(st *tandemv1.StatusResponse) []string {
	var out []string
	for _, s := range st.GetStages() {
		out = append(out, s.GetNode())
	}
	return out
}

// awaitStatus polls the leader's status until cond holds, for at most a
// minute, and returns it.
func awaitStatus(t *testing.T, ctx context.Context, admin tandemv1.AdminClient, what string, cond func(*tandemv1.StatusResponse) bool) *tandemv1.StatusResponse {
	t.Helper()
	start := time.Now()
	for {
		st, err := admin.Status(ctx, &tandemv1.StatusRequest{})
		if err == nil && cond(st) {
			return st
		}
		if time.Since(start) > time.Minute {
			t.Fatalf("%s: not within a minute: %v (%v)", what, st, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestChaosStageKilled runs 12 concurrent streams of 300 tokens (greedy
// and seeded sampling) on a cluster of a leader and 3 CPU stage daemons
// (separate processes), SIGKILLs the middle stage mid-generation and
// restarts it once the leader has rebuilt the pipeline without it. Every
// request must complete with exactly the tokens of a healthy run (the
// single-process reference, which the cluster gives: TestStageSplits),
// no stream may see an error, the restarted node must rejoin the pipeline
// (auto-rebalance), and nothing may leak: no request, waiting request or
// KV block left on the leader, and its goroutines back to their number
// before the chaos. It reports the requests that survived, the time the
// leader took to serve again, the longest pause a stream saw and the time
// to rejoin.
func TestChaosStageKilled(t *testing.T) {
	if testing.Short() {
		t.Skip("a multi-process chaos run: not in -short")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	dir := testModel(t)
	const n = 12
	reqs, want := chaosRequests(t, dir, n, 300)
	metrics := freeAddr(t)
	c, logs := startClusterSpec(t, ctx, clusterSpec{model: dir, stages: 3, leaderExtra: []string{"--metrics", metrics}})
	admin := tandemv1.NewAdminClient(c.Conn)
	healthy := awaitStatus(t, ctx, admin, "serving", func(st *tandemv1.StatusResponse) bool { return st.GetServing() })
	if got := stageNodes(healthy); !slices.Equal(got, []string{"stage-1", "stage-2", "stage-3"}) {
		t.Fatalf("stages %v, want the three stage daemons", got)
	}
	before := servedGoroutines(t, ctx, c, metrics)

	ss := startStreams(ctx, c.Conn, reqs)
	ss.midway(t, ctx, 20)
	victim := c.Stages[1]
	victim.kill()
	killed := time.Now()
	st := awaitStatus(t, ctx, admin, "a new pipeline", func(st *tandemv1.StatusResponse) bool {
		return st.GetServing() && st.GetEpoch() != healthy.GetEpoch()
	})
	t.Logf("stage-2 SIGKILLed mid-generation; the leader serves again %v later over %v (epoch %d)", time.Since(killed).Round(time.Millisecond), stageNodes(st), st.GetEpoch())
	if slices.Contains(stageNodes(st), "stage-2") {
		t.Errorf("the new pipeline %v holds the dead stage", stageNodes(st))
	}
	restarted, err := c.restart(ctx, victim)
	if err != nil {
		t.Fatal(err)
	}
	restartedAt := time.Now()
	survived, pause := ss.check(t, want)
	t.Logf("%d of %d requests survived with the tokens of the healthy run; the longest pause a stream saw: %v", survived, n, pause.Round(time.Millisecond))
	if !strings.Contains(logs.String(), "lost: stage node stage-2") {
		t.Error("the leader's log does not blame stage-2 for the lost pipeline")
	}

	// The restarted node rejoins the pipeline once the membership is
	// stable (auto-rebalance).
	st = awaitStatus(t, ctx, admin, "the restarted stage rejoins", func(st *tandemv1.StatusResponse) bool {
		return st.GetServing() && slices.Contains(stageNodes(st), restarted.Name)
	})
	t.Logf("restarted stage-2 rejoined the pipeline %v after its restart: %v (epoch %d)", time.Since(restartedAt).Round(time.Millisecond), stageNodes(st), st.GetEpoch())
	// It serves: a request on the rejoined pipeline gives its reference.
	got, err := generate(ctx, c.Conn, reqs[1])
	if err != nil || !slices.Equal(got.ids, want[1]) {
		t.Errorf("after the rejoin: %d tokens (%v), want request 1's %d", len(got.ids), err, len(want[1]))
	}
	// Nothing leaks: no request or KV block held, the goroutines back.
	checkNothingHeld(t, ctx, admin, metrics, before, n+2)
	if strings.Contains(logs.String(), "panic") {
		t.Error("a daemon panicked")
	}
}

// TestChaosStageTerminated sends SIGTERM to the middle stage daemon
// mid-generation: it leaves the cluster gracefully, the leader takes it
// as a planned removal, builds a pipeline over the two others and moves
// the requests there, which releases the leaving stage; it exits 0, and
// every request completes with the tokens of the healthy run.
func TestChaosStageTerminated(t *testing.T) {
	if testing.Short() {
		t.Skip("a multi-process chaos run: not in -short")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := testModel(t)
	const n = 12
	reqs, want := chaosRequests(t, dir, n, 200)
	c, logs := startClusterWith(t, ctx, dir, 3, false)
	admin := tandemv1.NewAdminClient(c.Conn)
	healthy := awaitStatus(t, ctx, admin, "serving", func(st *tandemv1.StatusResponse) bool { return st.GetServing() })
	ss := startStreams(ctx, c.Conn, reqs)
	ss.midway(t, ctx, 20)
	victim := c.Stages[1]
	c.Stages = slices.Delete(c.Stages, 1, 2) // Close must not stop it again
	stopped := make(chan error, 1)
	start := time.Now()
	go func() { stopped <- victim.stop(time.Minute) }()
	st := awaitStatus(t, ctx, admin, "a pipeline without the leaving stage", func(st *tandemv1.StatusResponse) bool {
		return st.GetServing() && st.GetEpoch() != healthy.GetEpoch()
	})
	t.Logf("stage-2 got SIGTERM mid-generation; the leader moved the requests to %v %v later", stageNodes(st), time.Since(start).Round(time.Millisecond))
	if slices.Contains(stageNodes(st), "stage-2") {
		t.Errorf("the new pipeline %v holds the leaving stage", stageNodes(st))
	}
	if err := <-stopped; err != nil {
		t.Errorf("the terminated stage daemon: %v", err)
	}
	t.Logf("the terminated stage daemon exited cleanly %v after its SIGTERM", time.Since(start).Round(time.Millisecond))
	survived, pause := ss.check(t, want)
	t.Logf("%d of %d requests survived with the tokens of the healthy run; the longest pause a stream saw: %v", survived, n, pause.Round(time.Millisecond))
	if !strings.Contains(logs.String(), "stage node stage-2 is leaving") {
		t.Error("the leader's log does not show the planned removal")
	}
}

// TestChaosStageStopped stops the middle stage's process (SIGSTOP) mid-
// generation, with gossip at its LAN timings and a step timeout of 2s,
// and keeps it stopped past the failure timeout: the leader's own step
// deadline catches the hung step, a health probe names the stage that does
// not answer, the pipeline is rebuilt without it, and every request
// completes with the tokens of a healthy run; then gossip declares the
// stopped node dead. Resumed (SIGCONT), the zombie's old stage is of a
// stale epoch: it ends, the node refutes its death and, once the
// membership is stable, rejoins the pipeline (auto-rebalance), which then
// serves a second load of requests with their healthy tokens. Nothing
// leaks on the leader (requests, KV blocks, goroutines).
func TestChaosStageStopped(t *testing.T) {
	if testing.Short() {
		t.Skip("a multi-process chaos run: not in -short")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := testModel(t)
	const n = 12
	reqs, want := chaosRequests(t, dir, n, 200)
	metrics := freeAddr(t)
	c, logs := startClusterSpec(t, ctx, clusterSpec{model: dir, stages: 3, extra: []string{"--fast-gossip=false", "--step-timeout=2s"},
		leaderExtra: []string{"--metrics", metrics}})
	admin := tandemv1.NewAdminClient(c.Conn)
	healthy := awaitStatus(t, ctx, admin, "serving", func(st *tandemv1.StatusResponse) bool { return st.GetServing() })
	before := servedGoroutines(t, ctx, c, metrics)
	ss := startStreams(ctx, c.Conn, reqs)
	ss.midway(t, ctx, 20)
	victim := c.Stages[1]
	if err := victim.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	stopped := time.Now()
	resumed := false
	defer func() {
		if !resumed {
			victim.cmd.Process.Signal(syscall.SIGCONT)
		}
	}()
	st := awaitStatus(t, ctx, admin, "a new pipeline", func(st *tandemv1.StatusResponse) bool {
		return st.GetServing() && st.GetEpoch() != healthy.GetEpoch()
	})
	t.Logf("stage-2 stopped mid-generation; the leader serves again %v later over %v", time.Since(stopped).Round(time.Millisecond), stageNodes(st))
	if slices.Contains(stageNodes(st), victim.Name) {
		t.Fatalf("the new pipeline %v holds the stopped stage", stageNodes(st))
	}
	survived, pause := ss.check(t, want)
	t.Logf("%d of %d requests survived with the tokens of the healthy run; the longest pause a stream saw: %v", survived, n, pause.Round(time.Millisecond))
	if !strings.Contains(logs.String(), "within the step timeout of 2s") || !strings.Contains(logs.String(), "on stage-2 does not answer") {
		t.Errorf("the leader's log does not show the step deadline naming stage-2")
	}
	// Stopped past the failure timeout: gossip declares it dead.
	awaitStatus(t, ctx, admin, "gossip declares the stopped stage dead", func(st *tandemv1.StatusResponse) bool {
		return slices.ContainsFunc(st.GetMembers(), func(m *tandemv1.Member) bool {
			return m.GetName() == victim.Name && m.GetState() == tandemv1.MemberState_MEMBER_STATE_DEAD
		})
	})
	t.Logf("gossip declared stage-2 dead %v after it stopped", time.Since(stopped).Round(time.Millisecond))
	// The zombie resumes: its stage of the old epoch ends, it is alive
	// again, and it rejoins the pipeline while a second load runs.
	if err := victim.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	resumed = true
	resumedAt := time.Now()
	ss = startStreams(ctx, c.Conn, reqs)
	st = awaitStatus(t, ctx, admin, "the resumed stage rejoins", func(st *tandemv1.StatusResponse) bool {
		return st.GetServing() && slices.Contains(stageNodes(st), victim.Name)
	})
	t.Logf("resumed stage-2 rejoined the pipeline %v after SIGCONT: %v", time.Since(resumedAt).Round(time.Millisecond), stageNodes(st))
	survived, pause = ss.check(t, want)
	t.Logf("second load: %d of %d requests with the tokens of the healthy run; the longest pause a stream saw: %v", survived, n, pause.Round(time.Millisecond))
	checkNothingHeld(t, ctx, admin, metrics, before, uint64(2*n+1))
}

// TestLeaderRestart kills the leader (SIGKILL) of a leader and two stage
// daemons, which joined through its gossip address, and starts it again
// with the same flags 4s later, past the time its members still gossip to
// it: it knows nobody, yet its stages find it (they keep exchanging state
// with their seed) and it serves again.
func TestLeaderRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("a multi-process run: not in -short")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := testModel(t)
	c, _ := startClusterSpec(t, ctx, clusterSpec{model: dir, stages: 2, leaderExtra: []string{"--gossip", freeAddr(t)}})
	if _, err := generate(ctx, c.Conn, genCases()[0].req); err != nil {
		t.Fatal(err)
	}
	c.Leader.kill()
	// Restarted 4s later, as in the report of the defect.
	time.Sleep(4 * time.Second)
	p, err := startDaemon(ctx, c.spec, c.Leader.Name, c.Leader.args)
	if err != nil {
		t.Fatal(err)
	}
	restarted := time.Now()
	c.Leader = p
	c.Conn.Close()
	if c.Conn, err = grpc.NewClient(p.GRPC, grpc.WithTransportCredentials(insecure.NewCredentials())); err != nil {
		t.Fatal(err)
	}
	st := awaitStatus(t, ctx, tandemv1.NewAdminClient(c.Conn), "the restarted leader serves", func(st *tandemv1.StatusResponse) bool { return st.GetServing() })
	t.Logf("the restarted leader found its stages and serves over %v %v after it started", stageNodes(st), time.Since(restarted).Round(time.Millisecond))
	want := reference(t, dir, genCases()[0].req)
	got, err := generate(ctx, c.Conn, genCases()[0].req)
	if err != nil {
		t.Fatal(err)
	}
	checkAgainst(t, "after the restart", got, want, genCases()[0].req)
}
