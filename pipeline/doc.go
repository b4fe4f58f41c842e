// Package pipeline connects stages into a pipeline and drives it.
//
// A Worker serves one stage: each step it takes the batch description from
// the leader over a Control link, receives its input activations from the
// previous stage over a collective.Receiver, runs the forward pass, and
// sends its output to the next stage (or, on the last stage, reports the
// sampled tokens to the leader). The leader holds a Driver with one Link per
// stage; every stage receives every step, and the leader validates batches
// before sending them, so all stages stay in step.
//
// Two wirings exist: StartLocal runs all stages in this process over
// in-memory pipes; for separate processes, each stage process serves a
// ControlListener and TCP data links (package collective) and the leader
// connects with DialLink (ControlConfig.Listen and Dial with a link name,
// the leader epoch and the cluster credential).
//
// The control protocol between processes (netctl.go, wire.go) is
// length-prefixed protobuf (proto/tandem/control/v1/control.proto, Go code
// in controlpb), each message bounded (MaxStepBytes, MaxResultBytes) before
// it is read. A link opens with a handshake: the leader's hello (protocol
// version ControlVersion, link, epoch, nonce), the stage's challenge (its
// nonce and proof), the leader's proof, the stage's accept (package
// linkauth). Another protocol version, link or epoch, a missing or wrong
// proof, or a credential on one end only is refused, the message naming
// both sides' values; a stage's Accept logs the refused connection and
// waits for the next, so a forged connection cannot take the leader's
// place.
//
// On-device hand-off (stage.HandoffReceiver, stage.Batch.Handoff,
// Step.AwaitHandoff) lets the leader schedule a sequence's next decode
// before its previous token is back: the last stage's worker sends each
// hand-off step's (slot, token) rows over Worker.HandoffOut, a ring link to
// the first stage, before reporting the step's result; the first stage's
// worker, before running a step, receives them over Worker.HandoffIn in
// step order into the stage's HandoffInput and applies them until it has
// applied Step.AwaitHandoff in all. It knows each message's header without
// asking (batch id, one row per sampled sequence of the step, HandoffCols
// I32 columns): it ran the step first. A single stage applies its own
// rows, no link. StartLocal's variant LocalOptions{Handoff: true}.Start
// wires the ring as an in-memory pipe. Between processes the ring is one
// more data link: the last stage's node dials (collective.Dial, or NCCL
// from device memory) a listener of the first stage's node and sets the
// Sender as its Worker's HandoffOut; the first stage's node sets the
// accepted Receiver as HandoffIn. The link must hold the messages of as
// many steps as the leader keeps in flight (TCP's socket buffers do: a
// message is 8 bytes a sequence), since the first stage takes them only
// when a step awaits them; package sched keeps at most that many waiting.
//
// A stage that can launch a step and return before its work is done
// (stage.Launcher: a CUDA stage) is kept launched ahead: the pipeline's
// only stage always, and a stage of a longer pipeline when all its links
// order their transfers on its stream (collective.StreamOrdered: NCCL
// between CUDA stages, stage.LinkedLauncher). Its worker then orders a
// step's receives, launches it and orders its sends without waiting for
// any of them, so that the device takes the next step as soon as its
// input is there while the host reports the last one. Such a worker keeps
// a copy of each step it holds (the leader reuses an in-process step's
// memory once it has the last stage's result).
//
// Stages time their own steps (StageTiming: waiting for the step,
// awaiting hand-offs, receiving, the forward pass with its device time
// where the stage measures it, sending, and the busy time so far) on a
// monotonic clock of their own. A step with Step.Report asks for that
// timing: the last stage returns it with its result, the others in a
// report of their own, which the Driver hands its Observer
// (DriverOptions.Observer) with the time it arrived; the Observer also
// decides which steps ask (package daemon/steptrace: traces, and the
// stages' busy time).
//
// Generate is the plain driving loop: chunked prefill, decodes of running
// requests batched with other requests' prefill chunks, stop tokens and
// token limits. The scheduler replaces it with continuous batching over a
// paged KV cache.
//
// # Usage
//
//	d, err := pipeline.StartLocal(ctx, []stage.Stage{s0, s1})
//	...
//	defer d.Close()
//	err = pipeline.Generate(ctx, d, reqs, pipeline.GenerateOptions{MaxBatchTokens: 256}, emit)
//
// With hand-off, under the scheduler (one more step in flight than
// stages):
//
//	d, err := pipeline.LocalOptions{Handoff: true}.Start(ctx, stages)
//	...
//	l, err := sched.Start(sched.Config{..., MaxConcurrentBatches: len(stages) + 1, OnDeviceHandoff: true}, d)
//
// # Concurrency
//
// A Worker is run by one goroutine (Serve), with another that reads its
// control link one step ahead. A Driver's Submit may be called by one
// goroutine while another calls Wait (the scheduler keeps steps in
// flight that way); Step is Submit then Wait, for a single caller. The
// Driver owns one goroutine per link, which Close stops after the links
// end; Close closes the links concurrently. A submitted Step's slices
// must not change until its result is back. StartLocal's worker goroutines
// end when the Driver closes their links; each closes its worker's data
// and hand-off links when Serve returns, so a first stage waiting for a
// hand-off fails once the last stage's worker has stopped. Results cross
// goroutines as copies: a stage reuses its output buffers on its next
// step.
//
// A step that fails on any stage leaves the data links out of step: the
// stage reports the failure and its worker returns, and the leader must
// rebuild the pipeline. Stages hold only caches, so nothing is lost that
// the leader cannot replay. The Driver blames the stage that caused a
// failure (StageError): one whose control link ended without a report
// (its process died) before one that reported a failure of its own, and
// that before one that failed on a data link its neighbour closed.
// DriverOptions.StepTimeout fails a step whose result does not come (a
// stopped process, a hung device) instead of hanging; Broken tells a
// failure at once even while no step is in flight.
package pipeline
