package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// netLab is a small network of hosts, each a network namespace with one
// interface (eth0) on a bridge of its own namespace, and a link from this
// process's namespace to the bridge so the test reaches every host.
type netLab struct {
	t      *testing.T
	id     string // prefix of the namespaces' and links' names
	subnet string // the hosts' /24, as "10.X.Y"
	hosts  int
}

// ipCmd runs ip with args, failing t on error.
func (l *netLab) ip(args ...string) {
	l.t.Helper()
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		l.t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
	}
}

// newNetLab makes the bridge, or skips t where network namespaces cannot
// be made (not root, no ip(8), no netns support).
func newNetLab(t *testing.T) *netLab {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("network namespaces need root: the partition test runs where `ip netns` works")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("no ip(8): the partition test needs iproute2")
	}
	pid := os.Getpid()
	l := &netLab{t: t, id: fmt.Sprintf("td%d", pid%100000), subnet: fmt.Sprintf("10.%d.%d", 200+pid%50, (pid/50)%250)}
	if out, err := exec.Command("ip", "netns", "add", l.id+"hub").CombinedOutput(); err != nil {
		t.Skipf("network namespaces unavailable (ip netns add: %v: %s)", err, strings.TrimSpace(string(out)))
	}
	t.Cleanup(l.close)
	hub := l.id + "hub"
	l.ip("-n", hub, "link", "set", "lo", "up")
	l.ip("-n", hub, "link", "add", "br0", "type", "bridge")
	l.ip("-n", hub, "link", "set", "br0", "up")
	// This process's side: an address on the bridge's subnet.
	l.ip("link", "add", l.id+"r", "type", "veth", "peer", "name", "p0", "netns", hub)
	l.ip("-n", hub, "link", "set", "p0", "master", "br0", "up")
	l.ip("addr", "add", l.subnet+".1/24", "dev", l.id+"r")
	l.ip("link", "set", l.id+"r", "up")
	return l
}

// host makes a host of the lab: a namespace whose eth0 is on the bridge
// with address subnet.N; it returns the namespace and the address.
func (l *netLab) host(name string) (ns, addr string) {
	l.t.Helper()
	l.hosts++
	ns, addr = l.id+name, fmt.Sprintf("%s.%d", l.subnet, 10+l.hosts)
	port := fmt.Sprintf("p%d", l.hosts)
	l.ip("netns", "add", ns)
	l.ip("-n", ns, "link", "set", "lo", "up")
	l.ip("-n", l.id+"hub", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
	l.ip("-n", l.id+"hub", "link", "set", port, "master", "br0", "up")
	l.ip("-n", ns, "addr", "add", addr+"/24", "dev", "eth0")
	l.ip("-n", ns, "link", "set", "eth0", "up")
	return ns, addr
}

// close removes the namespaces (their links go with them) and this
// process's link.
func (l *netLab) close() {
	exec.Command("ip", "link", "del", l.id+"r").Run()
	out, _ := exec.Command("ip", "netns", "list").Output()
	for _, line := range strings.Split(string(out), "\n") {
		if f := strings.Fields(line); len(f) > 0 && strings.HasPrefix(f[0], l.id) {
			exec.Command("ip", "netns", "del", f[0]).Run()
		}
	}
}

// TestChaosPartition runs the leader and 3 CPU stage daemons as separate
// hosts, each in a network namespace of its own with its own address on
// one bridge, and cuts the middle stage host's link (ip link set eth0
// down) while 12 streams run: the partitioned stage is noticed as dead by
// gossip, the pipeline is rebuilt without it, and every request completes
// with the tokens of a healthy run, as after a death. The link comes back
// up: the node refutes its death and rejoins the pipeline.
func TestChaosPartition(t *testing.T) {
	if testing.Short() {
		t.Skip("a multi-process chaos run: not in -short")
	}
	lab := newNetLab(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := testModel(t)
	const n = 12
	reqs, want := chaosRequests(t, dir, n, 300)
	// Beyond loopback a node needs the cluster secret.
	keyFile, _ := writeSecret(t, "cluster.key", "the partition test's cluster secret")
	logs := &logBuffer{}
	var procs []*daemonProc
	t.Cleanup(func() {
		for _, p := range procs {
			p.stop(30 * time.Second)
		}
		if t.Failed() {
			t.Logf("daemon logs:\n%s", logs)
		}
	})
	start := func(name string, extra ...string) (*daemonProc, string, string) {
		ns, addr := lab.host(name)
		args := []string{"netns", "exec", ns, os.Args[0], "serve", "--name", name, "--model", dir,
			"--grpc", addr + ":7400", "--gossip", addr + ":7401", "--control", addr + ":0", "--data", addr + ":0",
			"--leader", "leader", "--fast-gossip", "--log-level", "info", "--memory", "1GiB", "--backend", "cpu", "--progress", "log",
			"--cluster-key-file", keyFile}
		spec := clusterSpec{exe: "ip", env: []string{asDaemonEnv + "=1"}, model: dir, logLevel: "info", stderr: logs}
		p, err := startDaemon(ctx, spec, name, append(args, extra...))
		if err != nil {
			t.Fatalf("%v\n%s", err, logs)
		}
		procs = append([]*daemonProc{p}, procs...) // stopped stages first
		return p, ns, addr
	}
	leader, _, leaderAddr := start("leader", "--stage=false", "--expect-stages", "3")
	nss := map[string]string{}
	for _, name := range []string{"stage-1", "stage-2", "stage-3"} {
		_, ns, _ := start(name, "--seeds", leaderAddr+":7401")
		nss[name] = ns
	}
	conn, err := grpc.NewClient(leader.GRPC, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	admin := tandemv1.NewAdminClient(conn)
	healthy := awaitStatus(t, ctx, admin, "serving over three hosts", func(st *tandemv1.StatusResponse) bool {
		return st.GetServing() && len(st.GetStages()) == 3
	})
	t.Logf("leader at %s serves over %v, each a host of its own on %s.0/24", leader.GRPC, stageNodes(healthy), lab.subnet)

	ss := startStreams(ctx, conn, reqs)
	ss.midway(t, ctx, 20)
	lab.ip("-n", nss["stage-2"], "link", "set", "eth0", "down")
	cut := time.Now()
	st := awaitStatus(t, ctx, admin, "a pipeline without the partitioned host", func(st *tandemv1.StatusResponse) bool {
		return st.GetServing() && st.GetEpoch() != healthy.GetEpoch()
	})
	t.Logf("stage-2's link cut mid-generation; the leader serves again %v later over %v", time.Since(cut).Round(time.Millisecond), stageNodes(st))
	if slices.Contains(stageNodes(st), "stage-2") {
		t.Errorf("the new pipeline %v holds the partitioned stage", stageNodes(st))
	}
	survived, pause := ss.check(t, want)
	t.Logf("%d of %d requests survived with the tokens of the healthy run; the longest pause a stream saw: %v", survived, n, pause.Round(time.Millisecond))
	if lc := st.GetLastChange(); lc.GetKind() != "recovery" || !strings.Contains(lc.GetWhy(), "stage-2") {
		t.Errorf("last change %v, want a recovery from stage-2's loss", lc)
	}

	// The link comes back: the node rejoins, and the pipeline serves the
	// requests again with their healthy tokens.
	lab.ip("-n", nss["stage-2"], "link", "set", "eth0", "up")
	healed := time.Now()
	st = awaitStatus(t, ctx, admin, "the healed host rejoins", func(st *tandemv1.StatusResponse) bool {
		return st.GetServing() && slices.Contains(stageNodes(st), "stage-2")
	})
	t.Logf("stage-2's link up again; it rejoined the pipeline %v later: %v", time.Since(healed).Round(time.Millisecond), stageNodes(st))
	ss = startStreams(ctx, conn, reqs)
	survived, _ = ss.check(t, want)
	t.Logf("after the partition healed: %d of %d requests with the tokens of the healthy run", survived, n)
}
