package cuda

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/stage"
)

// flight is the host side of one step on its way through the device: its
// validated plan over a pinned batch description of its own, the pinned
// buffers its sampled tokens and status come back into, the events around
// its work and its Output. The stage has stage.LaunchDepth of them, used
// in turn, so that a step can be launched while the one before it runs:
// the description of the next step is written while the device may still
// copy the last one's, and the sampled tokens of the last step stay until
// it is finished. The logits buffer is the stage's one (a step asking for
// logits runs alone).
type flight struct {
	p          plan
	hostBatch  []byte  // pinned: p.words
	hostSample []int32 // pinned (last stage): the sampler's output
	status     []int32 // pinned (first stage): the status array read back
	back       []int32 // pinned (first and last stage): status, then hostSample, one allocation
	events     [2]gpu.Event
	out        stage.Output

	b      *stage.Batch
	step   graphs.Step // the step's graph step (mode None: eager)
	sh     shape       // what its kernels are launched for
	own    bool        // the stage applies its own hand-off rows in the step
	logits bool        // a sequence asks for logits
	done   chan struct{}
	err    error         // the waiter's
	gpu    time.Duration // device time, between the events
}

// Launch implements stage.Launcher: it validates b and orders its work on
// the stage's stream as Forward does; with Batch.Handoff on a stage that
// is both first and last, its sampler also records each token under its
// sequence's slot, so that a batch launched next reads its placeholders
// from them. A goroutine of the stage waits for the work, on a thread of its
// own with the device's context current, so that the device goroutine
// stays free to launch the next batch; the channel is closed once the
// work is done.
func (s *Stage) Launch(ctx context.Context, b *stage.Batch) (<-chan struct{}, error) {
	f, err := s.startBatch(ctx, b, true)
	if err != nil {
		return nil, err
	}
	// The next batch of each sequence follows this one.
	s.pl.commit(b)
	if s.waits == nil {
		s.startWaiter()
	}
	f.done = make(chan struct{})
	s.waits <- f
	return f.done, nil
}

// LaunchedOutput implements stage.LinkedLauncher: the header and buffer of
// the activations (every stage but the last) or of the hand-off rows (the
// last, for a Handoff batch) of the batch launched last; nil when none is.
// The buffers are the stage's own, which every batch writes: a transfer
// ordered after the batch on the stage's stream reads them before the
// next batch's work.
func (s *Stage) LaunchedOutput() *stage.Output {
	if s.launched == 0 {
		return nil
	}
	o := &s.launchedOut
	*o = stage.Output{}
	s.sendBuffers(&s.fl[(s.oldest+s.launched-1)%stage.LaunchDepth], o)
	return o
}

// sendBuffers sets what of f's Output goes to another stage, its header
// and the stage's buffer it is in: the activations on every stage but the
// last, the hand-off rows (one per sampled sequence) on the last for a
// Handoff batch.
func (s *Stage) sendBuffers(f *flight, o *stage.Output) {
	switch {
	case !s.last:
		o.Header = collective.Header{Batch: f.b.ID, Rows: f.p.tokens, Cols: s.m.HiddenSize, DType: collective.F32}
		o.Activations = s.outBuf
	case f.b.Handoff:
		o.HandoffHeader = collective.Header{Batch: f.b.ID, Rows: f.p.nSampled, Cols: stage.HandoffCols, DType: collective.I32}
		o.Handoff = s.ho.out
	}
}

// Finish implements stage.Launcher.
func (s *Stage) Finish(ctx context.Context) (*stage.Output, error) {
	if s.launched == 0 {
		return nil, fmt.Errorf("cuda stage [%d,%d): finish with no batch launched", s.lo, s.hi)
	}
	f := &s.fl[s.oldest]
	select {
	case <-f.done:
	case <-ctx.Done():
		return nil, fmt.Errorf("cuda stage [%d,%d): batch %d: %w", s.lo, s.hi, f.b.ID, context.Cause(ctx))
	}
	return s.finish(f, f.err)
}

// startBatch validates b and orders its work in the next flight; own has
// a first-and-last stage apply its hand-off in the step. The caller
// records the batch as run (planner.commit).
func (s *Stage) startBatch(ctx context.Context, b *stage.Batch, own bool) (*flight, error) {
	if s.closed {
		return nil, fmt.Errorf("cuda stage [%d,%d): forward after close", s.lo, s.hi)
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("cuda stage [%d,%d): batch %d: %w", s.lo, s.hi, b.ID, err)
	}
	logits := false
	for i := range b.Seqs {
		logits = logits || b.Seqs[i].Logits
	}
	switch {
	case s.launched == stage.LaunchDepth:
		return nil, fmt.Errorf("cuda stage [%d,%d): batch %d: %d batches launched already", s.lo, s.hi, b.ID, s.launched)
	case s.launched > 0 && (logits || s.launchedLogits()):
		return nil, fmt.Errorf("cuda stage [%d,%d): batch %d: a batch asking for logits runs alone", s.lo, s.hi, b.ID)
	}
	step := b.Graph
	if step != (graphs.Step{}) {
		name := fmt.Sprintf("[%d,%d) on GPU %d", s.lo, s.hi, s.dev.Ordinal())
		if err := step.Validate(name, b.NumTokens(), len(b.Seqs), s.g.keys); err != nil {
			return nil, fmt.Errorf("cuda stage [%d,%d): batch %d: %w", s.lo, s.hi, b.ID, err)
		}
	}
	f := &s.fl[(s.oldest+s.launched)%stage.LaunchDepth]
	if err := s.pl.build(b, &f.p); err != nil {
		return nil, fmt.Errorf("cuda stage [%d,%d): %w", s.lo, s.hi, err)
	}
	f.b, f.step, f.sh = b, step, shape{tokens: f.p.tokens, rows: f.p.rows, sampled: f.p.nSampled, decode: f.p.tokens == len(b.Seqs)}
	f.own, f.logits, f.err, f.gpu = own && b.Handoff && s.first && s.last, logits, nil, 0
	if f.own {
		s.pl.applyOwn(&f.p)
	}
	if step.Mode != graphs.None {
		f.sh = s.pl.keyShape(step)
		s.pl.pad(&f.p, f.sh)
	}
	// A full graph's attention was captured without the lists.
	if s.prefill && step.Mode != graphs.Full {
		if tiles, rows := s.pl.lay.prefillLists(f.p.words, f.sh.tokens); tiles > 0 {
			f.sh.tiles, f.sh.rowsLeft = tiles, rows
		}
	}
	if err := s.dev.Do(func() error { return s.run(f) }); err != nil {
		return nil, fmt.Errorf("cuda stage [%d,%d): batch %d (%s): %w", s.lo, s.hi, b.ID, step, err)
	}
	s.launched++
	return f, nil
}

// launchedLogits reports whether a launched batch asks for logits.
func (s *Stage) launchedLogits() bool {
	for k := range s.launched {
		if s.fl[(s.oldest+k)%stage.LaunchDepth].logits {
			return true
		}
	}
	return false
}

// finish ends the oldest flight, whose work is done (err: waiting for it
// failed), and builds its Output.
func (s *Stage) finish(f *flight, err error) (*stage.Output, error) {
	s.oldest = (s.oldest + 1) % stage.LaunchDepth
	s.launched--
	b := f.b
	if err != nil {
		return nil, fmt.Errorf("cuda stage [%d,%d): batch %d (%s): %w", s.lo, s.hi, b.ID, f.step, err)
	}
	s.lastGPU = f.gpu
	if f.p.placeholders {
		if err := s.statusError(f.status, b); err != nil {
			return nil, fmt.Errorf("cuda stage [%d,%d): batch %d: %w", s.lo, s.hi, b.ID, err)
		}
	}
	return s.output(f), nil
}

// await waits for a flight's work and reads its device time. On the device
// goroutine, or on a thread with the device's context current.
func (s *Stage) await(f *flight) error {
	if err := f.events[1].Synchronize(); err != nil {
		return fmt.Errorf("run batch: %w", err)
	}
	d, err := gpu.Elapsed(f.events[0], f.events[1])
	if err != nil {
		return err
	}
	f.gpu = d
	return nil
}

// startWaiter starts the goroutine that waits for launched flights, in
// launch order, and closes their done channels; stopWaiter ends it.
func (s *Stage) startWaiter() {
	s.waits = make(chan *flight, stage.LaunchDepth)
	s.waiterDone = make(chan struct{})
	go func() {
		defer close(s.waiterDone)
		unlock, err := s.dev.LockThread()
		if err != nil {
			err = fmt.Errorf("wait for launched batches: %w", err)
		} else {
			defer unlock()
		}
		for f := range s.waits {
			if err != nil {
				f.err = err
			} else {
				f.err = s.await(f)
			}
			close(f.done)
		}
	}()
}

// stopWaiter ends the waiter once it has waited for every flight sent to
// it.
func (s *Stage) stopWaiter() {
	if s.waits != nil {
		close(s.waits)
		<-s.waiterDone
		s.waits = nil
	}
}

// allocFlights makes each flight's pinned buffers and events. Device
// goroutine only.
func (s *Stage) allocFlights(lay layout) error {
	for i := range s.fl {
		f := &s.fl[i]
		for k := range f.events {
			var err error
			if f.events[k], err = gpu.NewEvent(); err != nil {
				return fmt.Errorf("create event: %w", err)
			}
		}
		hb, err := s.allocHost(lay.words()*4, "the batch description")
		if err != nil {
			return err
		}
		f.hostBatch = hb
		f.p.words = asInt32s(hb)
		// Block table word 0 is the scratch block, which padding rows read.
		f.p.words[lay.tables()] = int32(s.pl.kv.blocks)
		switch {
		case s.first && s.last:
			// As the device has them (planWorkspace): one copy reads both.
			hs, err := s.allocHost((statusWords+lay.maxSeqs*sampleOutInts)*4, "the hand-off status and sampled tokens")
			if err != nil {
				return err
			}
			f.back = asInt32s(hs)
			f.status, f.hostSample = f.back[:statusWords:statusWords], f.back[statusWords:]
		case s.first:
			hs, err := s.allocHost(statusWords*4, "the hand-off status")
			if err != nil {
				return err
			}
			f.status = asInt32s(hs)
		case s.last:
			hs, err := s.allocHost(lay.maxSeqs*sampleOutInts*4, "sampled tokens")
			if err != nil {
				return err
			}
			f.hostSample = asInt32s(hs)
		}
	}
	return nil
}

// releaseFlights destroys the flights' events (their pinned buffers are
// the stage's). Device goroutine only.
func (s *Stage) releaseFlights() error {
	var errs []error
	for i := range s.fl {
		for _, e := range s.fl[i].events {
			if e != 0 {
				errs = append(errs, e.Destroy())
			}
		}
	}
	return errors.Join(errs...)
}

var _ stage.LinkedLauncher = (*Stage)(nil)
