package pipeline

import (
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
			b.Seqs = append(b.Seqs, stage.Seq{ID: s.req.ID, Pos: s.cached, Tokens: s.tokens[s.cached:], Sample: true, Sampling: s.req.Sampling, Index: s.produced})
			budget--
		}
		for _, s := range seqs {
			if s.done || s.cached >= len(s.req.Prompt) || budget == 0 {
				continue
			}
			n := min(len(s.req.Prompt)-s.cached, budget)
			b.Seqs = append(b.Seqs, stage.Seq{ID: s.req.ID, Pos: s.cached, Tokens: s.tokens[s.cached : s.cached+n], Sample: s.cached+n == len(s.req.Prompt), Sampling: s.req.Sampling, Index: s.produced})
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
			}
			if err := emit(ev); err != nil {
				return err
			}
		}
	}
}
