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
	"time"

	"github.com/tandem-llm/tandem/pipeline"
)

// localCluster is a pipeline of stage processes on loopback, started from
// this executable, with the leader's driver connected to them.
type localCluster struct {
	Driver *pipeline.Driver
	procs  []*stageProc

	closeOnce sync.Once
	closeErr  error
}

// stageProc is one `tandemd stage` child process.
type stageProc struct {
	cmd   *exec.Cmd
	ready chan string   // the ready line, or nothing if it exits first
	eof   chan struct{} // closed when its stdout ends (it exited)
}

// splitLayers divides layers into n contiguous ranges whose sizes differ by
// at most one, the larger ones first.
func splitLayers(layers, n int) ([][2]int, error) {
	if n < 1 || n > layers {
		return nil, fmt.Errorf("cannot split %d layers into %d stages", layers, n)
	}
	ranges := make([][2]int, n)
	lo := 0
	for i := range n {
		size := layers / n
		if i < layers%n {
			size++
		}
		ranges[i] = [2]int{lo, lo + size}
		lo += size
	}
	return ranges, nil
}

// startLocalCluster starts one `tandemd stage` process per range, last
// first (each stage dials the next one's data address), and connects the
// leader's control links. exe is the tandemd executable; env is added to
// the children's environment. Stage logs go to stderr.
func startLocalCluster(ctx context.Context, exe string, env []string, modelDir string, ranges [][2]int, stderr io.Writer) (*localCluster, error) {
	c := &localCluster{}
	controls := make([]string, len(ranges))
	next := ""
	for i := len(ranges) - 1; i >= 0; i-- {
		args := []string{"stage", "--model", modelDir, "--layers", fmt.Sprintf("%d:%d", ranges[i][0], ranges[i][1]), "--index", fmt.Sprint(i)}
		if next != "" {
			args = append(args, "--next", next)
		}
		p, err := startStageProc(exe, args, env, stderr)
		if err != nil {
			c.kill()
			return nil, fmt.Errorf("start stage %d: %w", i, err)
		}
		c.procs = append(c.procs, p)
		control, data, err := p.waitReady(ctx)
		if err != nil {
			c.kill()
			return nil, fmt.Errorf("stage %d (layers %d:%d): %w", i, ranges[i][0], ranges[i][1], err)
		}
		controls[i], next = control, data
	}
	links := make([]pipeline.Link, len(ranges))
	for i, addr := range controls {
		l, err := pipeline.DialLink(ctx, addr)
		if err != nil {
			for _, l := range links[:i] {
				l.Close()
			}
			c.kill()
			return nil, err
		}
		links[i] = l
	}
	d, err := pipeline.NewDriver(links)
	if err != nil {
		c.kill()
		return nil, err
	}
	c.Driver = d
	return c, nil
}

func startStageProc(exe string, args, env []string, stderr io.Writer) (*stageProc, error) {
	cmd := exec.Command(exe, args...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stderr = stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &stageProc{cmd: cmd, ready: make(chan string, 1), eof: make(chan struct{})}
	// The reader ends when the process exits: Wait must only be called
	// after it has (see eof).
	go func() {
		defer close(p.eof)
		br := bufio.NewReader(out)
		if line, err := br.ReadString('\n'); err == nil {
			p.ready <- line
		}
		io.Copy(io.Discard, br)
	}()
	return p, nil
}

// waitReady waits for the stage's "ready control=ADDR data=ADDR" line.
func (p *stageProc) waitReady(ctx context.Context) (control, data string, err error) {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	select {
	case l := <-p.ready:
		if _, err := fmt.Sscanf(strings.TrimSpace(l), "ready control=%s data=%s", &control, &data); err != nil {
			return "", "", fmt.Errorf("unexpected ready line %q", l)
		}
		return control, data, nil
	case <-p.eof:
		return "", "", errors.New("exited before it was ready (its log is above)")
	case <-ctx.Done():
		return "", "", fmt.Errorf("not ready: %w", ctx.Err())
	}
}

// wait waits for the process to exit, killing it after timeout.
func (p *stageProc) wait(timeout time.Duration) error {
	select {
	case <-p.eof:
	case <-time.After(timeout):
		p.cmd.Process.Kill()
		<-p.eof
		p.cmd.Wait()
		return fmt.Errorf("stage process %d did not exit within %v; killed", p.cmd.Process.Pid, timeout)
	}
	if err := p.cmd.Wait(); err != nil {
		return fmt.Errorf("stage process %d: %w", p.cmd.Process.Pid, err)
	}
	return nil
}

// Close ends the pipeline: the stages finish and exit, and Close waits for
// them (killing any that do not exit within a few seconds). Later calls
// return the first call's result.
func (c *localCluster) Close() error {
	c.closeOnce.Do(func() {
		errs := []error{c.Driver.Close()}
		for _, p := range c.procs {
			errs = append(errs, p.wait(10*time.Second))
		}
		c.closeErr = errors.Join(errs...)
	})
	return c.closeErr
}

func (c *localCluster) kill() {
	for _, p := range c.procs {
		p.cmd.Process.Kill()
		p.wait(time.Second)
	}
}
