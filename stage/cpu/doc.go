// Package cpu is the pure-Go CPU backend of a pipeline stage: it runs the
// forward pass of layers [Lo, Hi) of a Llama-family model (Llama, Mistral,
// Qwen2) in float32 and, on the last stage, samples.
//
// The math follows Hugging Face transformers in float32: RMSNorm with the
// variance computed in float32, rotary embeddings in the "rotate_half" layout
// (dimension i pairs with i+head_dim/2) with optional llama3 frequency
// scaling, grouped-query causal attention scaled by 1/sqrt(head_dim), a
// SwiGLU MLP and, for Qwen2, q/k/v biases. Two choices differ from a literal
// float32 transcription, both towards the exact result: rotary angles
// (position × inverse frequency) and their cosines and sines are computed in
// float64 and then rounded to float32 (float32 angles lose whole digits at
// long positions), and softmax exponentials are evaluated in float64.
//
// Weights are converted to float32 once, in New; only the tensors of the
// stage's layers are loaded, plus the token embedding on the first stage and
// the final norm and LM head on the last (the embedding again when the model
// ties them). Every buffer a Forward needs whose size depends on the model or
// on MaxTokens is allocated in New, except the rows of logits asked for with
// Seq.Logits beyond MaxSeqs of them.
//
// The KV cache is paged and allocated in New: one key and one value pool per
// layer, of NumBlocks blocks of BlockSize positions (Info reports both). The
// leader owns the blocks: each Seq carries its block table, and position p of
// a sequence is row Blocks[p/BlockSize]·BlockSize + p%BlockSize of the pools;
// attention gathers the sequence's keys and values through the table. The
// stage keeps of each sequence only its cached length, so that a chunk must
// start where the sequence's cache ends; Free forgets it. A table too short
// for the chunk, or a block id outside [0, NumBlocks), fails the batch.
//
// The stage implements stage.HandoffReceiver for on-device hand-off, in host
// memory. With Batch.Handoff the last stage's Output.Handoff holds one
// (slot, token) int32 row per sampled sequence, in batch order. The first
// stage's HandoffInput takes such rows and ApplyHandoff records each token
// under its slot (rows naming a slot outside [0, MaxSeqs), a token outside
// the vocabulary or one slot twice are refused whole); a Forward then reads
// each stage.Placeholder in Seq.Tokens as the token last recorded for the
// sequence's Seq.Slot. A slot's token stays until a later row overwrites
// it; a placeholder for a slot that never had one fails the batch. Every
// Seq.Slot must lie in [0, MaxSeqs), and the sampled sequences of a batch
// with Handoff must have distinct slots. On a stage that is both first and
// last, Output.Handoff is HandoffInput itself: ApplyHandoff(ctx,
// HandoffHeader.Rows) applies it with no copy.
//
// Sampling (last stage) works on the float32 logits of a sequence's last
// position. Log-probabilities are a float64 log-softmax of the raw logits.
// Temperature 0 is greedy (ties go to the lowest token id). Otherwise the
// logits are divided by the temperature, filtered by top-k and then by top-p
// (the smallest set of most likely tokens whose probability reaches p, at
// least one token; ties are ordered by token id) and one token is drawn with a
// PCG generator seeded from Sampling.Seed and Seq.Index only, so a seed gives
// the same tokens however requests are batched. The reported Logprob of the
// chosen token and the Top alternatives are log-probabilities of the raw,
// untempered and unfiltered distribution (at least the lowest finite
// float32). A row holding NaN or an infinity is not sampled: the
// sequence's Sampled.Err says so, naming the stage and the sequence, its
// hand-off row carries token 0, and the rest of the batch is unaffected.
//
// # Usage
//
//	st, err := cpu.New(cpu.Config{
//		Model: cfg, Lo: 0, Hi: cfg.NumLayers, Weights: checkpoint,
//		MaxTokens: 512, MaxSeqs: 16, NumBlocks: 4096, BlockSize: 16,
//	})
//	if err != nil { ... }
//	defer st.Close()
//	// A 40-token prompt in blocks 12, 3 and 7 (positions 0-15, 16-31, 32-47).
//	out, err := st.Forward(ctx, &stage.Batch{ID: 1, Seqs: []stage.Seq{{
//		ID: 7, Pos: 0, Tokens: prompt, Blocks: []int32{12, 3, 7}, Sample: true,
//	}}})
//
// A stage other than the first reads its activations from Input(), which the
// previous stage's Output().Activations bytes are copied or received into.
// Activations are float32 rows of Hidden elements in host (little-endian)
// byte order.
//
// # Concurrency
//
// A Stage is driven by one goroutine: none of its methods (ApplyHandoff
// included) may be called concurrently with another, and the Output of a
// Forward (with the buffers it points at) is valid only until the next
// Forward. Internally Forward spreads
// matrix products over output rows and attention over (sequence, head) pairs
// across Config.Threads goroutines that it starts and joins before returning;
// nothing runs in the background between calls.
package cpu
