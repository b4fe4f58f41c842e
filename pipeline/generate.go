package pipeline

import (
	"cmp"
	"context"
	"fmt"
	"slices"

	"github.com/tandem-llm/tandem/stage"
)

// Request is one prompt to complete.
type Request struct {
	ID        uint64
	Prompt    []int32
	MaxTokens int
	// StopTokens end the completion when sampled (the model's EOS ids,
	// usually); the stop token is reported but counts as the end.
	StopTokens []int32
	Sampling   stage.Sampling
}

// Event is one generated token of one request.
type Event struct {
	Request uint64
	Token   stage.Sampled
	// Finish is set on a request's last token: "stop" (a stop token) or
	// "length" (MaxTokens reached).
	Finish string
}

// GenerateOptions bound each step.
type GenerateOptions struct {
	// MaxBatchTokens is the most tokens one step carries; longer prompts
	// are prefilled in chunks over several steps. 0 means no limit.
	MaxBatchTokens int
	// MaxContext is the model's context length: a request whose prompt
	// plus MaxTokens exceeds it is refused before anything runs.
	MaxContext int
	// BlockSize is the stages' KV block size (0: 16). Generate gives each
	// request its own blocks, lowest free ids first, and frees them when it
	// finishes; the stages' capacity must cover the requests together.
	BlockSize int
}

// Generate completes every request through d, one step at a time, calling
// emit for each generated token in order. Prompts are prefilled in chunks of
// at most MaxBatchTokens per step, and decodes of running requests share
// steps with other requests' prefill chunks. It is the plain driving loop
// of a pipeline; the scheduler replaces it with continuous batching.
func Generate(ctx context.Context, d *Driver, reqs []Request, o GenerateOptions, emit func(Event) error) error {
	type seq struct {
		req      *Request
		tokens   []int32 // prompt then generated
		cached   int     // tokens already in the KV cache
		blocks   []int32 // block table
		produced int
		done     bool
	}
	seqs := make([]*seq, len(reqs))
	byReq := make(map[uint64]*seq, len(reqs))
	for i := range reqs {
		r := &reqs[i]
		switch {
		case len(r.Prompt) == 0:
			return fmt.Errorf("request %d: empty prompt", r.ID)
		case r.MaxTokens < 1:
			return fmt.Errorf("request %d: max tokens %d, want at least 1", r.ID, r.MaxTokens)
		case o.MaxContext > 0 && len(r.Prompt)+r.MaxTokens > o.MaxContext:
			return fmt.Errorf("request %d: prompt of %d tokens plus %d to generate exceeds the context length %d", r.ID, len(r.Prompt), r.MaxTokens, o.MaxContext)
		case byReq[r.ID] != nil:
			return fmt.Errorf("request %d: duplicate id", r.ID)
		}
		seqs[i] = &seq{req: r, tokens: slices.Clone(r.Prompt)}
		byReq[r.ID] = seqs[i]
	}
	bs := o.BlockSize
	if bs <= 0 {
		bs = 16
	}
	var blocks blockIDs
	// chunk is s's chunk of n tokens, its block table extended to cover it.
	chunk := func(s *seq, n int, sample bool) stage.Seq {
		end := s.cached + n
		for len(s.blocks)*bs < end {
			s.blocks = append(s.blocks, blocks.get())
		}
		nb := (end + bs - 1) / bs
		return stage.Seq{ID: s.req.ID, Pos: s.cached, Tokens: s.tokens[s.cached:end], Blocks: s.blocks[:nb:nb], Sample: sample, Sampling: s.req.Sampling, Index: s.produced}
	}
	var free []uint64
	for batchID := uint64(1); ; batchID++ {
		b := stage.Batch{ID: batchID}
		budget := o.MaxBatchTokens
		if budget <= 0 {
			budget = int(^uint(0) >> 1)
		}
		// Decodes first, so prefills never starve them.
		for _, s := range seqs {
			if s.done || s.cached < len(s.req.Prompt) || budget == 0 {
				continue
			}
			b.Seqs = append(b.Seqs, chunk(s, len(s.tokens)-s.cached, true))
			budget--
		}
		for _, s := range seqs {
			if s.done || s.cached >= len(s.req.Prompt) || budget == 0 {
				continue
			}
			n := min(len(s.req.Prompt)-s.cached, budget)
			b.Seqs = append(b.Seqs, chunk(s, n, s.cached+n == len(s.req.Prompt)))
			budget -= n
		}
		if len(b.Seqs) == 0 {
			if len(free) > 0 {
				if _, err := d.Step(ctx, &Step{Batch: b, Free: free}); err != nil {
					return err
				}
			}
			return nil
		}
		res, err := d.Step(ctx, &Step{Batch: b, Free: free})
		if err != nil {
			return err
		}
		free = nil
		byID := make(map[uint64]stage.Sampled, len(res.Sampled))
		for _, t := range res.Sampled {
			byID[t.Seq] = t
		}
		for _, bs := range b.Seqs {
			s := byReq[bs.ID]
			s.cached += len(bs.Tokens)
			if !bs.Sample {
				continue
			}
			t, ok := byID[bs.ID]
			if !ok {
				return fmt.Errorf("batch %d: no token sampled for request %d", b.ID, bs.ID)
			}
			s.tokens = append(s.tokens, t.Token)
			s.produced++
			ev := Event{Request: s.req.ID, Token: t}
			switch {
			case slices.Contains(s.req.StopTokens, t.Token):
				ev.Finish = "stop"
			case s.produced >= s.req.MaxTokens:
				ev.Finish = "length"
			}
			if ev.Finish != "" {
				s.done = true
				free = append(free, s.req.ID)
				blocks.put(s.blocks)
				s.blocks = nil
			}
			if err := emit(ev); err != nil {
				return err
			}
		}
	}
}

// blockIDs hands out KV block ids, the lowest free one first.
type blockIDs struct {
	free []int32 // sorted, descending
	next int32   // the lowest id never handed out
}

func (b *blockIDs) get() int32 {
	if n := len(b.free); n > 0 {
		id := b.free[n-1]
		b.free = b.free[:n-1]
		return id
	}
	b.next++
	return b.next - 1
}

func (b *blockIDs) put(ids []int32) {
	b.free = append(b.free, ids...)
	slices.SortFunc(b.free, func(x, y int32) int { return cmp.Compare(y, x) })
}
