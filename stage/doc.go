// Package stage defines a pipeline stage: the forward pass of one
// contiguous layer range of a model over a batch that mixes prefill chunks
// and decodes of many sequences at different positions.
//
// The first stage embeds token ids; the last applies the final norm and
// the LM head and samples. Backends implement Stage: stage/cpu (pure Go
// float32, the reference) and stage/cuda. Every buffer a stage reads or
// writes across its boundary (Input, Output.Activations, the hand-off
// buffers) is persistent and owned by the stage, so a transport moves data
// into and out of it without allocating, and CUDA graphs can record their
// addresses. The leader owns the batch description, the block tables of the
// paged KV cache and every request's tokens; stages hold only caches.
//
// # Usage
//
//	st, err := cpu.New(cpu.Config{Model: cfg, Lo: 0, Hi: cfg.NumLayers, Weights: ckpt, MaxTokens: 256, MaxSeqs: 16})
//	out, err := st.Forward(ctx, &stage.Batch{ID: 1, Seqs: []stage.Seq{{ID: 7, Tokens: prompt, Blocks: blocks, Sample: true}}})
//
// # Concurrency
//
// A Stage is driven by one goroutine: Forward, Free, ApplyHandoff, and a
// Launcher's Launch and Finish are never called concurrently. Output and
// the buffers it points at are valid until the next Forward (or Finish).
// Backends may use goroutines or a device inside a call; they are joined
// (or synchronised) before it returns, but for the work a Launcher's
// Launch queues, which Finish waits for.
package stage
