package main

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

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

// goroutines reads go_goroutines from a daemon's /metrics.
func goroutines(ctx context.Context, addr string) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "go_goroutines "); ok {
			return strconv.Atoi(v)
		}
	}
	return 0, errors.New("no go_goroutines in /metrics")
}

// stream is one chaos request as its client saw it.
type stream struct {
	ids      []int32
	at       []time.Time // when each token arrived
	err      error
	finished bool
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
	const n, maxTokens = 12, 300
	reqs := make([]*tandemv1.GenerateRequest, n)
	for i := range reqs {
		prompt := make([]int32, 3+(i*7)%29)
		for j := range prompt {
			prompt[j] = int32((i*37 + j*11 + 1) % 512)
		}
		reqs[i] = &tandemv1.GenerateRequest{PromptTokenIds: prompt, MaxTokens: maxTokens, IgnoreEos: true, Logprobs: proto.Uint32(0)}
		if i%2 == 1 {
			reqs[i].Temperature, reqs[i].TopK, reqs[i].TopP, reqs[i].Seed = 0.8, 40, 0.95, uint64(1000+i)
		}
	}
	want := make([][]int32, n)
	for i, r := range reqs {
		for _, s := range reference(t, dir, r) {
			want[i] = append(want[i], s.Token)
		}
	}
	metrics := freeAddr(t)
	logs := &logBuffer{}
	c, err := startLocalCluster(ctx, clusterSpec{exe: os.Args[0], env: []string{asDaemonEnv + "=1"}, model: dir, stages: 3, logLevel: "info",
		leaderExtra: []string{"--metrics", metrics}, stderr: logs})
	if err != nil {
		t.Fatalf("%v\ndaemon logs:\n%s", err, logs)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("stop the cluster: %v", err)
		}
		if t.Failed() {
			t.Logf("daemon logs:\n%s", logs)
		}
	})
	admin := tandemv1.NewAdminClient(c.Conn)
	status := func() *tandemv1.StatusResponse {
		st, err := admin.Status(ctx, &tandemv1.StatusRequest{})
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	nodes := func(st *tandemv1.StatusResponse) []string {
		var out []string
		for _, s := range st.GetStages() {
			out = append(out, s.GetNode())
		}
		return out
	}
	healthy := status()
	if got := nodes(healthy); !slices.Equal(got, []string{"stage-1", "stage-2", "stage-3"}) {
		t.Fatalf("stages %v, want the three stage daemons", got)
	}
	// A request first, so the goroutines counted are those of a leader
	// that has served.
	if _, err := generate(ctx, c.Conn, &tandemv1.GenerateRequest{PromptTokenIds: []int32{1, 2}, MaxTokens: 4}); err != nil {
		t.Fatal(err)
	}
	before, err := goroutines(ctx, metrics)
	if err != nil {
		t.Fatal(err)
	}

	streams := make([]*stream, n)
	progress := make(chan int, n*maxTokens)
	var wg sync.WaitGroup
	for i, r := range reqs {
		s := &stream{}
		streams[i] = s
		wg.Go(func() {
			st, err := tandemv1.NewInferenceClient(c.Conn).Generate(ctx, r)
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
				s.finished = s.finished || msg.GetFinishReason() == tandemv1.FinishReason_FINISH_REASON_LENGTH
				progress <- i
			}
		})
	}
	// Mid-generation: every stream has its first 20 tokens.
	counts := make([]int, n)
	for min := 0; min < 20; {
		select {
		case i := <-progress:
			counts[i]++
			min = slices.Min(counts)
		case <-ctx.Done():
			t.Fatal("the streams did not start")
		}
	}
	go func() {
		for range progress {
		}
	}()
	victim := c.Stages[1]
	victim.kill()
	killed := time.Now()
	var recovered time.Duration
	for recovered == 0 {
		st := status()
		if st.GetServing() && st.GetEpoch() != healthy.GetEpoch() {
			recovered = time.Since(killed)
			t.Logf("stage-2 SIGKILLed mid-generation; the leader serves again %v later over %v (epoch %d)", recovered.Round(time.Millisecond), nodes(st), st.GetEpoch())
			if slices.Contains(nodes(st), "stage-2") {
				t.Errorf("the new pipeline %v holds the dead stage", nodes(st))
			}
		}
		if time.Since(killed) > time.Minute {
			t.Fatalf("no new pipeline a minute after the kill: %v", st)
		}
		time.Sleep(10 * time.Millisecond)
	}
	restarted, err := c.restart(ctx, victim)
	if err != nil {
		t.Fatal(err)
	}
	restartedAt := time.Now()
	wg.Wait()
	close(progress)
	survived, pause := 0, time.Duration(0)
	for i, s := range streams {
		if s.err != nil || !s.finished || !slices.Equal(s.ids, want[i]) {
			t.Errorf("request %d: %d tokens, finished %t, error %v; want the %d tokens of the healthy run", i, len(s.ids), s.finished, s.err, len(want[i]))
			continue
		}
		survived++
		for j := 1; j < len(s.at); j++ {
			pause = max(pause, s.at[j].Sub(s.at[j-1]))
		}
	}
	t.Logf("%d of %d requests survived with the tokens of the healthy run; the longest pause a stream saw: %v", survived, n, pause.Round(time.Millisecond))

	// The restarted node rejoins the pipeline once the membership is
	// stable (auto-rebalance).
	for {
		st := status()
		if st.GetServing() && slices.Contains(nodes(st), restarted.Name) {
			t.Logf("restarted stage-2 rejoined the pipeline %v after its restart: %v (epoch %d)", time.Since(restartedAt).Round(time.Millisecond), nodes(st), st.GetEpoch())
			break
		}
		if time.Since(restartedAt) > time.Minute {
			t.Fatalf("the restarted stage has not rejoined a minute later: %v (%s)", nodes(st), st.GetReason())
		}
		time.Sleep(50 * time.Millisecond)
	}
	// It serves: a request on the rejoined pipeline gives its reference.
	got, err := generate(ctx, c.Conn, reqs[1])
	if err != nil || !slices.Equal(got.ids, want[1]) {
		t.Errorf("after the rejoin: %d tokens (%v), want request 1's %d", len(got.ids), err, len(want[1]))
	}
	// Nothing leaks: no request or KV block held, the goroutines back.
	var after int
	for start := time.Now(); ; {
		st := status()
		sc := st.GetScheduler()
		after, err = goroutines(ctx, metrics)
		if err != nil {
			t.Fatal(err)
		}
		if sc.GetRunning()+sc.GetWaiting()+sc.GetInFlight() == 0 && sc.GetKvBlocksUsed() == 0 && after <= before+3 {
			if sc.GetFinished() != uint64(n+2) {
				t.Errorf("scheduler %v: want %d requests finished", sc, n+2)
			}
			break
		}
		if time.Since(start) > 10*time.Second {
			t.Fatalf("10s after the chaos: scheduler %v, goroutines %d (%d before): something leaks", sc, after, before)
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("nothing held after the chaos: no request, no KV block; the leader's goroutines %d (%d before)", after, before)
	if strings.Contains(logs.String(), "panic") {
		t.Error("a daemon panicked")
	}
}

// TestChaosStageStopped stops the middle stage's process (SIGSTOP) mid-
// generation, with gossip at its LAN timings (a stopped member is declared
// dead only after several seconds) and a step timeout of 2s: the leader's
// own step deadline catches the hung step, a health probe names the stage
// that does not answer, and the pipeline is rebuilt without it; every
// request completes with the tokens of a healthy run. The stage then
// resumes (SIGCONT), a zombie of the old epoch, and the leader keeps
// serving.
func TestChaosStageStopped(t *testing.T) {
	if testing.Short() {
		t.Skip("a multi-process chaos run: not in -short")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := testModel(t)
	const n, maxTokens = 12, 200
	reqs := make([]*tandemv1.GenerateRequest, n)
	want := make([][]int32, n)
	for i := range reqs {
		reqs[i] = &tandemv1.GenerateRequest{PromptTokenIds: []int32{int32(5 + i), 40, int32(3 * i)}, MaxTokens: maxTokens, IgnoreEos: true}
		if i%3 == 0 {
			reqs[i].Temperature, reqs[i].Seed = 1.1, uint64(77+i)
		}
		for _, s := range reference(t, dir, reqs[i]) {
			want[i] = append(want[i], s.Token)
		}
	}
	c, logs := startClusterWith(t, ctx, dir, 3, false, "--fast-gossip=false", "--step-timeout=2s")
	admin := tandemv1.NewAdminClient(c.Conn)
	healthy, err := admin.Status(ctx, &tandemv1.StatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	got := make([][]int32, n)
	errs := make([]error, n)
	started := make(chan struct{}, n)
	var wg sync.WaitGroup
	for i, r := range reqs {
		wg.Go(func() {
			st, err := tandemv1.NewInferenceClient(c.Conn).Generate(ctx, r)
			if err != nil {
				errs[i] = err
				started <- struct{}{}
				return
			}
			for {
				msg, err := st.Recv()
				if len(got[i]) == 0 {
					started <- struct{}{}
				}
				if err != nil {
					if !errors.Is(err, io.EOF) {
						errs[i] = err
					}
					return
				}
				got[i] = append(got[i], msg.GetTokenIds()...)
			}
		})
	}
	for range n {
		<-started
	}
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
	for {
		st, err := admin.Status(ctx, &tandemv1.StatusRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if st.GetServing() && st.GetEpoch() != healthy.GetEpoch() {
			var ns []string
			for _, s := range st.GetStages() {
				ns = append(ns, s.GetNode())
			}
			if slices.Contains(ns, victim.Name) {
				t.Fatalf("the new pipeline %v holds the stopped stage", ns)
			}
			t.Logf("stage-2 stopped mid-generation; the leader serves again %v later over %v", time.Since(stopped).Round(time.Millisecond), ns)
			break
		}
		if time.Since(stopped) > time.Minute {
			t.Fatalf("no new pipeline a minute after the stop: %v", st)
		}
		time.Sleep(20 * time.Millisecond)
	}
	wg.Wait()
	for i := range reqs {
		if errs[i] != nil || !slices.Equal(got[i], want[i]) {
			t.Errorf("request %d: %d tokens, error %v; want the %d tokens of the healthy run", i, len(got[i]), errs[i], len(want[i]))
		}
	}
	if !strings.Contains(logs.String(), "within the step timeout of 2s") || !strings.Contains(logs.String(), "on stage-2 does not answer") {
		t.Errorf("the leader's log does not show the step deadline naming stage-2")
	}
	// The zombie resumes: the leader keeps serving.
	if err := victim.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	resumed = true
	r, err := generate(ctx, c.Conn, reqs[0])
	if err != nil || !slices.Equal(r.ids, want[0]) {
		t.Errorf("after the zombie resumed: %d tokens (%v), want request 0's %d", len(r.ids), err, len(want[0]))
	}
	t.Logf("%d requests survived the stopped stage; the zombie resumed and the leader kept serving", n)
}
