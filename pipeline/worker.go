package pipeline

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/stage"
)

// Worker serves one stage of a pipeline: for each step it receives the
// batch description from the leader, receives the stage's input
// activations from the previous stage (unless it is the first), runs the
// forward pass, and sends the output to the next stage (unless it is the
// last, which reports sampled tokens to the leader).
type Worker struct {
	Index int // the stage's position in the pipeline
	Stage stage.Stage
	Ctl   Control
	Prev  collective.Receiver // nil on the first stage
	Next  collective.Sender   // nil on the last stage
	// Epoch is the leader epoch the stage was assigned in; steps of an
	// older epoch are refused (0 accepts every step).
	Epoch uint64
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
	for {
		st, err := w.Ctl.Next(ctx)
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("stage %d: next step: %w", w.Index, err)
		}
		var res *Result
		if st.Epoch < w.Epoch {
			err = fmt.Errorf("step of leader epoch %d refused: the stage was assigned in epoch %d", st.Epoch, w.Epoch)
		} else {
			res, err = w.step(ctx, info, st)
		}
		if err != nil {
			err = fmt.Errorf("stage %d (layers %d-%d), batch %d: %w", w.Index, info.Lo, info.Hi, st.Batch.ID, err)
			if rerr := w.Ctl.Report(ctx, &Result{Batch: st.Batch.ID, Stage: w.Index, Err: err.Error()}); rerr != nil {
				return errors.Join(err, fmt.Errorf("report failure: %w", rerr))
			}
			return err
		}
		if res != nil {
			if err := w.Ctl.Report(ctx, res); err != nil {
				return fmt.Errorf("stage %d: report batch %d: %w", w.Index, st.Batch.ID, err)
			}
		}
	}
}

func (w *Worker) step(ctx context.Context, info stage.Info, st *Step) (*Result, error) {
	for _, id := range st.Free {
		w.Stage.Free(id)
	}
	if len(st.Batch.Seqs) == 0 {
		return nil, nil
	}
	if w.Prev != nil {
		h := collective.Header{Batch: st.Batch.ID, Rows: st.Batch.NumTokens(), Cols: info.Hidden, DType: info.ActDType}
		if err := w.Prev.Recv(ctx, h, w.Stage.Input()); err != nil {
			return nil, fmt.Errorf("receive activations: %w", err)
		}
	}
	out, err := w.Stage.Forward(ctx, &st.Batch)
	if err != nil {
		return nil, fmt.Errorf("forward: %w", err)
	}
	if w.Next != nil {
		if err := w.Next.Send(ctx, out.Header, out.Activations); err != nil {
			return nil, fmt.Errorf("send activations: %w", err)
		}
		return nil, nil
	}
	return &Result{Batch: st.Batch.ID, Stage: w.Index, Sampled: out.Sampled, Logits: out.Logits}, nil
}
