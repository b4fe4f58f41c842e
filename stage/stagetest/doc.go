// Package stagetest is the conformance suite every stage backend (CPU, CUDA)
// runs from its tests, and the float64 reference model it checks them
// against. It is test support code: production code never imports it.
//
// Reference is a deliberately plain float64 transcription of the
// Llama-family forward pass (Llama, Mistral, Qwen2): no KV cache, no
// batching, no fused matrices, every position recomputed from the token ids.
// It shares no code with any backend, so agreement between the two is
// evidence that both follow the model. RandomWeights builds in-memory
// checkpoints whose signal stays well scaled through the layers (attention
// that is neither uniform nor one-hot, logits of order one), and Shapes lists
// the model shapes the suite covers: grouped-query ratios 1, 2, 4 and 7, tied
// and untied embeddings, llama3 rope scaling with all three frequency bands
// in use, Qwen2 q/k/v biases, F32, BF16 and F16 weights.
//
// # Usage
//
//	func TestConformance(t *testing.T) {
//		stagetest.Run(t, stagetest.Backend{
//			New: func(t *testing.T, s stagetest.Spec) stage.Stage {
//				st, err := mybackend.New(...s.Model, s.Weights, s.Lo, s.Hi...)
//				if err != nil { t.Fatal(err) }
//				t.Cleanup(func() { st.Close() })
//				return st
//			},
//			Tol:      1e-5,
//			SplitTol: 1e-6,
//		})
//	}
//
// Run checks, for every shape: logits against the reference at every
// position of several prompts prefilled whole and then decoded, and again
// with the prompts prefilled in chunks mixed with other sequences' decodes;
// chunked against whole prefill; a model split over 2, 3 and 4 stages
// against one stage (logits and greedy tokens); batch validation (every
// malformed batch is refused, names the sequence at fault and leaves the
// caches unchanged); Free; Info and Input; Forward after Close; sequences
// whose logits are NaN or infinite (a checkpoint with a NaN and an infinite
// embedding row) failing alone, in their stage.Sampled.Err, under greedy,
// tempered and nucleus sampling, while the rest of the batch gets the
// reference's tokens, hand-off rows stay valid and the stage goes on
// serving; and, for a
// backend with a paged KV cache (Backend.Paged), block-table validation,
// blocks scattered over the pool, a capacity of exactly the blocks in use
// and blocks reused after Free; and, for a backend with on-device hand-off
// (Backend.Handoff), that decodes fed stage.Placeholder, filled from the
// last stage's (slot, token) rows applied on the first, give bit for bit what
// the same batches with their tokens spelled out give, on one stage and on
// two (the first a step ahead of the second, as in a pipeline), and that bad
// slots, placeholders with no token and malformed hand-off rows are refused
// (a refused hand-off message recording none of its rows). It logs the
// largest relative error it measured for each comparison.
//
// Every batch the suite sends carries block tables from BlockTables, which
// hands out blocks in a scrambled order as a leader would; tests of a
// backend's own use it for the batches they build by hand.
//
// # Concurrency
//
// Run drives each stage from the test goroutine only. Reference and Weights
// are read-only after construction and safe for concurrent use.
package stagetest
