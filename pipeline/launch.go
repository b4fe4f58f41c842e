package pipeline

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/stage"
)

// serveLaunched is Serve for a stage.Launcher (a CUDA stage) that is the
// only stage of its pipeline, or a stage.LinkedLauncher (linked set) whose
// links all order their transfers on its stream: each step is launched on
// the device as soon as it arrives, behind the one running (up to
// stage.LaunchDepth), and reported when it is done. The device then runs
// step after step while the host reports the last one's tokens and the
// leader schedules the next: the leader's round trip hides behind the
// step in flight as long as it is shorter. A single stage applies its own
// hand-off rows on the device (stage.Launcher), so a step whose
// placeholders stand for the tokens of the step before it is launched
// before those tokens reach the host. A linked stage orders its step's
// receives before the launch (the hand-off rows it awaits, queued with
// QueueHandoff, on the first stage; the activations on the others) and
// its sends after it, from LaunchedOutput, none waited for: its device
// takes the step as soon as the input is there.
func (w *Worker) serveLaunched(ctx context.Context, info stage.Info, l stage.Launcher, linked stage.LinkedLauncher) error {
	next, stop := w.prefetch(ctx)
	defer stop()
	var (
		queue []launched // oldest first
		held  *Step      // read, asking for logits: launched alone once the queue is empty
		got   time.Duration
		ended bool          // the leader closed the link: finish the steps launched, then return
		last  time.Duration // when the step finished last was seen done
	)
	// drain finishes what is launched, dropping the outputs: the stage is
	// then idle when Serve returns.
	drain := func() {
		for range queue {
			_, _ = l.Finish(context.WithoutCancel(ctx))
		}
		queue = nil
	}
	fail := func(st *Step, err error) error {
		err = fmt.Errorf("stage %d (layers %d-%d), batch %d: %w", w.Index, info.Lo, info.Hi, st.Batch.ID, err)
		if rerr := w.Ctl.Report(ctx, &Result{Batch: st.Batch.ID, Stage: w.Index, Err: err.Error()}); rerr != nil {
			return errors.Join(err, fmt.Errorf("report failure: %w", rerr))
		}
		return err
	}
	launch := func(st *Step) error {
		if linked != nil && !info.Last {
			// The leader may have the step's result, and reuse its
			// memory, while this stage still holds it launched.
			st = st.detach()
		}
		now := w.clk.now()
		t := StageTiming{Waited: got, Got: got, HandoffStart: now}
		switch {
		case linked != nil && info.First:
			if err := w.receiveHandoffs(ctx, st, linked.QueueHandoff); err != nil {
				return err
			}
		case linked == nil && w.applied < st.AwaitHandoff:
			return fmt.Errorf("step awaits %d hand-offs, but only %d hand-off steps have run", st.AwaitHandoff, w.applied)
		}
		t.HandoffEnd = w.clk.now()
		t.RecvStart, t.RecvEnd = t.HandoffEnd, t.HandoffEnd
		if w.Prev != nil {
			h := collective.Header{Batch: st.Batch.ID, Rows: st.Batch.NumTokens(), Cols: info.Hidden, DType: info.ActDType}
			if err := w.Prev.Recv(ctx, h, w.Stage.Input()); err != nil {
				return fmt.Errorf("%sreceive activations: %w", linkFailed, err)
			}
			t.RecvEnd = w.clk.now()
		}
		done, err := l.Launch(ctx, &st.Batch)
		if err != nil {
			return fmt.Errorf("forward: %w", err)
		}
		queue = append(queue, launched{st, done, t})
		if linked == nil {
			if st.Batch.Handoff {
				w.applied++
			}
			return nil
		}
		out := linked.LaunchedOutput()
		if st.Batch.Handoff {
			if err := w.handoff(ctx, info, &st.Batch, out); err != nil {
				return err
			}
		}
		if w.Next != nil {
			if err := w.Next.Send(ctx, out.Header, out.Activations); err != nil {
				return fmt.Errorf("%ssend activations: %w", linkFailed, err)
			}
		}
		return nil
	}
	for {
		if ended && len(queue) == 0 && held == nil {
			return nil
		}
		var in <-chan nextStep
		// A step asking for logits runs alone: nothing is launched behind it.
		alone := len(queue) > 0 && asksLogits(&queue[0].st.Batch)
		if !ended && held == nil && len(queue) < stage.LaunchDepth && !alone {
			in = next
		}
		var done <-chan struct{}
		if len(queue) > 0 {
			done = queue[0].done
		}
		select {
		case n, ok := <-in:
			if !ok {
				drain()
				return fmt.Errorf("stage %d: next step: %w", w.Index, context.Cause(ctx))
			}
			if errors.Is(n.err, io.EOF) {
				ended = true
				continue
			}
			if n.err != nil {
				drain()
				return fmt.Errorf("stage %d: next step: %w", w.Index, n.err)
			}
			st := n.st
			got = w.clk.now()
			if st.Epoch < w.Epoch {
				drain()
				return fail(st, fmt.Errorf("step of leader epoch %d refused: the stage was assigned in epoch %d", st.Epoch, w.Epoch))
			}
			for _, id := range st.Free {
				w.Stage.Free(id)
			}
			switch {
			case len(st.Batch.Seqs) == 0:
			case len(queue) > 0 && asksLogits(&st.Batch):
				held = st
			default:
				if err := launch(st); err != nil {
					drain()
					return fail(st, err)
				}
			}
		case <-ctx.Done():
			drain()
			return fmt.Errorf("stage %d: %w", w.Index, context.Cause(ctx))
		case <-done:
			st, t := queue[0].st, queue[0].t
			queue = queue[1:]
			// The device ran the step from its launch or the end of the
			// step before it, whichever came later, until now.
			t.ForwardEnd = w.clk.now()
			t.ForwardStart = max(t.RecvEnd, min(last, t.ForwardEnd))
			last = t.ForwardEnd
			out, err := l.Finish(ctx)
			if err == nil && st.Batch.Handoff && info.First && info.Last {
				err = checkHandoffOutput(handoffHeader(&st.Batch), out)
			} else if err != nil {
				err = fmt.Errorf("forward: %w", err)
			}
			if err != nil {
				drain()
				return fail(st, err)
			}
			w.account(&t)
			// Every stage but the last reports only the timing asked for.
			if info.Last || st.Report {
				res := &Result{Batch: st.Batch.ID, Stage: w.Index, Sampled: out.Sampled, Logits: out.Logits}
				if st.Report {
					res.Timing = &t
				}
				if err := w.Ctl.Report(ctx, res); err != nil {
					drain()
					return fmt.Errorf("stage %d: report batch %d: %w", w.Index, st.Batch.ID, err)
				}
			}
			if held != nil && len(queue) == 0 {
				st, held = held, nil
				if err := launch(st); err != nil {
					return fail(st, err)
				}
			}
		}
	}
}

// launched is a step launched on a stage.Launcher, the channel closed
// when its work is done, and its timing so far.
type launched struct {
	st   *Step
	done <-chan struct{}
	t    StageTiming
}

// asksLogits reports whether a sequence of b asks for its logits.
func asksLogits(b *stage.Batch) bool {
	for i := range b.Seqs {
		if b.Seqs[i].Logits {
			return true
		}
	}
	return false
}

// handoffHeader is the header of a hand-off step's message: one (slot,
// token) row per sampled sequence.
func handoffHeader(b *stage.Batch) collective.Header {
	h := collective.Header{Batch: b.ID, Cols: stage.HandoffCols, DType: collective.I32}
	for i := range b.Seqs {
		if b.Seqs[i].Sample {
			h.Rows++
		}
	}
	return h
}
