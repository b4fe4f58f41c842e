package pipeline

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tandem-llm/tandem/stage"
)

// fakeLink is a Link whose reports and end the test drives.
type fakeLink struct {
	results chan *Result
	err     error
	closeFn func()
	once    sync.Once
	// sendErr fails every Send; stuck makes Send wait for its context.
	sendErr error
	stuck   bool
}

func newFakeLink() *fakeLink { return &fakeLink{results: make(chan *Result, 8)} }

func (l *fakeLink) Send(ctx context.Context, _ *Step) error {
	if l.stuck {
		<-ctx.Done()
		return ctx.Err()
	}
	return l.sendErr
}
func (l *fakeLink) Results() <-chan *Result { return l.results }
func (l *fakeLink) Err() error              { return l.err }
func (l *fakeLink) Close() error {
	if l.closeFn != nil {
		l.closeFn()
	}
	l.end(nil)
	return nil
}

// end ends the link with err (nil: cleanly).
func (l *fakeLink) end(err error) {
	l.once.Do(func() {
		l.err = err
		close(l.results)
	})
}

func fakeDriver(t *testing.T, n int, o DriverOptions) (*Driver, []*fakeLink) {
	t.Helper()
	links := make([]*fakeLink, n)
	ls := make([]Link, n)
	for i := range links {
		links[i] = newFakeLink()
		ls[i] = links[i]
	}
	d, err := o.New(ls)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d, links
}

var oneSeq = &Step{Batch: stage.Batch{ID: 1, Seqs: []stage.Seq{{ID: 1, Tokens: []int32{1}, Sample: true}}}}

// TestDriverBlame checks which stage a failure is blamed on when several
// stages fail together, whatever order the driver learns of them in.
func TestDriverBlame(t *testing.T) {
	linkErr := func(stage int, what string) *Result {
		return &Result{Batch: 1, Stage: stage, Err: "stage x, batch 1: " + linkFailed + what + ": EOF"}
	}
	for _, tc := range []struct {
		name string
		// events, in the order the driver learns them: a report, or a link
		// ending (report nil) with an error.
		events []struct {
			stage int
			r     *Result
		}
		want int
	}{
		{"last stage killed: the first fails on the hand-off first", []struct {
			stage int
			r     *Result
		}{{0, linkErr(0, "receive the hand-off of batch 1")}, {1, linkErr(1, "send activations")}, {2, nil}}, 2},
		{"middle stage fails its forward pass after its neighbours' link failures", []struct {
			stage int
			r     *Result
		}{{2, linkErr(2, "receive activations")}, {0, linkErr(0, "send activations")}, {1, &Result{Batch: 1, Stage: 1, Err: "forward: out of memory"}}}, 1},
		{"only link failures: the first learned", []struct {
			stage int
			r     *Result
		}{{1, linkErr(1, "receive activations")}, {0, linkErr(0, "send activations")}}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, links := fakeDriver(t, 3, DriverOptions{})
			if err := d.Submit(context.Background(), oneSeq); err != nil {
				t.Fatal(err)
			}
			facts := 0
			for _, ev := range tc.events {
				facts++
				if ev.r != nil {
					facts++
					links[ev.stage].results <- ev.r
					// A stage that reported a failure hangs up after.
					links[ev.stage].end(errors.New("stage closed the control connection"))
				} else {
					links[ev.stage].end(errors.New("connection reset by peer"))
				}
				// Let the forwarder learn it before the next event.
				deadline := time.Now().Add(5 * time.Second)
				for {
					d.mu.Lock()
					n := len(d.facts)
					d.mu.Unlock()
					if n >= facts || time.Now().After(deadline) {
						break
					}
					time.Sleep(time.Millisecond)
				}
			}
			_, err := d.Wait(context.Background())
			var se *StageError
			if !errors.As(err, &se) || se.Stage != tc.want {
				t.Fatalf("Wait: %v, want a StageError blaming stage %d", err, tc.want)
			}
			t.Log(err)
		})
	}
}

// TestDriverSendFails checks that a step that cannot be sent to a stage
// whose process died fails with the blame Wait would give, whichever
// links the driver learned of first, and not with the bare error of the
// link written first: a neighbour that reported its data link failing
// before is not blamed, nor is the stage written first when the dead one
// is another.
func TestDriverSendFails(t *testing.T) {
	for _, tc := range []struct {
		name  string
		ended bool // the dead stage's link ended before the send
	}{
		{"its link ended first", true},
		{"the send fails first", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, links := fakeDriver(t, 3, DriverOptions{StepTimeout: time.Minute})
			// Stage 1 dies: stage 0 reports its data link failing first.
			links[0].results <- &Result{Batch: 1, Stage: 0, Err: "stage x, batch 1: " + linkFailed + "send activations: EOF"}
			waitFacts(t, d, 1)
			if tc.ended {
				links[1].end(errors.New("connection reset by peer"))
				waitFacts(t, d, 2)
			}
			links[1].sendErr = errors.New("write: broken pipe")
			err := d.Submit(context.Background(), oneSeq)
			var se *StageError
			if !errors.As(err, &se) || se.Stage != 1 {
				t.Fatalf("Submit: %v, want a StageError blaming stage 1", err)
			}
			t.Log(err)
		})
	}
	t.Run("stuck past the step timeout", func(t *testing.T) {
		d, links := fakeDriver(t, 2, DriverOptions{StepTimeout: 50 * time.Millisecond})
		links[1].stuck = true
		err := d.Submit(context.Background(), oneSeq)
		var se *StageError
		if !errors.As(err, &se) || se.Stage != -1 || !strings.Contains(err.Error(), "within the step timeout of 50ms") {
			t.Fatalf("Submit to a stage that does not read: %v, want a StageError naming no stage", err)
		}
	})
	t.Run("caller gives up", func(t *testing.T) {
		d, links := fakeDriver(t, 2, DriverOptions{StepTimeout: time.Minute})
		links[0].stuck = true
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		defer cancel()
		err := d.Submit(ctx, oneSeq)
		var se *StageError
		if err == nil || errors.As(err, &se) {
			t.Fatalf("Submit with the caller's context done: %v, want its error, blaming nothing", err)
		}
		select {
		case <-d.Broken():
			t.Fatal("the pipeline counts as broken after the caller gave up a send")
		default:
		}
	})
}

// waitFacts waits until the driver has learned n facts.
func waitFacts(t *testing.T, d *Driver, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		d.mu.Lock()
		got := len(d.facts)
		d.mu.Unlock()
		if got >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the driver learned %d facts, want %d", got, n)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestDriverStepTimeout checks that a step with no result fails after the
// step timeout, naming no stage, and that a driver without one waits.
func TestDriverStepTimeout(t *testing.T) {
	d, _ := fakeDriver(t, 2, DriverOptions{StepTimeout: 50 * time.Millisecond})
	if err := d.Submit(context.Background(), oneSeq); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := d.Wait(ctx)
	var se *StageError
	if !errors.As(err, &se) || se.Stage != -1 || !strings.Contains(err.Error(), "no result for batch 1 within the step timeout") {
		t.Fatalf("Wait past the step timeout: %v, want a StageError naming no stage", err)
	}
	if _, err := (DriverOptions{StepTimeout: -1}).New([]Link{newFakeLink()}); err == nil {
		t.Error("a negative step timeout: no error")
	}
}

// TestDriverBrokenWhileIdle checks that a stage lost while no step is in
// flight breaks the driver at once, and Failure names it.
func TestDriverBrokenWhileIdle(t *testing.T) {
	d, links := fakeDriver(t, 3, DriverOptions{})
	select {
	case <-d.Broken():
		t.Fatal("broken before anything happened")
	default:
	}
	links[1].end(errors.New("stage at 10.0.0.2:7000 closed the control connection"))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	select {
	case <-d.Broken():
	case <-ctx.Done():
		t.Fatal("not broken after a link ended")
	}
	if f := d.Failure(ctx); f.Stage != 1 || !strings.Contains(f.Error(), "10.0.0.2:7000") {
		t.Errorf("failure %v (stage %d), want stage 1's link", f, f.Stage)
	}
}

// TestDriverClosesLinksAtOnce checks that Close closes the links
// concurrently: each link's Close waits until every link's Close has
// begun, which closing them one by one would never reach.
func TestDriverClosesLinksAtOnce(t *testing.T) {
	const n = 3
	var entered sync.WaitGroup
	entered.Add(n)
	all := make(chan struct{})
	go func() { entered.Wait(); close(all) }()
	d, links := fakeDriver(t, n, DriverOptions{})
	for _, l := range links {
		var once sync.Once
		l.closeFn = func() {
			once.Do(entered.Done)
			select {
			case <-all:
			case <-time.After(10 * time.Second):
			}
		}
	}
	done := make(chan error, 1)
	go func() { done <- d.Close() }()
	select {
	case <-all:
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not close the links concurrently")
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	select {
	case <-d.Broken():
		t.Error("Close broke the driver: links ending on Close are no failure")
	default:
	}
}
