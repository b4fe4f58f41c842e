package pipeline

import (
	"context"
	"fmt"
	"io"
	"sync"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/stage"
)

// StartLocal runs stages, in pipeline order, as one pipeline inside this
// process: one worker goroutine per stage, activations over in-memory
// pipes. The returned Driver's Close stops the workers and waits for them.
// It is LocalOptions{}.Start: no hand-off.
func StartLocal(ctx context.Context, stages []stage.Stage) (*Driver, error) {
	return LocalOptions{}.Start(ctx, stages)
}

// LocalOptions configure a pipeline inside this process.
type LocalOptions struct {
	// Handoff wires on-device hand-off: a ring pipe from the last stage to
	// the first (none for a single stage, which applies its own). The
	// first stage must implement stage.HandoffReceiver.
	Handoff bool
	// HandoffDepth is how many hand-off messages the ring holds before the
	// last stage's send waits; it must be at least the steps the leader
	// keeps in flight (0: the number of stages plus one, the most steps
	// in flight with hand-off).
	HandoffDepth int
	// Observer sees the driver's steps (DriverOptions.Observer).
	Observer Observer
	// Link makes the data link from stage from to stage to (to is 0 for
	// the hand-off ring) that holds depth messages; nil: an in-memory
	// pipe (collective.Pipe). Tests wire links of their own with it, such
	// as stream-ordered links between stage.LinkedLauncher stages.
	Link func(from, to, depth int) (collective.Sender, collective.Receiver)
}

// Start runs stages, in pipeline order, as one pipeline inside this process
// (see StartLocal).
func (o LocalOptions) Start(ctx context.Context, stages []stage.Stage) (*Driver, error) {
	if len(stages) == 0 {
		return nil, fmt.Errorf("local pipeline: no stages")
	}
	if o.HandoffDepth < 0 {
		return nil, fmt.Errorf("local pipeline: hand-off depth %d is negative", o.HandoffDepth)
	}
	if _, ok := stages[0].(stage.HandoffReceiver); o.Handoff && !ok {
		return nil, fmt.Errorf("local pipeline: hand-off asked for, but the first stage (%T) cannot take hand-offs", stages[0])
	}
	links := make([]Link, len(stages))
	workers := make([]*Worker, len(stages))
	var prev collective.Receiver
	for i, st := range stages {
		l := newMemLink()
		links[i] = l
		w := &Worker{Index: i, Stage: st, Ctl: l, Prev: prev}
		if i < len(stages)-1 {
			w.Next, prev = o.link(i, i+1, 2)
		}
		workers[i] = w
	}
	if last := len(stages) - 1; o.Handoff && last > 0 {
		depth := o.HandoffDepth
		if depth == 0 {
			depth = len(stages) + 1
		}
		workers[last].HandoffOut, workers[0].HandoffIn = o.link(last, 0, depth)
	}
	for i, w := range workers {
		l := links[i].(*memLink)
		go func() {
			err := w.Serve(ctx)
			for _, c := range []io.Closer{w.Prev, w.Next, w.HandoffIn, w.HandoffOut} {
				if c != nil { // a nil link converts to a nil Closer
					c.Close()
				}
			}
			l.finish(err)
		}()
	}
	return DriverOptions{Observer: o.Observer}.New(links)
}

// link makes the data link from stage from to stage to (Link).
func (o LocalOptions) link(from, to, depth int) (collective.Sender, collective.Receiver) {
	if o.Link != nil {
		return o.Link(from, to, depth)
	}
	return collective.Pipe(depth)
}

// memLink is both ends of an in-process control link: the leader's Link and
// the worker's Control.
type memLink struct {
	steps   chan *Step
	results chan *Result
	closed  chan struct{} // closed by the leader's Close
	once    sync.Once

	mu  sync.Mutex
	err error
}

func newMemLink() *memLink {
	return &memLink{
		steps:   make(chan *Step, 8),
		results: make(chan *Result, 8),
		closed:  make(chan struct{}),
	}
}

// Send implements Link.
func (l *memLink) Send(ctx context.Context, s *Step) error {
	select {
	case l.steps <- s:
		return nil
	case <-l.closed:
		return fmt.Errorf("link closed")
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Results implements Link.
func (l *memLink) Results() <-chan *Result { return l.results }

// Err implements Link.
func (l *memLink) Err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.err
}

// Close implements Link.
func (l *memLink) Close() error {
	l.once.Do(func() { close(l.closed) })
	return nil
}

// Next implements Control. Steps already sent are served before io.EOF.
func (l *memLink) Next(ctx context.Context) (*Step, error) {
	select {
	case s := <-l.steps:
		return s, nil
	default:
	}
	select {
	case s := <-l.steps:
		return s, nil
	case <-l.closed:
		return nil, io.EOF
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// Report implements Control. The result is copied: the stage reuses its
// output buffers on the next step.
func (l *memLink) Report(ctx context.Context, r *Result) error {
	select {
	case l.results <- cloneResult(r):
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// finish records why the worker stopped and ends the result stream.
func (l *memLink) finish(err error) {
	l.mu.Lock()
	l.err = err
	l.mu.Unlock()
	close(l.results)
}

func cloneResult(r *Result) *Result {
	c := *r
	c.Sampled = make([]stage.Sampled, len(r.Sampled))
	for i, s := range r.Sampled {
		s.Top = append([]stage.TokenLogprob(nil), s.Top...)
		c.Sampled[i] = s
	}
	c.Logits = make([]stage.SeqLogits, len(r.Logits))
	for i, sl := range r.Logits {
		rows := make([][]float32, len(sl.Rows))
		for j, row := range sl.Rows {
			rows[j] = append([]float32(nil), row...)
		}
		c.Logits[i] = stage.SeqLogits{Seq: sl.Seq, Rows: rows}
	}
	return &c
}
