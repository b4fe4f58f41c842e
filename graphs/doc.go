// Package graphs is the plain-data half of CUDA graphs: modes, what stage
// backends support, batch descriptors, capture sizes, the dispatcher that
// picks a graph for each step, and dispatch statistics. It imports nothing
// CUDA (nor any other package of this module); the stages that capture and
// replay graphs use it.
//
// A pipeline is configured with a Mode (DefaultMode, FULL_AND_PIECEWISE,
// unless told otherwise). Resolve reduces it to what the weakest stage's
// Support allows; a CPU stage supports Never, so a pipeline with one runs
// every step eagerly (None). The dual modes split into a runtime mode for
// uniform decode batches (DecodeMode) and one for the rest (MixedMode).
//
// The leader's Dispatcher picks, once per step, the runtime mode (None,
// Piecewise or Full) and the BatchDescriptor of the graph to replay: a
// full graph for a uniform decode batch, then a full graph of mixed
// batches (mode Full only), then a piecewise graph on the relaxed
// descriptor, on the token count padded to the next capture size with one
// table lookup; past the largest capture size, None. The Step (mode and
// descriptor) travels with the batch description and every stage obeys
// it: a stage validates it against the keys it captured and fails the step
// when it cannot replay it, never running eagerly while its neighbours
// replay.
//
// # Usage
//
//	mode, reasons, err := graphs.Resolve(graphs.DefaultMode, 1, []graphs.StageSupport{
//		{Name: "stage 0 (cuda:0)", Support: graphs.UniformBatch},
//		{Name: "stage 1 (cuda:1)", Support: graphs.Always},
//	})
//	for _, r := range reasons {
//		slog.Info("CUDA graph mode downgraded", "reason", r)
//	}
//	d, err := graphs.NewDispatcher(graphs.Config{Mode: mode, MaxCaptureSize: 512, MaxNumSeqs: 256})
//	// each stage captures d.Keys() and keeps graphs.NewKeySet(captured)
//	...
//	m, desc := d.Dispatch(batch.NumTokens(), allSingleTokenDecodes, len(batch.Seqs))
//	stats.Record(batch.NumTokens(), desc.NumTokens, m)
//	step := graphs.Step{Mode: m, Desc: desc} // sent with the batch
//	...
//	// on a stage:
//	if err := step.Validate("stage 1", numTokens, numReqs, captured); err != nil {
//		return err
//	}
//
// # Concurrency
//
// Mode, Support, BatchDescriptor, Step and PaddingTable are values. A
// Dispatcher is immutable once built and safe for concurrent use; so is a
// KeySet that is no longer modified. Stats is safe for concurrent use.
package graphs
