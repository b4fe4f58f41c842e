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
// connects with DialLink.
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
// # Concurrency
//
// A Worker is run by one goroutine (Serve). A Driver's Submit may be called
// by one goroutine while another calls Wait (the scheduler keeps steps in
// flight that way); Step is Submit then Wait, for a single caller. The
// Driver owns one goroutine per link, which Close stops after the links
// end. A submitted Step's slices must not change until its result is back. StartLocal's worker goroutines end when the Driver closes their
// links. Results cross goroutines as copies: a stage reuses its output
// buffers on its next step.
//
// A step that fails on any stage leaves the data links out of step: the
// stage reports the failure and its worker returns, and the leader must
// rebuild the pipeline. Stages hold only caches, so nothing is lost that
// the leader cannot replay.
package pipeline
