package cuda

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/stage"
)

// KernelTime is the device time of the kernels of one kind in a profiled
// step: how many ran and their summed time.
type KernelTime struct {
	Label string
	Count int
	Time  time.Duration
}

// StepProfile is the per-kernel breakdown of one step (ProfileStep).
type StepProfile struct {
	Kernels []KernelTime  // by time, largest first
	Sum     time.Duration // the kernels' times added up
	Step    time.Duration // device time of the whole step, events included
}

// profile records an event before and after each kernel of a step.
type profile struct {
	events []gpu.Event
	labels []string
	n      int // events recorded
	err    error
}

// profileSpin is how long the profiled step's stream is held busy before
// its kernels, so that the host orders them all before the first runs.
const profileSpin = 30 * time.Millisecond

func (p *profile) record(s *Stage) {
	if p.err != nil {
		return
	}
	if p.n == len(p.events) {
		e, err := gpu.NewEvent()
		if err != nil {
			p.err = fmt.Errorf("create profiling event: %w", err)
			return
		}
		p.events = append(p.events, e)
	}
	if err := p.events[p.n].Record(s.stream); err != nil {
		p.err = err
		return
	}
	p.n++
}

func (p *profile) before(s *Stage, label string) {
	p.labels = append(p.labels, label)
	p.record(s)
}

func (p *profile) after(s *Stage) { p.record(s) }

// ProfileStep runs b like Forward, but eagerly (whatever b.Graph says) and
// with CUDA events around every kernel and GEMM, and returns each kind's
// device time. The stream is first held busy by a spin kernel, so that the
// host has ordered every launch before the device starts them: the events
// time the kernels, not the host. Kernels run one after the other, none
// starting early (no dependent launches), so the sum can exceed a
// replayed graph's time. It is a debugging and benchmarking aid, not for
// serving.
func (s *Stage) ProfileStep(ctx context.Context, b *stage.Batch) (*StepProfile, *stage.Output, error) {
	eager := *b
	eager.Graph = graphs.Step{}
	if s.profPool == nil {
		s.profPool = &profile{}
	}
	p := s.profPool
	p.n, p.labels, p.err = 0, p.labels[:0], nil
	s.prof = p
	out, err := s.Forward(ctx, &eager)
	s.prof = nil
	if err != nil {
		return nil, nil, err
	}
	if p.err != nil {
		return nil, nil, fmt.Errorf("cuda stage [%d,%d): profile: %w", s.lo, s.hi, p.err)
	}
	sum := map[string]*KernelTime{}
	var order []string
	err = s.dev.Do(func() error {
		for i, l := range p.labels {
			d, err := gpu.Elapsed(p.events[2*i], p.events[2*i+1])
			if err != nil {
				return err
			}
			k := sum[l]
			if k == nil {
				k = &KernelTime{Label: l}
				sum[l] = k
				order = append(order, l)
			}
			k.Count++
			k.Time += d
		}
		return nil
	})
	if err != nil {
		return nil, nil, fmt.Errorf("cuda stage [%d,%d): profile: %w", s.lo, s.hi, err)
	}
	r := &StepProfile{Step: s.lastGPU}
	for _, l := range order {
		r.Kernels = append(r.Kernels, *sum[l])
		r.Sum += sum[l].Time
	}
	slices.SortStableFunc(r.Kernels, func(a, b KernelTime) int { return cmp.Compare(b.Time, a.Time) })
	return r, out, nil
}

// spinBeforeStep holds the stream busy for a profiled step. Device
// goroutine only.
func (s *Stage) spinBeforeStep() error { return s.spin(profileSpin) }

// spin holds the stream busy for d. Device goroutine only.
func (s *Stage) spin(d time.Duration) error {
	a := s.args.Reset().Int64(d.Nanoseconds())
	if err := s.fn[kSpin].Launch(gpu.Dim3{X: 1}, gpu.Dim3{X: 32}, 0, s.stream, a); err != nil {
		return fmt.Errorf("kernel %s: %w", kSpin, err)
	}
	return nil
}

// releaseProfile destroys the profiling events. Device goroutine only.
func (s *Stage) releaseProfile() error {
	var errs []error
	if p := s.profPool; p != nil {
		for _, e := range p.events {
			errs = append(errs, e.Destroy())
		}
		p.events = nil
	}
	return errors.Join(errs...)
}
