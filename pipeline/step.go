package pipeline

import (
	"context"
	"slices"

	"github.com/tandem-llm/tandem/stage"
)

// Step is what the leader sends every stage for one step of the pipeline.
type Step struct {
	// Epoch is the leader epoch the step was sent in: a worker refuses a
	// step older than the epoch it was assigned in (a stale leader's).
	Epoch uint64
	Batch stage.Batch
	// Free lists sequences whose KV caches the stage drops before running
	// the batch (finished or cancelled requests).
	Free []uint64
	// AwaitHandoff is, with on-device hand-off, how many hand-off messages
	// (one per earlier step with Batch.Handoff set, in step order) the
	// first stage must have received and applied before it runs this
	// step: the placeholders of this step need their tokens. 0 otherwise.
	AwaitHandoff int
	// Report asks every stage for its timing of the step (Result.Timing):
	// the last stage with its result, the others in a report of their own.
	Report bool
}

// detach returns a copy of st that shares no memory with it. Under the
// scheduler an in-process step is the leader's own memory, reused once its
// result is back (sched.Executor): a stage that is not the last may still
// hold it launched by then.
func (st *Step) detach() *Step {
	c := *st
	c.Free = slices.Clone(st.Free)
	c.Batch.Seqs = slices.Clone(st.Batch.Seqs)
	for i := range c.Batch.Seqs {
		q := &c.Batch.Seqs[i]
		q.Tokens, q.Blocks = slices.Clone(q.Tokens), slices.Clone(q.Blocks)
	}
	return &c
}

// Result is what a stage reports for a step. The last stage reports every
// step with its sampled tokens; the others report failures, and their
// timing of the steps that ask for it (Step.Report), with no samples.
type Result struct {
	Batch   uint64
	Stage   int // index of the reporting stage
	Sampled []stage.Sampled
	Logits  []stage.SeqLogits
	// Err is the stage's failure, as text (it crosses process boundaries).
	Err string
	// Timing is the stage's account of the step when the step asked for
	// it (nil otherwise).
	Timing *StageTiming
}

// Control is a stage's link to the leader.
type Control interface {
	// Next blocks until the next step arrives. It returns io.EOF when the
	// leader has closed the pipeline.
	Next(ctx context.Context) (*Step, error)
	// Report sends a result to the leader.
	Report(ctx context.Context, r *Result) error
}

// Link is the leader's link to one stage.
type Link interface {
	// Send sends a step to the stage.
	Send(ctx context.Context, s *Step) error
	// Results delivers the stage's reports; it is closed when the link
	// ends, after which Err says why.
	Results() <-chan *Result
	// Err is the reason the link ended (nil while it is up, or after a
	// clean Close).
	Err() error
	// Close ends the link: the stage sees io.EOF from Next.
	Close() error
}
