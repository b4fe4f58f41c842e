package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// localCluster is a cluster of `tandemd serve` processes on loopback: a
// leader that only leads and stage daemons that join it.
type localCluster struct {
	Leader *daemonProc
	Stages []*daemonProc
	// Conn is a gRPC client connection to the leader.
	Conn *grpc.ClientConn
	spec clusterSpec

	closeOnce sync.Once
	closeErr  error
}

// clusterSpec describes a local cluster to start.
type clusterSpec struct {
	exe    string   // the tandemd executable
	env    []string // added to the daemons' environment
	model  string
	stages int
	// leaderStage makes the leader hold a stage too (then stages counts
	// it).
	leaderStage bool
	logLevel    string
	extra       []string  // more flags for every daemon
	leaderExtra []string  // more flags for the leader
	stderr      io.Writer // the daemons' logs
}

// daemonProc is one `tandemd serve` child process.
type daemonProc struct {
	Name       string
	GRPC       string
	Gossip     string
	args       []string
	HTTP       string // the OpenAI API's address ("" while off)
	cmd        *exec.Cmd
	listenLine chan string
	exited     chan struct{} // closed when its stdout ends (it exited)
	waitOnce   sync.Once
	waitErr    error
}

// startLocalCluster starts the leader, then the stage daemons joining
// through its gossip address, and waits until the leader serves.
func startLocalCluster(ctx context.Context, s clusterSpec) (*localCluster, error) {
	c := &localCluster{spec: s}
	common := s.commonArgs()
	stagesOfLeader := 0
	if s.leaderStage {
		stagesOfLeader = 1
	}
	leaderArgs := append(append([]string(nil), common...), "--name", "leader", "--expect-stages", fmt.Sprint(s.stages), fmt.Sprintf("--stage=%t", s.leaderStage))
	leaderArgs = append(leaderArgs, s.leaderExtra...)
	var err error
	if c.Leader, err = startDaemon(ctx, s, "leader", leaderArgs); err != nil {
		return nil, err
	}
	for i := range s.stages - stagesOfLeader {
		name := fmt.Sprintf("stage-%d", i+1)
		p, err := startDaemon(ctx, s, name, s.stageArgs(name, c.Leader.Gossip))
		if err != nil {
			c.kill()
			return nil, err
		}
		c.Stages = append(c.Stages, p)
	}
	if c.Conn, err = grpc.NewClient(c.Leader.GRPC, grpc.WithTransportCredentials(insecure.NewCredentials())); err != nil {
		c.kill()
		return nil, err
	}
	if err := waitServing(ctx, c.Conn, 60*time.Second); err != nil {
		c.kill()
		return nil, fmt.Errorf("the leader at %s: %w", c.Leader.GRPC, err)
	}
	return c, nil
}

// commonArgs are the flags of tandemd serve every daemon of the cluster
// gets.
func (s clusterSpec) commonArgs() []string {
	common := []string{"serve", "--model", s.model, "--grpc", "127.0.0.1:0", "--gossip", "127.0.0.1:0",
		"--leader", "leader", "--fast-gossip", "--log-level", s.logLevel, "--memory", "1GiB", "--backend", "cpu", "--progress", "log"}
	return append(common, s.extra...)
}

// stageArgs are the flags of a stage daemon named name joining the leader
// at its gossip address.
func (s clusterSpec) stageArgs(name, leaderGossip string) []string {
	return append(s.commonArgs(), "--name", name, "--seeds", leaderGossip)
}

func startDaemon(ctx context.Context, s clusterSpec, name string, args []string) (*daemonProc, error) {
	cmd := exec.Command(s.exe, args...)
	cmd.Env = append(os.Environ(), s.env...)
	cmd.Stderr = s.stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &daemonProc{Name: name, args: args, cmd: cmd, listenLine: make(chan string, 1), exited: make(chan struct{})}
	go func() {
		defer close(p.exited)
		br := bufio.NewReader(out)
		if line, err := br.ReadString('\n'); err == nil {
			p.listenLine <- line
		}
		io.Copy(io.Discard, br)
	}()
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	select {
	case l := <-p.listenLine:
		if err := p.parseListening(l); err != nil {
			p.kill()
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		return p, nil
	case <-p.exited:
		return nil, fmt.Errorf("%s exited before listening: %w (its log is above)", name, p.wait())
	case <-wctx.Done():
		p.kill()
		return nil, fmt.Errorf("%s: not listening: %w", name, wctx.Err())
	}
}

// parseListening reads the addresses of tandemd serve's first line,
// "listening grpc=ADDR gossip=ADDR[ http=ADDR]".
func (p *daemonProc) parseListening(line string) error {
	f := strings.Fields(line)
	if len(f) < 3 || f[0] != "listening" {
		return fmt.Errorf("unexpected first line %q", line)
	}
	for _, kv := range f[1:] {
		k, v, _ := strings.Cut(kv, "=")
		switch k {
		case "grpc":
			p.GRPC = v
		case "gossip":
			p.Gossip = v
		case "http":
			p.HTTP = v
		}
	}
	if p.GRPC == "" || p.Gossip == "" {
		return fmt.Errorf("unexpected first line %q", line)
	}
	return nil
}

// waitServing polls the health of the server behind conn until it serves.
func waitServing(ctx context.Context, conn *grpc.ClientConn, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	hc := healthpb.NewHealthClient(conn)
	for {
		r, err := hc.Check(ctx, &healthpb.HealthCheckRequest{})
		if err == nil && r.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return nil
		}
		select {
		case <-ctx.Done():
			if err == nil {
				err = fmt.Errorf("health %v", r.GetStatus())
			}
			return fmt.Errorf("not serving after %v: %v", timeout, err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// wait waits for the process to exit and returns its exit error.
func (p *daemonProc) wait() error {
	p.waitOnce.Do(func() {
		<-p.exited
		p.waitErr = p.cmd.Wait()
	})
	return p.waitErr
}

// stop sends SIGTERM and waits for a clean exit, killing the process after
// timeout.
func (p *daemonProc) stop(timeout time.Duration) error {
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("%s: %w", p.Name, err)
	}
	select {
	case <-p.exited:
	case <-time.After(timeout):
		p.kill()
		return fmt.Errorf("%s did not exit within %v of SIGTERM; killed", p.Name, timeout)
	}
	if err := p.wait(); err != nil {
		return fmt.Errorf("%s: %w", p.Name, err)
	}
	return nil
}

func (p *daemonProc) kill() {
	p.cmd.Process.Kill()
	p.wait()
}

// Close stops every daemon with SIGTERM (each drains and exits 0): the
// leader first, which finishes its requests while the stages still serve
// them and ends their pipeline as it exits, then the stage daemons, idle
// by then, one after the other. Stopping the stages first would make the
// leader treat each as a planned removal and try to move its layers to the
// others, which the whole cluster's stop cannot allow; stopping them all
// at once could leave one announcing its departure to a peer that left
// meanwhile. It returns what went wrong; later calls return the first
// call's result.
func (c *localCluster) Close() error {
	c.closeOnce.Do(func() {
		errs := []error{c.Leader.stop(30 * time.Second)}
		for _, p := range c.Stages {
			errs = append(errs, p.stop(30*time.Second))
		}
		if c.Conn != nil {
			errs = append(errs, c.Conn.Close())
		}
		c.closeErr = errors.Join(errs...)
	})
	return c.closeErr
}

func (c *localCluster) kill() {
	if c.Conn != nil {
		c.Conn.Close()
	}
	for _, p := range append([]*daemonProc{c.Leader}, c.Stages...) {
		if p != nil {
			p.kill()
		}
	}
}
