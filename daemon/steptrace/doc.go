// Package steptrace is a picture of the leader's pipeline: it records N
// steps as a Chrome trace (the Trace Event Format's JSON, which Perfetto
// and chrome://tracing open) and follows how busy each stage is.
//
// A trace has one track per stage, with each step's phases as the stage
// itself timed them (pipeline.StageTiming): waiting for the leader's
// step, awaiting hand-offs, receiving activations, the forward pass (its
// device time in its arguments) and sending on, so the pipeline's bubbles
// are the stages' waits, and where the stage measures its device time a
// second track with the device's work (placed at the end of the forward
// pass that waited for it); and the leader's track: the scheduler planning
// and submitting each step and taking its result, each step's life from
// submission to result (async slices), the steps in flight (a counter),
// and each request's time to first token. The summary (the trace's
// otherData, and Trace.Summary) gives each stage's busy fraction and where
// the rest of its time went.
//
// Clocks: every stage times its steps on its own monotonic clock. The
// leader never assumes it agrees with its own: a stage took a step after
// the leader submitted it and sent its output before its report reached
// the leader, so each recorded step bounds the offset between the clocks
// from above and below; a stage's spans are placed at the middle of the
// tightest bounds, one offset per stage, which keeps its spans in their
// own order and lengths. The summary gives each stage's remaining
// uncertainty.
//
// Cost: while no recording is under way, the observers do an atomic load
// and a clock comparison a step, and a step every StatsPeriod asks the
// stages for their timing (a small report each from all but the last
// stage), from which Busy follows their busy time.
//
// # Usage
//
//	rec := steptrace.New()
//	drv, _ := pipeline.DriverOptions{Observer: rec.Pipeline(epoch, nodes)}.New(links)
//	loop, _ := sched.LoopOptions{Observer: rec}.Start(cfg, drv)
//	...
//	tr, err := rec.Record(ctx, 200) // the next 200 steps
//	js, _ := tr.JSON()
//	_, stages := rec.Busy(time.Now())
//
// # Concurrency
//
// A Recorder is safe for concurrent use: its observers are called from
// the driver's and the scheduler loop's goroutines; Record blocks its
// caller until the recording ends, and one recording runs at a time.
package steptrace
