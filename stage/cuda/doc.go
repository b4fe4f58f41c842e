// Package cuda is the CUDA backend of a pipeline stage: it runs the forward
// pass of layers [Lo, Hi) of a Llama-family model (Llama, Mistral, Qwen2) on
// one GPU with bf16 weights, compensated bf16 GEMM inputs (in steps of up
// to 16 rows), fp32 accumulation,
// an fp32 residual stream, and on the last stage samples on the device; it
// captures and replays CUDA graphs of its steps.
//
// # Kernels
//
// The kernels are CUDA C sources embedded from kernels/*.cu and compiled
// with NVRTC in New for the device's compute capability (sm_XY). Compiled
// images are cached on disk under Config.CacheDir, else
// model.CacheDir("kernels") ($TANDEM_CACHE_DIR/kernels, systemd's
// $CACHE_DIRECTORY/kernels, the user cache directory's tandem/kernels),
// one file per SHA-256 of (source, architecture, NVRTC
// version, options), written atomically (temporary file and rename) and
// checksummed: an unreadable, damaged or unloadable entry is compiled
// afresh and replaced. The sources need no CUDA headers (bf16 is handled as
// raw 16-bit patterns); scripts/kernel-syntax.sh runs them through clang's
// CUDA front end where no GPU or toolkit is at hand.
//
// A step takes one of three paths by its token count T (skinnyPlan):
//
//   - T <= 2 (decode of one or two sequences): the fp32 multiply-add
//     products of gemvf.cu, each warp streaming 512 contiguous bytes of a
//     weight row per load with the activations staged in shared memory in
//     fp32;
//   - T <= 8: the tensor-core products of gemv.cu (mma.sync with the
//     weights as the A operand, the token columns split into bf16 value
//     and remainder);
//   - 8 < T <= Config.SkinnyTokens: the tensor-core products of gemvt.cu,
//     same units, row mapping and epilogues, for many token columns: a
//     block of 4 warps (a unit each) stages the activations once per
//     64-wide chunk of k, split into bf16 value and remainder, in shared
//     memory, streams the weights through shared memory with cp.async
//     four chunks deep, and splits k over blocks when the units are few
//     (the last block of a row block adds the splits' partials in a fixed
//     order and runs the epilogue);
//   - longer steps: cuBLAS (bf16 inputs, fp32 accumulation and output).
//
// gemvt.cu is the optional part of the program: where NVRTC cannot
// compile it (or TANDEM_CUDA_OPTIONAL=off), the stage says so and steps of
// more than 8 tokens run on cuBLAS. With Config.SkinnyTokens 0, New times
// a pass of 2 padding rows on the fp32 kernels and on cuBLAS (its small
// products on gemvs) and gives 2-row steps to cuBLAS if it was faster and
// agreed; if not, a pass of 4, 8 (and with gemvt.cu 16 and 32) rows on the
// skinny kernels and on cuBLAS (Stage.Skinny), keeping the skinny kernels
// up to the largest size at which they were faster and agreed with
// cuBLAS. Steps of one row always run on the fp32 kernels.
//
// On the two skinny paths a layer is four product kernels and attention:
// the q|k|v product with the input RMSNorm folded into it (the norm's sum
// of squares gathered from the same loads, its weight applied to the
// activations, the scale applied to the sums) and, in its epilogue, the
// Qwen2 bias, rotary embeddings (rotate_half layout, fp32 angles
// pos·inv_freq with llama3 scaling precomputed on the host) and the KV
// cache write; attention; the o projection adding into the residual
// stream; the gate|up product with the post-attention norm folded in and
// SiLU·mul in its epilogue; the down projection adding into the residual
// stream. The last stage's LM head folds the final norm in, selects its
// rows through the batch description, writes fp32 logits and per-block
// softmax partials (maximum, arg-max, sum of exponentials), from which the
// sampler takes the greedy token and the log partition function without a
// pass over the logits (unless a partial saw a non-finite logit). Every
// kernel may start as a programmatic dependent launch of the one before
// it (griddepcontrol; Config.NoDependentLaunch turns that off): a skinny
// product loads its first weights before waiting for its predecessor.
//
// On the cuBLAS path q|k|v and gate|up weights are fused so each is one
// GEMM. Per layer: RMSNorm of the residual stream (fp32 statistics, adding
// the previous layer's pending down projection first) into bf16; the
// q|k|v GEMM; one kernel that adds the bias, applies rotary embeddings and
// writes q (fp32) and the KV cache (bf16); attention; the o GEMM; RMSNorm,
// adding the o projection into the residual stream first; the gate|up
// GEMM; SiLU-and-multiply into bf16; the down GEMM, added into the residual
// stream by the next norm or, at the stage's end, by residual_add. A norm
// block has a thread for every 4 elements of a row (at most 1,024: one
// round of 16-byte loads up to 4,096), keeps them in registers for its
// second pass and stores whole lines. The last stage's LM head is a norm of its rows and a GEMM,
// then logit_stats writes the softmax partials the skinny LM head would
// (blocks of 8,192 logits, one partial a warp), so the sampler again makes
// no pass over the logits of a greedy row; steps of up to 32 logits rows
// take the GEMM and the partials in one dependent launch instead
// (gemvh.cu). cuBLAS's products cannot start
// before the kernel ahead of them ends, and at a few tokens they are bound
// by that latency, not by their weights; so decode steps of 2-32 tokens
// (2 where New found the cuBLAS path faster than the fp32 kernels there)
// run their q|k|v, o and down products (the 1B shape's; the 8B shape's
// q|k|v and o up to 16 tokens) on gemvs.cu instead: dependent launches
// that start loading their weights before the wait (mma.sync, the weights
// as A through a per-warp ring of shared-memory stages filled by cp.async
// ahead of the multiplies), split k into 4 or 8 parts and leave each
// part's sums in a plane of their output, which the consumer (attention
// with rotary embeddings, the norms, residual_add) adds up as it reads
// them (gemvs.go: which steps, and why). Steps of up to 32 staged rows (16
// compensated tokens, 32 plain ones) run their gate|up product on
// gemvg.cu, SiLU·mul in its epilogue and so no silu_mul kernel: a block
// holds a multiprocessor, stages all of its rows by cp.async, and each
// warp takes 8 features as one mma tile of their gate and up rows through
// its weight ring (gemvg.go: which steps, and why).
//
// Attention (every path) is causal grouped-query attention over the paged
// KV cache, one block per (token, kv head, group of its query heads, part
// of the sequence): the sequence is cut into up to 16 parts (flash-
// decoding; attnPlan sizes blocks and parts by the step's token count), so
// that a decode step's few tokens keep the device busy and many tokens do
// not pay for many short parts; the last block of a (token, head group) to
// finish merges the parts in a fixed order. Where the tensor cores and the
// head dim allow (64 or 128, at most 8 query heads a kv head),
// attention_gqa.cu serves these rows: the query heads of a kv head are the
// mma's rows, the keys go through shared memory in tiles (cp.async, two
// stages, both filled at once, so a short sequence is one part read in one
// round), q and the probabilities are bf16 value and remainder pairs, the
// softmax fp32;
// elsewhere attention.cu's per-row kernel, fp32 throughout. The whole
// 64-row tiles of a prefill chunk (consecutive positions of one sequence)
// go to attention_prefill.cu, a flash-attention kernel on the tensor cores
// (64 rows of one query head a block, its blocks of 64 keys through shared
// memory by cp.async, two stages, the same pairs); the other kernel leaves
// them. Keys written by earlier steps are read before waiting for the
// q|k|v kernel (attention_gqa's; the prefill kernel reads all its keys
// after the wait).
//
// The GEMM inputs are compensated: each bf16 input holds a value's bf16
// rounding and the bf16 rounding of the remainder (on the cuBLAS path T
// rows further: one GEMM of 2T rows against the same weights, read once;
// on the tensor-core skinny path two products into one accumulator), so
// x·Wᵀ is computed as if x had about 16 significant bits; the fp32 skinny
// path multiplies the fp32 activations themselves. Steps of more than
// Config.CompensatedTokens rows (16: decode of more sequences, where the
// doubled rows cost 4-5% of the step, and prefills, where the GEMMs are
// bound by the tensor cores) take the rounded values alone, as
// transformers' bf16 model does. What is still rounded to bf16: the KV
// cache, and on the cuBLAS path the LM head's input. Against
// transformers' float32 forward on the same bf16 weights the logits of
// compensated steps stray about a quarter as far as transformers' own
// bf16 forward, those of the others about half as far
// (scripts/gpu-check.sh measures both; NOTES.md).
//
// ProfileStep runs a step eagerly with CUDA events around every kernel and
// returns each kind's device time (the breakdowns of NOTES.md).
//
// # Memory
//
// New uploads the stage's weights (its layers, plus the embedding on the
// first stage and the final norm and LM head on the last; the embedding
// again when tied) converted to bf16 into one allocation, and allocates
// every buffer a Forward uses once, zeroed: activations for MaxTokens rows
// (the layer GEMMs' inputs and outputs for twice that), fp32 logits for
// MaxLogitRows rows, the packed batch description, the hand-off buffers, a
// cuBLAS workspace, pinned host buffers for results, and the KV cache,
// after holding back Config.GraphMemory for CUDA graphs. Forward allocates
// no device memory. One function lays the workspace out (workspace.go);
// WorkspaceBytes gives placement its size before any stage exists.
//
// The KV cache is paged: per layer, NumBlocks·BlockSize rows plus one
// scratch row of [kv heads][head dim] bf16, for K and again for V (Info
// and Memory report the blocks and the block size). With Config.NumBlocks
// 0 it takes every block the device memory still free after the weights,
// the workspace and the graph memory holds, less Config.KVMargin. The
// leader owns the blocks: each Seq carries its block table, and position p
// of a sequence is row Blocks[p/BlockSize]·BlockSize + p%BlockSize. The
// host computes the row each token writes into the batch description, and
// copies each sequence's table there too (the description's tables have
// room for MaxSeqs sequences of Config.MaxSeqLen positions; a step uploads
// only the part in use), with each token's offset of its table: attention
// reads its keys and values through it. The stage keeps of each sequence
// only its cached length, so that a chunk must start where the sequence's
// cache ends; Free forgets it. A table too short for the chunk, or a block
// id outside [0, NumBlocks), fails the batch. Memory reports the weight,
// workspace, KV and graph bytes.
//
// # CUDA graphs
//
// Info reports graphs.Always: the kernels take every per-token fact (token,
// position, cache rows, block tables, logits rows, sampling parameters,
// hand-off slots) from the batch description at a fixed device address,
// and the hand-off buffers are persistent too, so one graph serves any
// batch of its token count. Capture, given the leader dispatcher's keys, runs an
// eager warm-up of each key's shape and captures it, largest first, on the
// stage's own stream, into two wrappers bound to a runtime mode each:
// FULL, one graph of the whole step, attention included; PIECEWISE, one
// graph per dense segment (the input, each stretch between two attention
// calls, the head), attention running eagerly between them. It then runs
// cuBLAS's products at every multiple of 64 rows past the largest key (the
// LM head at every multiple of 8 logits rows), and afterwards an eager
// step's products are padded to the smallest shape warmed: cuBLAS's first
// product of a shape costs milliseconds of host time. NCCL is not
// captured: a stage's neighbour may be a CPU or TCP stage, and the
// transport moves activations into Input before Forward. Forward obeys
// Batch.Graph: for a Full or Piecewise step it pads the batch description
// to the key's shape (padding tokens read token 0 at position 0 and write
// and attend to the scratch KV row; padding logits rows and samples are
// computed and ignored) and replays; a step whose key was not captured
// fails, never running eagerly; the zero Step (or None) runs eagerly. Padding
// rows reach the scratch row through word 0 of the block tables, the
// scratch block.
// With Config.GraphDebug every replay checks that the buffers baked into
// the graph are still where they were at capture. Capture measures the
// device memory the graphs take (cuMemGetInfo, per key and in total;
// Graphs reports it) and fails when it exceeds Config.GraphMemory, held
// back before the KV cache was allocated; after Capture nothing allocates,
// so device memory in use stays constant.
//
// # Hand-off
//
// The stage implements stage.HandoffReceiver for on-device hand-off, with
// the sampled tokens staying on the device. The last stage's sampler
// writes one (slot, token) int32 row per sampled sequence into a device
// buffer, which Output.Handoff points at when Batch.Handoff is set. The
// first stage's HandoffInput is a device buffer of MaxSeqs such rows;
// ApplyHandoff scatters them with one kernel into a device table of the
// token last recorded for each slot (rows naming a slot outside [0,
// MaxSeqs), a token outside the vocabulary or one slot twice are refused
// whole), and waits for it. A placeholder in Seq.Tokens travels in the
// batch description as -1 - Seq.Slot, and the embedding kernel reads the
// slot's token from the table, inside a replayed graph too. A placeholder
// for a slot that has no token is found on the device: the step fails,
// naming the sequence, and nothing is committed. Every Seq.Slot must lie
// in [0, MaxSeqs), and the sampled sequences of a batch with Handoff must
// have distinct slots. On a stage that is both first and last,
// Output.Handoff is HandoffInput itself: ApplyHandoff(ctx,
// HandoffHeader.Rows) applies it with no copy; and a batch with Handoff
// that Launch runs has its sampler record each token in the table too (its
// slots validated with the batch), so that no kernel runs after the step.
//
// # Sampling
//
// Log-probabilities are the log-softmax of the raw fp32 logits (temperature
// and filters do not apply to them); Top lists the Sampling.Logprobs (at
// most MaxLogprobs) most likely tokens, descending, ties by id. Temperature
// 0 (or top-k 1) is greedy, ties to the lowest id. Otherwise logits are
// divided by the temperature, top-k keeps the tokens whose logit reaches the
// k-th largest (all tokens tied at the boundary are kept), top-p then keeps
// the fewest most likely tokens whose renormalised probability reaches p,
// and the token is drawn with the Gumbel-max trick, its noise a hash of
// (Sampling.Seed, Seq.Index, token id): the same seed and index give the
// same token whatever the batch. The CPU backend draws differently, so the
// two agree on distributions, not on individual seeded draws. A row holding
// NaN or an infinity is not sampled: the kernel reports token -1 with the
// count of such values (and hands off token 0), and the sequence's
// Sampled.Err says so; the rest of the batch is unaffected.
//
// # Usage
//
//	st, err := cuda.New(cuda.Config{
//		Model: cfg, Lo: 0, Hi: cfg.NumLayers, Weights: checkpoint,
//		MaxTokens: 512, MaxSeqs: 32, // NumBlocks 0: the free memory
//	})
//	if errors.Is(err, gpu.ErrNoDriver) { /* use the CPU backend */ }
//	defer st.Close()
//	// optional: graphs for the keys of the leader's graphs.Dispatcher
//	if err := st.Capture(dispatcher.Keys()); err != nil { ... }
//	batch.Graph = graphs.Step{Mode: mode, Desc: desc} // from Dispatch
//	// every Seq carries its block table (Info().KVBlocks, BlockSize)
//	out, err := st.Forward(ctx, batch)
//
// Activations between stages are the fp32 residual stream (ActDType F32),
// Hidden values per token: a model split over several stages computes
// exactly what it computes on one, and CPU stages (also fp32) can sit next
// to CUDA ones. A stage other than the first receives them into Input(), a
// gpu.Mem (device memory with a Ptr for NCCL); Output.Activations is
// likewise a gpu.Mem.
// Forward waits for its work before returning, so its output may be read or
// sent at once.
//
// # Concurrency
//
// A Stage is driven by one goroutine: none of its methods (ApplyHandoff
// included) may be called concurrently with another, and an Output is
// valid only until the next Forward or Finish. Device work runs inside
// Device.Do on the gpu.Device's own goroutine, ordered on the stage's
// stream; several stages may share one Device (Config.Device), each with
// its own stream. Capture holds the device goroutine for its whole run, so
// no other stage's work can slip into a graph being captured. Launch
// (stage.Launcher) orders a step's work and returns: a goroutine of the
// stage, started by the first Launch and ended by Close, waits for each
// launched step on a thread of its own with the device's context current
// (Device.LockThread), so that the device goroutine can launch the next
// step meanwhile. Each of the stage.LaunchDepth steps that can be on their
// way has its own pinned batch description and sampled-token buffers;
// steps asking for logits run alone.
package cuda
