package stage

import (
	"context"
	"fmt"
	"math"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/model/safetensors"
)

// Weights gives a backend a checkpoint's tensors by their Hugging Face
// name; *model.Checkpoint satisfies it. Backends read them only while the
// stage is built.
type Weights interface {
	Tensor(name string) (*safetensors.Tensor, error)
}

// Stage runs the forward pass of one contiguous layer range [Lo, Hi) of a
// model. The first stage embeds token ids; the last applies the final norm
// and the LM head and samples.
type Stage interface {
	// Info describes the stage.
	Info() Info
	// Input is the persistent buffer the previous stage's activations for
	// the next Forward must be received into (nil on the first stage). It
	// holds up to Info().MaxTokens rows of Info().Hidden elements of
	// Info().ActDType.
	Input() collective.Buffer
	// Forward runs one batch. On a stage other than the first, the batch's
	// activations must already be in Input(). The returned Output (and the
	// buffer it points at) is valid until the next call of Forward.
	Forward(ctx context.Context, b *Batch) (*Output, error)
	// Free drops a sequence's KV cache.
	Free(seq uint64)
	// Close releases everything the stage holds.
	Close() error
}

// Info describes a stage.
type Info struct {
	Backend   string // "cpu" or "cuda"
	Lo, Hi    int    // layer range [Lo, Hi)
	First     bool   // embeds tokens
	Last      bool   // produces logits and samples
	Hidden    int
	Vocab     int
	MaxTokens int // most tokens one batch may carry
	MaxSeqs   int // most sequences one batch may carry
	// ActDType is the element type of activations this stage receives and
	// sends.
	ActDType collective.DType
	// KVBlocks is the stage's KV capacity in blocks of BlockSize positions,
	// addressed through Seq.Blocks; 0 for a stage without a paged cache,
	// which ignores Seq.Blocks. The leader's capacity is the least KVBlocks
	// of its stages, and every paged stage must use the leader's block size.
	KVBlocks, BlockSize int
	// Graphs is how much of the CUDA-graph machinery the stage can
	// capture; the zero value, graphs.Never, is a stage without graphs
	// (the CPU backend).
	Graphs graphs.Support
}

// Batch is one step's work: chunks of several sequences, each at its own
// position. Prefill chunks and single-token decodes mix freely.
type Batch struct {
	ID   uint64
	Seqs []Seq
	// Graph is the leader's dispatch decision for the step: the runtime
	// mode and the descriptor of the CUDA graph every stage replays. The
	// zero value runs the step eagerly (mode None), as does a None step
	// whose descriptor holds the batch's token count. A stage that cannot
	// replay the step it is told to must fail it, never run it eagerly.
	Graph graphs.Step
	// Handoff asks the last stage to fill Output.Handoff.
	Handoff bool
}

// NumTokens is the number of token rows in the batch.
func (b *Batch) NumTokens() int {
	n := 0
	for i := range b.Seqs {
		n += len(b.Seqs[i].Tokens)
	}
	return n
}

// Placeholder stands, in Seq.Tokens, for an input token the leader does not
// know yet: with on-device hand-off, the leader schedules a sequence's next
// decode before the previous step's sampled token has come back, and the
// first stage replaces the placeholder by the token the last stage sampled
// last for that sequence. Stages without on-device hand-off never see it.
const Placeholder int32 = -1

// Seq is one sequence's chunk in a batch. Stages only read it: its slices
// may alias the leader's state.
type Seq struct {
	ID uint64
	// Pos is the position of Tokens[0]: the number of tokens of this
	// sequence already in the KV cache.
	Pos int
	// Tokens are the chunk's token ids. Only the first stage reads the
	// values; every stage uses the length.
	Tokens []int32
	// Blocks is the sequence's block table: the ids of the KV blocks
	// covering positions [0, Pos+len(Tokens)); block i holds positions
	// [i·BlockSize, (i+1)·BlockSize). The leader owns the tables and the
	// block size (the same on every stage): a block id means the same
	// block on every stage, each stage storing its own layers' keys and
	// values in it. Stages without a paged cache ignore it.
	Blocks []int32
	// Sample asks the last stage to sample a token from the chunk's last
	// position (the final prefill chunk, or a decode).
	Sample   bool
	Sampling Sampling
	// Index is how many tokens this sequence has sampled before this one;
	// with Sampling.Seed it makes seeded sampling independent of batching.
	Index int
	// Logits asks the last stage to return the logits of every position of
	// the chunk (tests and verification; costly).
	Logits bool
	// Slot is the sequence's hand-off slot, in [0, Info.MaxSeqs): the
	// leader assigns it when the request starts running and keeps it until
	// the request finishes. With on-device hand-off the last stage reports
	// each sampled token under its slot, and the first stage fills a
	// Placeholder with the token last recorded for that slot.
	Slot int
}

// Sampling parameters of one request.
type Sampling struct {
	// Temperature 0 is greedy.
	Temperature float32
	TopK        int     // 0: off
	TopP        float32 // 0 or 1: off
	Seed        uint64
	// Logprobs is how many top alternatives to report with each sampled
	// token (0: only the sampled token's log-probability).
	Logprobs int
}

// HandoffReceiver is implemented by stages that can take sampled tokens back
// on the first stage (on-device hand-off). The last stage's Output.Handoff
// is received into HandoffInput, then ApplyHandoff records its rows; a
// later Forward fills each Placeholder from the recorded tokens.
type HandoffReceiver interface {
	// HandoffInput is the persistent buffer a hand-off message is received
	// into: up to Info().MaxSeqs rows of two I32 (slot, token).
	HandoffInput() collective.Buffer
	// ApplyHandoff records the first rows of HandoffInput.
	ApplyHandoff(ctx context.Context, rows int) error
}

// HandoffCols is the number of I32 columns of a hand-off row: slot, token.
const HandoffCols = 2

// MaxLogprobs is the most top alternatives a request may ask for with each
// sampled token (Sampling.Logprobs): every backend reports that many, and
// the request APIs refuse more.
const MaxLogprobs = 20

// Validate rejects sampling parameters no backend can honour; maxLogprobs
// is the most top alternatives the backend reports.
func (p *Sampling) Validate(maxLogprobs int) error {
	t := float64(p.Temperature)
	switch {
	case !(t >= 0) || math.IsInf(t, 1):
		return fmt.Errorf("temperature %v is not a finite number ≥ 0", p.Temperature)
	case p.TopK < 0:
		return fmt.Errorf("top-k %d is negative", p.TopK)
	case !(p.TopP >= 0 && p.TopP <= 1):
		return fmt.Errorf("top-p %v is outside [0,1]", p.TopP)
	case p.Logprobs < 0 || p.Logprobs > maxLogprobs:
		return fmt.Errorf("%d logprobs (top alternatives) asked for, outside [0,%d]", p.Logprobs, maxLogprobs)
	}
	return nil
}

// Output is what Forward produces.
type Output struct {
	// Activations for the next stage (every stage but the last), described
	// by Header.
	Header      collective.Header
	Activations collective.Buffer
	// Sampled tokens, one per Seq with Sample set, in batch order (last
	// stage only).
	Sampled []Sampled
	// Logits of every position of every Seq with Logits set, in batch
	// order: Logits[k] is one row of Vocab values (last stage only).
	Logits []SeqLogits
	// Handoff holds, on the last stage of a batch with Handoff set, one
	// (slot, token) row of I32 per sampled sequence, in batch order,
	// described by HandoffHeader (Rows = len(Sampled), Cols =
	// HandoffCols, DType = I32, Batch = the batch id). It lives where the
	// stage computes (device memory on CUDA), so it can go straight to the
	// first stage.
	HandoffHeader collective.Header
	Handoff       collective.Buffer
}

// Sampled is a token sampled for a sequence.
type Sampled struct {
	Seq     uint64
	Token   int32
	Logprob float32
	Top     []TokenLogprob // the Sampling.Logprobs most likely tokens
	// Err, when not empty, says why no token could be sampled for the
	// sequence (its logits row holds NaN or an infinity): Token is then 0
	// and meaningless, and the request fails while the rest of the batch
	// goes on. The message names the stage.
	Err string
}

// TokenLogprob is a token with its log-probability.
type TokenLogprob struct {
	Token   int32
	Logprob float32
}

// SeqLogits are the logits of one sequence's chunk, row by row.
type SeqLogits struct {
	Seq  uint64
	Rows [][]float32
}
