package stage

import "context"

// Launcher is implemented by a stage that can queue a batch's work on its
// device and return before the work is done (stage/cuda), so that a
// pipeline's only stage queues the next step behind the one running: the
// device then never waits while the host reports a step's tokens and takes
// the next step from the leader. Forward is Launch then Finish.
//
// At most LaunchDepth batches are launched and not yet finished; they run
// in launch order, and Finish returns their outputs in that order. A batch
// that asks for logits (Seq.Logits) is launched only when no other is.
// Launching validates the batch as Forward does and records it as run:
// the next batch of a sequence follows it at once. Free may be called
// between launches; it concerns batches launched after it. With
// Batch.Handoff on a stage that is both first and last, the stage applies
// its own (slot, token) rows after the batch, in order, so that the
// placeholders of batches launched after it read them: no ApplyHandoff
// call follows (Output.Handoff still describes the rows). A batch Launch
// refuses (it is malformed, or it would exceed the depth) changes nothing;
// a failure once its work is queued (Launch's other errors, Finish's)
// leaves the stage unusable but for Close, as a failed step leaves its
// pipeline.
type Launcher interface {
	Stage
	// Launch validates b and queues its work. The returned channel is
	// closed once the work is done: Finish then returns without waiting.
	// b and its slices must not change until Finish has returned its
	// Output.
	Launch(ctx context.Context, b *Batch) (done <-chan struct{}, err error)
	// Finish waits for the oldest launched batch and returns its Output,
	// valid until the next Finish or Forward.
	Finish(ctx context.Context) (*Output, error)
}

// LaunchDepth is the most batches a Launcher holds launched and not
// finished: one running and one queued behind it.
const LaunchDepth = 2

// LinkedLauncher is a Launcher that a worker also keeps launched ahead in
// a pipeline of several stages, when every link of the stage orders its
// transfers on the stage's own device stream (collective.StreamOrdered:
// NCCL links between CUDA stages). The worker then orders a step's
// receives (the hand-off rows with QueueHandoff on the first stage, the
// activations on the others), launches it, and orders its sends behind
// it, none of them waited for: the device runs the step as soon as its
// input is there, while the host launches the next.
type LinkedLauncher interface {
	Launcher
	HandoffReceiver
	// LaunchedOutput is the Output of the batch launched last as far as it
	// is known at launch: Header and Activations on every stage but the
	// last, and HandoffHeader and Handoff on the last for a Handoff batch.
	// Their contents are there for transfers ordered after the batch.
	LaunchedOutput() *Output
	// QueueHandoff is ApplyHandoff (first stage) ordered behind what is
	// ordered on the stage's stream (the receive of HandoffInput) and not
	// waited for: HandoffInput may be received into again by a transfer
	// ordered after it, and a row it refuses fails the next batch launched
	// that reads placeholders.
	QueueHandoff(ctx context.Context, rows int) error
}
