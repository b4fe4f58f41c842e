package pipeline

import (
	"context"
	"errors"
	"fmt"
	"io"
	"reflect"
	"strings"
	"time"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/stage"
)

// linkFailed begins, in a stage's failure, the failure of one of its data
// links (activations or hand-off): the consequence of a neighbour's
// failure, more often than not, which the Driver blames first.
const linkFailed = "data link failed: "

// LinkFailure reports whether a worker's error is the failure of one of
// its data links (its neighbour ended, failed, or the pipeline was being
// closed), rather than of its own stage.
func LinkFailure(err error) bool { return err != nil && strings.Contains(err.Error(), linkFailed) }

// Worker serves one stage of a pipeline: for each step it receives the
// batch description from the leader, receives the stage's input
// activations from the previous stage (unless it is the first), runs the
// forward pass, and sends the output to the next stage (unless it is the
// last, which reports sampled tokens to the leader).
//
// With on-device hand-off (a step's Batch.Handoff), the last stage's
// Output.Handoff goes over HandoffOut, a ring link to the first stage,
// before the step's result is reported. The first stage's worker records,
// for each hand-off step it has run, the message it expects (batch id, one
// row per sampled sequence), and before running a step receives those
// messages in order over HandoffIn into the stage's HandoffInput and
// applies them (stage.HandoffReceiver), until it has applied
// Step.AwaitHandoff in all. A single stage, first and last, applies its
// own Output.Handoff after each hand-off step, with no link.
//
// A pipeline's only stage that is a stage.Launcher (a CUDA stage) is not
// run one Forward at a time: the worker launches each step as soon as it
// has read it, behind the step still running (up to stage.LaunchDepth),
// and reports each when it is done, in order; the stage applies its own
// hand-off rows on the device. The device then runs step after step while
// the host reports one and the leader schedules the next. So is a
// stage.LinkedLauncher of a longer pipeline when all its links order
// their transfers on its stream (collective.StreamOrdered: NCCL between
// CUDA stages): the worker orders a step's receives, launches it and
// orders its sends, and goes on to the next step while the device waits
// for the input and runs the step.
type Worker struct {
	Index int // the stage's position in the pipeline
	Stage stage.Stage
	Ctl   Control
	Prev  collective.Receiver // nil on the first stage
	Next  collective.Sender   // nil on the last stage
	// HandoffOut sends hand-off rows from the last stage to the first, and
	// HandoffIn receives them on the first stage, whose Stage must then
	// implement stage.HandoffReceiver. Both are nil unless the pipeline
	// has two stages or more and hand-off is on; a worker asked for a
	// hand-off without them fails the step. The link must hold as many
	// messages as the leader keeps steps in flight: the first stage takes
	// them only when a step awaits them.
	HandoffOut collective.Sender
	HandoffIn  collective.Receiver
	// Epoch is the leader epoch the stage was assigned in; steps of an
	// older epoch are refused (0 accepts every step).
	Epoch uint64

	// The first stage's hand-off state: the messages of the hand-off steps
	// it has run and not applied yet, oldest first, and how many it has
	// applied.
	expect  []collective.Header
	applied int

	// clk is the worker's clock, t the timing of the step being run, and
	// busy and deviceBusy the stage's busy times so far.
	clk              clock
	t                StageTiming
	busy, deviceBusy time.Duration
}

// Serve runs steps until the leader closes the control link (it then
// returns nil) or a step fails. A failed step is reported to the leader
// before Serve returns its error: the data links are then out of step, so
// the pipeline must be rebuilt.
func (w *Worker) Serve(ctx context.Context) error {
	info := w.Stage.Info()
	if (w.Prev == nil) != info.First || (w.Next == nil) != info.Last {
		return fmt.Errorf("stage %d (layers %d-%d): links do not match its place in the pipeline", w.Index, info.Lo, info.Hi)
	}
	if w.HandoffIn != nil && (!info.First || info.Last) || w.HandoffOut != nil && (!info.Last || info.First) {
		return fmt.Errorf("stage %d (layers %d-%d): a hand-off link belongs to the first stage (in) and the last (out) of two or more", w.Index, info.Lo, info.Hi)
	}
	if _, ok := w.Stage.(stage.HandoffReceiver); w.HandoffIn != nil && !ok {
		return fmt.Errorf("stage %d (layers %d-%d): a hand-off link in, but the stage (%T) cannot take hand-offs", w.Index, info.Lo, info.Hi, w.Stage)
	}
	w.clk = clock{start: time.Now()}
	if l, ok := w.Stage.(stage.Launcher); ok && info.First && info.Last {
		return w.serveLaunched(ctx, info, l, nil)
	}
	if l, ok := w.Stage.(stage.LinkedLauncher); ok && w.streamOrdered() {
		return w.serveLaunched(ctx, info, l, l)
	}
	next, stop := w.prefetch(ctx)
	defer stop()
	for {
		w.t = StageTiming{Waited: w.clk.now()}
		n, ok := <-next
		st, err := n.st, n.err
		if !ok {
			err = context.Cause(ctx)
		}
		w.t.Got = w.clk.now()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("stage %d: next step: %w", w.Index, err)
		}
		// What the reports need, read before the step runs: once a stage
		// that is not the last has sent its activations, the leader may
		// have the step's result and reuse the step's memory (in-process).
		id, report := st.Batch.ID, st.Report && len(st.Batch.Seqs) > 0
		var res *Result
		if st.Epoch < w.Epoch {
			err = fmt.Errorf("step of leader epoch %d refused: the stage was assigned in epoch %d", st.Epoch, w.Epoch)
		} else {
			res, err = w.step(ctx, info, st)
		}
		if err != nil {
			err = fmt.Errorf("stage %d (layers %d-%d), batch %d: %w", w.Index, info.Lo, info.Hi, id, err)
			if rerr := w.Ctl.Report(ctx, &Result{Batch: id, Stage: w.Index, Err: err.Error()}); rerr != nil {
				return errors.Join(err, fmt.Errorf("report failure: %w", rerr))
			}
			return err
		}
		if report {
			if res == nil {
				res = &Result{Batch: id, Stage: w.Index}
			}
			t := w.t
			res.Timing = &t
		}
		if res != nil {
			if err := w.Ctl.Report(ctx, res); err != nil {
				return fmt.Errorf("stage %d: report batch %d: %w", w.Index, id, err)
			}
		}
	}
}

// nextStep is a step read from the control link, or why none was.
type nextStep struct {
	st  *Step
	err error
}

// prefetch reads the leader's steps on a goroutine of its own, one ahead
// of the worker, so that reading and decoding the next step overlaps the
// current one's forward pass instead of following it. The channel carries
// the link's end (io.EOF) or error last, and is closed when the goroutine
// ends (also when ctx ends first); stop ends the goroutine and waits for
// it.
func (w *Worker) prefetch(ctx context.Context) (<-chan nextStep, func()) {
	ctx, cancel := context.WithCancel(ctx)
	next := make(chan nextStep, 1)
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer close(next)
		for {
			st, err := w.Ctl.Next(ctx)
			select {
			case next <- nextStep{st, err}:
			case <-ctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	return next, func() { cancel(); <-done }
}

func (w *Worker) step(ctx context.Context, info stage.Info, st *Step) (*Result, error) {
	for _, id := range st.Free {
		w.Stage.Free(id)
	}
	if len(st.Batch.Seqs) == 0 {
		return nil, nil
	}
	t := &w.t
	t.HandoffStart = w.clk.now()
	if info.First {
		if err := w.awaitHandoff(ctx, st); err != nil {
			return nil, err
		}
	}
	t.HandoffEnd = w.clk.now()
	t.RecvStart = t.HandoffEnd
	if w.Prev != nil {
		h := collective.Header{Batch: st.Batch.ID, Rows: st.Batch.NumTokens(), Cols: info.Hidden, DType: info.ActDType}
		if err := w.Prev.Recv(ctx, h, w.Stage.Input()); err != nil {
			return nil, fmt.Errorf("%sreceive activations: %w", linkFailed, err)
		}
		t.RecvEnd = w.clk.now()
	} else {
		t.RecvEnd = t.RecvStart
	}
	t.ForwardStart = t.RecvEnd
	out, err := w.Stage.Forward(ctx, &st.Batch)
	if err != nil {
		return nil, fmt.Errorf("forward: %w", err)
	}
	t.ForwardEnd = w.clk.now()
	w.account(t)
	if st.Batch.Handoff {
		if err := w.handoff(ctx, info, &st.Batch, out); err != nil {
			return nil, err
		}
	}
	if w.Next != nil {
		if err := w.Next.Send(ctx, out.Header, out.Activations); err != nil {
			return nil, fmt.Errorf("%ssend activations: %w", linkFailed, err)
		}
		t.SendEnd = w.clk.now()
		return nil, nil
	}
	t.SendEnd = w.clk.now()
	return &Result{Batch: st.Batch.ID, Stage: w.Index, Sampled: out.Sampled, Logits: out.Logits}, nil
}

// streamOrdered reports whether the worker has links and every one orders
// its transfers on the stage's stream (collective.StreamOrdered).
func (w *Worker) streamOrdered() bool {
	links := 0
	for _, l := range []any{w.Prev, w.Next, w.HandoffIn, w.HandoffOut} {
		switch o, ok := l.(collective.StreamOrdered); {
		case l == nil:
		case !ok || !o.StreamOrdered():
			return false
		default:
			links++
		}
	}
	return links > 0
}

// awaitHandoff receives and applies, in order, the hand-off messages of the
// steps run so far until st.AwaitHandoff are applied (first stage).
func (w *Worker) awaitHandoff(ctx context.Context, st *Step) error {
	recv, _ := w.Stage.(stage.HandoffReceiver)
	if recv == nil {
		return w.receiveHandoffs(ctx, st, nil)
	}
	return w.receiveHandoffs(ctx, st, recv.ApplyHandoff)
}

// receiveHandoffs receives, in order, the hand-off messages of the steps
// run so far into the stage's HandoffInput, applying each with apply,
// until st.AwaitHandoff are applied (first stage).
func (w *Worker) receiveHandoffs(ctx context.Context, st *Step, apply func(context.Context, int) error) error {
	if w.applied >= st.AwaitHandoff {
		return nil
	}
	recv, ok := w.Stage.(stage.HandoffReceiver)
	if !ok || apply == nil || w.HandoffIn == nil {
		return fmt.Errorf("step awaits %d hand-offs, but the stage has no hand-off link in", st.AwaitHandoff)
	}
	for w.applied < st.AwaitHandoff {
		if len(w.expect) == 0 {
			return fmt.Errorf("step awaits %d hand-offs, but only %d hand-off steps have run", st.AwaitHandoff, w.applied)
		}
		h := w.expect[0]
		w.expect = w.expect[1:]
		if err := w.HandoffIn.Recv(ctx, h, recv.HandoffInput()); err != nil {
			return fmt.Errorf("%sreceive the hand-off of batch %d: %w", linkFailed, h.Batch, err)
		}
		if err := apply(ctx, h.Rows); err != nil {
			return fmt.Errorf("apply the hand-off of batch %d: %w", h.Batch, err)
		}
		w.applied++
	}
	return nil
}

// handoff does a hand-off step's part after the forward pass: the first
// stage expects the step's message, the last sends it, and a single stage
// applies it at once.
func (w *Worker) handoff(ctx context.Context, info stage.Info, b *stage.Batch, out *stage.Output) error {
	want := handoffHeader(b)
	switch {
	case info.First && info.Last:
		if err := checkHandoffOutput(want, out); err != nil {
			return err
		}
		recv, ok := w.Stage.(stage.HandoffReceiver)
		if !ok {
			return fmt.Errorf("batch asks for a hand-off, but the stage (%T) cannot take hand-offs", w.Stage)
		}
		if err := copyHandoff(want, out.Handoff, recv.HandoffInput()); err != nil {
			return err
		}
		if err := recv.ApplyHandoff(ctx, want.Rows); err != nil {
			return fmt.Errorf("apply the hand-off: %w", err)
		}
		w.applied++
	case info.First:
		if w.HandoffIn == nil {
			return errors.New("batch asks for a hand-off, but the first stage has no hand-off link in")
		}
		w.expect = append(w.expect, want)
	case info.Last:
		if w.HandoffOut == nil {
			return errors.New("batch asks for a hand-off, but the last stage has no hand-off link out")
		}
		if err := checkHandoffOutput(want, out); err != nil {
			return err
		}
		if err := w.HandoffOut.Send(ctx, out.HandoffHeader, out.Handoff); err != nil {
			return fmt.Errorf("%ssend the hand-off: %w", linkFailed, err)
		}
	}
	return nil
}

// checkHandoffOutput checks the last stage's hand-off against the batch.
func checkHandoffOutput(want collective.Header, out *stage.Output) error {
	if out.HandoffHeader != want || out.Handoff == nil {
		return fmt.Errorf("stage hand-off %v (buffer %T), want %v", out.HandoffHeader, out.Handoff, want)
	}
	return nil
}

// copyHandoff moves a single stage's hand-off rows from its output into its
// hand-off input: a copy in host memory; elsewhere the stage must use one
// buffer for both.
func copyHandoff(h collective.Header, from, to collective.Buffer) error {
	src, srcHost := from.(collective.Host)
	dst, dstHost := to.(collective.Host)
	switch {
	case srcHost && dstHost:
		if len(src) < h.Bytes() || len(dst) < h.Bytes() {
			return fmt.Errorf("hand-off %v: output holds %d bytes, input %d", h, len(src), len(dst))
		}
		copy(dst, src[:h.Bytes()])
		return nil
	case !srcHost && reflect.TypeOf(from) == reflect.TypeOf(to) && reflect.TypeOf(from).Comparable() && from == to:
		return nil
	}
	return fmt.Errorf("hand-off %v: output buffer %T is not the stage's hand-off input %T, and not host memory", h, from, to)
}

// account adds a step's forward (t.ForwardStart to t.ForwardEnd) to the
// stage's busy times and records the device time and the running totals
// in t; the send starts where the forward ended until the send says when.
func (w *Worker) account(t *StageTiming) {
	if dt, ok := w.Stage.(DeviceTimer); ok {
		t.Device = dt.LastStepTime()
	}
	w.busy += t.ForwardEnd - t.ForwardStart
	w.deviceBusy += t.Device
	t.Busy, t.DeviceBusy = w.busy, w.deviceBusy
	t.SendStart, t.SendEnd = t.ForwardEnd, t.ForwardEnd
}
