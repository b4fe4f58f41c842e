package pipeline

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// Driver is the leader's side of a pipeline: it sends every step to every
// stage and collects the last stage's results, in order. Several steps may
// be in flight (Submit several, then Wait for each); Step runs one.
type Driver struct {
	links   []Link
	reports chan report
	wg      sync.WaitGroup
}

type report struct {
	r     *Result // nil when the link ended
	stage int
}

// NewDriver drives the stages behind links, in pipeline order. It starts
// one goroutine per link that forwards the link's reports; Close stops them.
func NewDriver(links []Link) (*Driver, error) {
	if len(links) == 0 {
		return nil, errors.New("pipeline driver: no stages")
	}
	d := &Driver{links: links, reports: make(chan report, 4*len(links))}
	for i, l := range links {
		d.wg.Add(1)
		go func() {
			defer d.wg.Done()
			for r := range l.Results() {
				d.reports <- report{r, i}
			}
			d.reports <- report{nil, i}
		}()
	}
	return d, nil
}

// Stages is the number of stages.
func (d *Driver) Stages() int { return len(d.links) }

// Submit sends a step to every stage without waiting for its result.
func (d *Driver) Submit(ctx context.Context, s *Step) error {
	for i, l := range d.links {
		if err := l.Send(ctx, s); err != nil {
			return fmt.Errorf("send batch %d to stage %d: %w", s.Batch.ID, i, err)
		}
	}
	return nil
}

// Wait returns the last stage's result for the oldest submitted step that
// carried sequences (steps that only free sequences report nothing). A
// failure reported by any stage, or a lost link, is an error naming the
// stage; the pipeline is then unusable.
func (d *Driver) Wait(ctx context.Context) (*Result, error) {
	select {
	case rep := <-d.reports:
		if err := d.failure(rep); err != nil {
			return nil, d.rootCause(rep.stage, err)
		}
		return rep.r, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// failure turns a report that is not a result into an error.
func (d *Driver) failure(rep report) error {
	switch {
	case rep.r == nil:
		err := d.links[rep.stage].Err()
		if err == nil {
			err = errors.New("link closed")
		}
		return fmt.Errorf("stage %d: %w", rep.stage, err)
	case rep.r.Err != "":
		return fmt.Errorf("stage %d failed: %s", rep.stage, rep.r.Err)
	case rep.stage != len(d.links)-1:
		return fmt.Errorf("stage %d reported batch %d, but only the last stage reports results", rep.stage, rep.r.Batch)
	}
	return nil
}

// failureGrace is how long Wait, having seen one stage fail, gathers the
// others' reports to find the cause.
const failureGrace = 200 * time.Millisecond

// rootCause picks, among the failures reported within a short grace, the
// one of the earliest stage: a stage that fails closes its data links, so
// the stages after it fail as a consequence.
func (d *Driver) rootCause(stage int, err error) error {
	t := time.NewTimer(failureGrace)
	defer t.Stop()
	for {
		select {
		case rep := <-d.reports:
			if ferr := d.failure(rep); ferr != nil && rep.stage < stage {
				stage, err = rep.stage, ferr
			}
		case <-t.C:
			return err
		}
	}
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

// Close closes every link (the stages' workers return) and waits for the
// driver's goroutines.
func (d *Driver) Close() error {
	var errs []error
	for i, l := range d.links {
		if err := l.Close(); err != nil {
			errs = append(errs, fmt.Errorf("close stage %d: %w", i, err))
		}
	}
	done := make(chan struct{})
	go func() { d.wg.Wait(); close(done) }()
	for {
		select {
		case <-d.reports: // drain so forwarders can finish
		case <-done:
			return errors.Join(errs...)
		}
	}
}
