package sched

import (
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/tandem-llm/tandem/stage"
)

// DefaultBlockSize is the number of positions of a KV block when
// Config.BlockSize is 0: the backends' default (stage.DefaultBlockSize).
const DefaultBlockSize = stage.DefaultBlockSize

// Config bounds what the scheduler puts in flight.
type Config struct {
	// MaxNumBatchedTokens is the token budget of one step: prompts longer
	// than what is left of it are prefilled in chunks over several steps.
	// It must not exceed what any stage accepts in one batch.
	MaxNumBatchedTokens int
	// MaxNumSeqs is the most sequences one step carries.
	MaxNumSeqs int
	// BlockSize is the number of positions one KV block holds (0:
	// DefaultBlockSize).
	BlockSize int
	// NumBlocks is the KV capacity in blocks: the least any stage reported.
	NumBlocks int
	// MaxConcurrentBatches is the most steps in flight at once (0: 1): the
	// number of stages for a pipeline, 2 for a single stage overlapping
	// scheduling with compute, one more than the stages with on-device
	// hand-off.
	MaxConcurrentBatches int
	// MaxModelLen bounds a request's prompt plus the tokens it may generate
	// (0: only the KV capacity bounds it).
	MaxModelLen int
	// MaxNumWaiting bounds the requests waiting for admission (preempted
	// ones included): Add refuses more with ErrQueueFull (0:
	// DefaultMaxNumWaiting; -1: no bound). It bounds the leader's memory
	// and the time a request can wait under overload.
	MaxNumWaiting int
	// GrowthReserve is the least growth, in positions, admission leaves
	// room for in every running request besides its expected length (see
	// the package doc; 0: BlockSize, one block; -1: no projection at all,
	// admit whatever fits now). A preempted request is admitted again only
	// when every running request, itself included, can grow to its last
	// position.
	GrowthReserve int
	// MaxPreemptions is how often one request may be preempted while
	// another running request can be preempted in its place (0:
	// DefaultMaxPreemptions); past it a request is preempted only when
	// every other candidate has reached it too.
	MaxPreemptions int
	// OnDeviceHandoff lets a sequence's next decode be scheduled before its
	// previous token is known, with stage.Placeholder as its input, which
	// the first stage fills on the device from the hand-off of the step
	// that sampled it (Seq.Slot, Batch.Handoff, Step.AwaitHandoff; see the
	// package doc). Without it the steps in flight hold disjoint
	// sequences.
	OnDeviceHandoff bool
	// HandoffSlots is the number of hand-off slots the first stage holds
	// (0: MaxNumSeqs): with OnDeviceHandoff at most that many requests run
	// at once, each holding one. With p groups taking turns (p+1 steps in
	// flight), p·MaxNumSeqs slots let every step carry MaxNumSeqs.
	HandoffSlots int
	// Counters, when set, also count what Stats counts for the life of
	// the process: the caller passes the same Counters to every scheduler
	// it starts, so its metrics stay monotonic across pipelines.
	Counters *Counters
}

// Counters are counts that outlive a scheduler (Config.Counters): what
// Stats counts of the same name, summed over every scheduler given these
// Counters. They are safe for concurrent use.
type Counters struct {
	preemptions, failed, refused, discarded, steps atomic.Uint64
	reprefilled, reprefilledTokens                 atomic.Uint64
}

// Reprefilled is the number of running requests Replace sent back to
// prefill again on a new pipeline; ReprefilledTokens the positions they
// had in the old pipeline's KV cache, which they compute again.
func (c *Counters) Reprefilled() uint64 { return c.reprefilled.Load() }

// ReprefilledTokens: see Reprefilled.
func (c *Counters) ReprefilledTokens() uint64 { return c.reprefilledTokens.Load() }

// Preemptions is the number of requests sent back to waiting for lack of
// KV blocks.
func (c *Counters) Preemptions() uint64 { return c.preemptions.Load() }

// Failed is the number of requests that ended in an error: no pipeline
// served them in time (Fail), or a stage could not serve them
// (ErrRequestFailed).
func (c *Counters) Failed() uint64 { return c.failed.Load() }

// Refused is the number of requests turned away because MaxNumWaiting
// requests waited (ErrQueueFull).
func (c *Counters) Refused() uint64 { return c.refused.Load() }

// Discarded is the number of sampled tokens dropped on their return
// because their request was preempted, cancelled or had finished.
func (c *Counters) Discarded() uint64 { return c.discarded.Load() }

// Steps is the number of steps completed.
func (c *Counters) Steps() uint64 { return c.steps.Load() }

// DefaultMaxNumWaiting is the bound on waiting requests when
// Config.MaxNumWaiting is 0.
const DefaultMaxNumWaiting = 1024

// DefaultMaxPreemptions is Config.MaxPreemptions when it is 0.
const DefaultMaxPreemptions = 1

// ErrQueueFull is the error of a request refused because MaxNumWaiting
// requests already wait: the caller should retry later (gRPC
// RESOURCE_EXHAUSTED, HTTP 429).
var ErrQueueFull = errors.New("too many requests waiting")

// ErrRequestFailed is wrapped by the error that ends a request a stage
// could not serve while the pipeline went on (a sampled row of non-finite
// logits, stage.Sampled.Err): an internal error for that request alone
// (gRPC INTERNAL, HTTP 500).
var ErrRequestFailed = errors.New("request failed on a stage")

// withDefaults checks c and fills its defaults.
func (c Config) withDefaults() (Config, error) {
	if c.BlockSize == 0 {
		c.BlockSize = DefaultBlockSize
	}
	if c.MaxNumWaiting == 0 {
		c.MaxNumWaiting = DefaultMaxNumWaiting
	}
	if c.GrowthReserve == 0 {
		c.GrowthReserve = c.BlockSize
	}
	if c.MaxPreemptions == 0 {
		c.MaxPreemptions = DefaultMaxPreemptions
	}
	if c.MaxConcurrentBatches == 0 {
		c.MaxConcurrentBatches = 1
	}
	if c.Counters == nil {
		c.Counters = &Counters{} // this scheduler's alone
	}
	if c.HandoffSlots == 0 {
		c.HandoffSlots = c.MaxNumSeqs
	}
	switch {
	case c.MaxNumBatchedTokens <= 0:
		return c, fmt.Errorf("max num batched tokens %d is not positive", c.MaxNumBatchedTokens)
	case c.MaxNumSeqs <= 0:
		return c, fmt.Errorf("max num seqs %d is not positive", c.MaxNumSeqs)
	case c.BlockSize < 0:
		return c, fmt.Errorf("block size %d is negative", c.BlockSize)
	case c.NumBlocks <= 0:
		return c, fmt.Errorf("KV capacity of %d blocks is not positive", c.NumBlocks)
	case c.NumBlocks > 1<<31-1:
		return c, fmt.Errorf("KV capacity of %d blocks does not fit block ids of 32 bits", c.NumBlocks)
	case c.MaxConcurrentBatches < 0:
		return c, fmt.Errorf("max concurrent batches %d is negative", c.MaxConcurrentBatches)
	case c.MaxModelLen < 0:
		return c, fmt.Errorf("max model len %d is negative", c.MaxModelLen)
	case c.HandoffSlots < 0:
		return c, fmt.Errorf("hand-off slots %d is negative", c.HandoffSlots)
	}
	return c, c.CheckAdmission()
}

// CheckAdmission checks the admission settings alone (MaxNumWaiting,
// GrowthReserve, MaxPreemptions), so that a caller can refuse them before
// it has a pipeline to configure; the scheduler checks them too.
func (c Config) CheckAdmission() error {
	switch {
	case c.MaxNumWaiting < -1:
		return fmt.Errorf("max num waiting %d is below -1 (no bound)", c.MaxNumWaiting)
	case c.GrowthReserve < -1:
		return fmt.Errorf("growth reserve %d is below -1 (none)", c.GrowthReserve)
	case c.MaxPreemptions < 0:
		return fmt.Errorf("max preemptions %d is negative", c.MaxPreemptions)
	}
	return nil
}

// Request is one prompt to complete.
type Request struct {
	// ID names the request; it is also its sequence id on the stages. Loop
	// assigns it.
	ID        uint64
	Prompt    []int32
	MaxTokens int
	// StopTokens end the completion when sampled (the model's EOS ids,
	// usually); the stop token is delivered, with finish "stop". Stop
	// strings are the caller's: it detokenises the stream and cancels the
	// request when one appears.
	StopTokens []int32
	Sampling   stage.Sampling
}

// Finish reasons of an Output.
const (
	FinishStop   = "stop"   // a stop token
	FinishLength = "length" // MaxTokens reached
)

// Output is one generated token of a request, delivered once and in order.
type Output struct {
	ID uint64
	// Index is the token's place among the request's generated tokens,
	// from 0.
	Index int
	Token stage.Sampled
	// Finish is set on the request's last token: FinishStop or
	// FinishLength.
	Finish string
	// Time is when the token's step came back to the scheduler.
	Time time.Time
	// Scheduled is set on the request's first token (Index 0): when the
	// scheduler first put the request in a step, which ends its time in
	// the queue.
	Scheduled time.Time
	// Err, when set, ends the request without a token: a stage could not
	// serve it (it wraps ErrRequestFailed and names the stage).
	Err error
}

// Stats is a snapshot of the scheduler, for status reports.
type Stats struct {
	Running  int // requests admitted, holding KV blocks
	Waiting  int // requests not admitted yet, or preempted
	InFlight int // steps in the pipeline
	// KVBlocksUsed of KVBlocks are held by running requests; a block holds
	// BlockSize positions.
	KVBlocksUsed, KVBlocks, BlockSize int
	Preemptions                       uint64 // requests sent back to waiting for lack of KV blocks
	// Discarded counts sampled tokens dropped on their return because
	// their request was preempted, cancelled or had finished meanwhile.
	Discarded uint64
	Finished  uint64 // requests that ended with a finish reason
	Cancelled uint64
	// Failed counts requests that ended in an error: by Fail (no pipeline
	// served them in time), or because a stage could not serve them
	// (ErrRequestFailed). Reprefilled counts the running requests Replace
	// sent back to prefill again on a new pipeline, ReprefilledTokens the
	// positions they had in the old pipeline's KV cache, which they
	// compute again; Refused those Add turned away because the queue was
	// full.
	Failed, Reprefilled, ReprefilledTokens, Refused uint64
	Steps                                           uint64 // steps completed (results received)
	// LastStepTime is the time from scheduling the last completed step to
	// its result; StepTime is a moving average of it.
	LastStepTime, StepTime time.Duration
}

// check validates a request against the configuration.
func (c *Config) check(r *Request) error {
	switch {
	case len(r.Prompt) == 0:
		return errors.New("empty prompt")
	case r.MaxTokens < 1:
		return fmt.Errorf("max tokens %d, want at least 1", r.MaxTokens)
	case c.MaxModelLen > 0 && len(r.Prompt)+r.MaxTokens > c.MaxModelLen:
		return fmt.Errorf("%w: prompt of %d tokens plus %d to generate exceeds the model length %d", ErrTooLarge, len(r.Prompt), r.MaxTokens, c.MaxModelLen)
	}
	for i, t := range r.Prompt {
		if t < 0 {
			return fmt.Errorf("prompt token %d at position %d is negative", t, i)
		}
	}
	// The last sampled token is never fed back, so it needs no KV.
	if need := blocksFor(len(r.Prompt)+r.MaxTokens-1, c.BlockSize); need > c.NumBlocks {
		return fmt.Errorf("%w: prompt of %d tokens plus %d to generate needs %d KV blocks of %d positions; the KV capacity is %d blocks (%d positions)", ErrTooLarge, len(r.Prompt), r.MaxTokens, need, c.BlockSize, c.NumBlocks, c.NumBlocks*c.BlockSize)
	}
	return nil
}

// blocksFor is the number of blocks of size bs covering n positions.
func blocksFor(n, bs int) int { return (n + bs - 1) / bs }
