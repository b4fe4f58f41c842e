package pipeline

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"
)

// Driver is the leader's side of a pipeline: it sends every step to every
// stage and collects the last stage's results, in order. Several steps may
// be in flight (Submit several, then Wait for each); Step runs one.
type Driver struct {
	links   []Link
	timeout time.Duration
	obs     Observer
	reports chan report
	wg      sync.WaitGroup

	mu      sync.Mutex
	sent    []sentStep // steps with sequences whose result is not back, oldest first
	closing bool       // Close has begun: links ending now are not failures
	facts   []fact     // what went wrong, in the order the driver learned it
	broken  chan struct{}
	// brokenAt is when the first fact was learned.
	brokenAt time.Time
}

type report struct {
	r     *Result // nil when the link ended
	stage int
}

// sentStep is a submitted step that carries sequences.
type sentStep struct {
	batch uint64
	at    time.Time
}

// fact is one sign of a broken pipeline: a stage reported a failure, or a
// stage's link ended, or failed a send, without one (the stage, or its
// process, died).
type fact struct {
	stage    int
	reported bool // the stage reported the failure; else its link ended or failed
	link     bool // a reported failure of one of the stage's data links
	err      error
}

// DriverOptions configure a Driver.
type DriverOptions struct {
	// StepTimeout bounds the wait for a step's result, from its Submit: a
	// stage that neither reports nor fails (a stopped process, a hung
	// device) fails the pipeline after it instead of hanging it (0: no
	// bound).
	StepTimeout time.Duration
	// Observer, when set, sees every step submitted and the stages'
	// timings of the steps it asks them to report (nil: none asked).
	Observer Observer
}

// NewDriver drives the stages behind links, in pipeline order, without a
// step timeout. It is DriverOptions{}.New.
func NewDriver(links []Link) (*Driver, error) { return DriverOptions{}.New(links) }

// New drives the stages behind links, in pipeline order. It starts one
// goroutine per link that forwards the link's reports; Close stops them.
func (o DriverOptions) New(links []Link) (*Driver, error) {
	if len(links) == 0 {
		return nil, errors.New("pipeline driver: no stages")
	}
	if o.StepTimeout < 0 {
		return nil, fmt.Errorf("pipeline driver: step timeout %v is negative", o.StepTimeout)
	}
	d := &Driver{links: links, timeout: o.StepTimeout, obs: o.Observer, reports: make(chan report, 4*len(links)), broken: make(chan struct{})}
	last := len(links) - 1
	for i, l := range links {
		d.wg.Add(1)
		go func() {
			defer d.wg.Done()
			for r := range l.Results() {
				if r.Timing != nil && d.obs != nil {
					d.obs.Reported(i, r.Batch, r.Timing, time.Now())
				}
				if r.Err == "" && i != last && r.Timing != nil {
					continue // a stage's timing of a step, nothing more
				}
				if r.Err != "" {
					d.learn(fact{stage: i, reported: true, link: strings.Contains(r.Err, linkFailed), err: fmt.Errorf("stage %d failed: %s", i, r.Err)})
				}
				d.reports <- report{r, i}
			}
			err := l.Err()
			if err == nil {
				err = errors.New("link closed")
			}
			d.learn(fact{stage: i, err: fmt.Errorf("stage %d: %w", i, err)})
			d.reports <- report{nil, i}
		}()
	}
	return d, nil
}

// StageError is a failure of the pipeline, blamed on the stage that caused
// it.
type StageError struct {
	// Stage is the index of the stage blamed, or -1 when none can be named
	// (a step that timed out with every link up).
	Stage int
	Err   error
}

func (e *StageError) Error() string { return e.Err.Error() }
func (e *StageError) Unwrap() error { return e.Err }

// learn records a fact; the first one breaks the pipeline. A link ending
// once Close has begun is no fact: learn reports false.
func (d *Driver) learn(f fact) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closing && !f.reported {
		return false
	}
	d.facts = append(d.facts, f)
	if len(d.facts) == 1 {
		d.brokenAt = time.Now()
		close(d.broken)
	}
	return true
}

// Stages is the number of stages.
func (d *Driver) Stages() int { return len(d.links) }

// Submit sends a step to every stage without waiting for its result. With
// a step timeout, a stage that stops reading its control link fails it
// after that long instead of blocking it: a *StageError naming no stage,
// like a result past the timeout. A send that fails on a broken link is a
// *StageError blaming a stage as Wait's failures do (see Failure), not
// the link that happened to be written first: a stage that dies breaks
// its neighbours' links too.
func (d *Driver) Submit(ctx context.Context, s *Step) error {
	sctx := ctx
	if d.timeout > 0 {
		var cancel context.CancelFunc
		sctx, cancel = context.WithTimeout(ctx, d.timeout)
		defer cancel()
	}
	if len(s.Batch.Seqs) > 0 {
		now := time.Now()
		if d.obs != nil {
			s.Report = d.obs.Submitting(s, now)
		}
		d.mu.Lock()
		d.sent = append(d.sent, sentStep{batch: s.Batch.ID, at: now})
		d.mu.Unlock()
	}
	for i, l := range d.links {
		if err := l.Send(sctx, s); err != nil {
			err = fmt.Errorf("send batch %d to stage %d: %w", s.Batch.ID, i, err)
			switch {
			case ctx.Err() != nil:
				return err // the caller gave up: no failure of the pipeline
			case sctx.Err() != nil:
				return &StageError{Stage: -1, Err: fmt.Errorf("batch %d not sent to stage %d within the step timeout of %v: a stage is stuck (%w)", s.Batch.ID, i, d.timeout, err)}
			case !d.learn(fact{stage: i, err: err}):
				return &StageError{Stage: i, Err: err} // closing
			}
			return d.Failure(ctx)
		}
	}
	return nil
}

// Wait returns the last stage's result for the oldest submitted step that
// carried sequences (steps that only free sequences report nothing). A
// failure reported by any stage, a lost link, or a step past the step
// timeout is a *StageError blaming the stage that caused it (see Failure);
// the pipeline is then unusable.
func (d *Driver) Wait(ctx context.Context) (*Result, error) {
	var deadline <-chan time.Time
	d.mu.Lock()
	if d.timeout > 0 && len(d.sent) > 0 {
		oldest := d.sent[0]
		t := time.NewTimer(time.Until(oldest.at.Add(d.timeout)))
		defer t.Stop()
		deadline = t.C
	}
	d.mu.Unlock()
	for {
		select {
		case rep := <-d.reports:
			if rep.r == nil || rep.r.Err != "" {
				return nil, d.Failure(ctx)
			}
			if rep.stage != len(d.links)-1 {
				return nil, &StageError{Stage: rep.stage, Err: fmt.Errorf("stage %d reported batch %d, but only the last stage reports results", rep.stage, rep.r.Batch)}
			}
			d.mu.Lock()
			if len(d.sent) > 0 {
				d.sent = d.sent[1:]
			}
			d.mu.Unlock()
			return rep.r, nil
		case <-deadline:
			d.mu.Lock()
			batch := d.sent[0].batch
			d.mu.Unlock()
			select {
			case <-d.broken: // a link ended meanwhile: that is the cause
				return nil, d.Failure(ctx)
			default:
			}
			return nil, &StageError{Stage: -1, Err: fmt.Errorf("no result for batch %d within the step timeout of %v: a stage is stuck", batch, d.timeout)}
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// Broken is closed once the pipeline is known to be broken: a stage
// reported a failure or a link ended, even while no step is in flight.
// Failure then says why.
func (d *Driver) Broken() <-chan struct{} { return d.broken }

// failureGrace is how long the driver, having learned of one failure,
// gathers others before blaming a stage: a stage that fails closes its
// data links, so its neighbours fail as a consequence, a little later.
const failureGrace = 200 * time.Millisecond

// Failure waits until the pipeline is broken and a short grace has passed
// since (or ctx ends), then returns the failure, blaming the stage that
// caused it. A stage that fails makes the others fail on the data links
// it closes (downstream, upstream, and round the hand-off ring to the
// first stage), so the blame goes, in this order, to: a stage whose
// control link ended, or failed a send, without a failure report (its
// process died); a stage
// that reported a failure of its own (not of a data link); a stage that
// reported a data link failure. Among the same kind it goes to the one
// learned of first.
func (d *Driver) Failure(ctx context.Context) *StageError {
	select {
	case <-d.broken:
	case <-ctx.Done():
		return &StageError{Stage: -1, Err: ctx.Err()}
	}
	d.mu.Lock()
	wait := time.Until(d.brokenAt.Add(failureGrace))
	d.mu.Unlock()
	if wait > 0 {
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-ctx.Done():
		}
		t.Stop()
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	reported := map[int]bool{}
	for _, f := range d.facts {
		if f.reported {
			reported[f.stage] = true
		}
	}
	for _, f := range d.facts {
		if !f.reported && !reported[f.stage] {
			return &StageError{Stage: f.stage, Err: f.err}
		}
	}
	for _, link := range []bool{false, true} {
		for _, f := range d.facts {
			if f.reported && f.link == link {
				return &StageError{Stage: f.stage, Err: f.err}
			}
		}
	}
	f := d.facts[0]
	return &StageError{Stage: f.stage, Err: f.err}
}

// Step runs one step through the whole pipeline and returns the last
// stage's result (nil for a step that carries no sequences).
func (d *Driver) Step(ctx context.Context, s *Step) (*Result, error) {
	if err := d.Submit(ctx, s); err != nil {
		return nil, err
	}
	if len(s.Batch.Seqs) == 0 {
		return nil, nil
	}
	r, err := d.Wait(ctx)
	if err != nil {
		return nil, err
	}
	if r.Batch != s.Batch.ID {
		return nil, fmt.Errorf("last stage reported batch %d while batch %d was running", r.Batch, s.Batch.ID)
	}
	return r, nil
}

// Close closes every link at once (the stages' workers return; a stage
// that does not hang up costs no more than its link's own bound, in
// parallel with the others) and waits for the driver's goroutines.
func (d *Driver) Close() error {
	d.mu.Lock()
	d.closing = true
	d.mu.Unlock()
	errs := make([]error, len(d.links))
	var closing sync.WaitGroup
	for i, l := range d.links {
		closing.Go(func() {
			if err := l.Close(); err != nil {
				errs[i] = fmt.Errorf("close stage %d: %w", i, err)
			}
		})
	}
	done := make(chan struct{})
	go func() { closing.Wait(); d.wg.Wait(); close(done) }()
	for {
		select {
		case <-d.reports: // drain so forwarders can finish
		case <-done:
			return errors.Join(errs...)
		}
	}
}
