package openai

import (
	"encoding/json"
	"net/http"
	"unicode/utf8"

	"github.com/tandem-llm/tandem/stage"
)

// defaultCompletionTokens is max_tokens of a text completion that sets
// none, as in OpenAI's API.
const defaultCompletionTokens = 16

// completionRequest is POST /v1/completions.
type completionRequest struct {
	commonRequest
	Prompt   json.RawMessage `json:"prompt"`
	Logprobs *int            `json:"logprobs"`
	Echo     bool            `json:"echo"`
	Suffix   *string         `json:"suffix"`
	BestOf   *int            `json:"best_of"`
}

// prompt reads prompt: a string, a list of one string, a list of token
// ids, or a list of one list of ids. A raw prompt gets the tokenizer's
// special tokens (chat.PromptTokens).
func (c *completionRequest) prompt(m *Model) ([]int32, error) {
	if len(c.Prompt) == 0 || string(c.Prompt) == "null" {
		return nil, badRequest("prompt", "prompt is required")
	}
	var text string
	if json.Unmarshal(c.Prompt, &text) == nil {
		return m.promptTokens("prompt", text, false)
	}
	var texts []string
	if json.Unmarshal(c.Prompt, &texts) == nil {
		if len(texts) != 1 {
			return nil, badRequest("prompt", "prompt holds %d prompts: only one prompt per request is supported", len(texts))
		}
		return m.promptTokens("prompt", texts[0], false)
	}
	var ids []int64
	if json.Unmarshal(c.Prompt, &ids) != nil {
		var lists [][]int64
		if json.Unmarshal(c.Prompt, &lists) != nil {
			return nil, badRequest("prompt", "prompt: want a string, a list of token ids, or a list of one of either")
		}
		if len(lists) != 1 {
			return nil, badRequest("prompt", "prompt holds %d prompts: only one prompt per request is supported", len(lists))
		}
		ids = lists[0]
	}
	vocab := m.Tokenizer.VocabSize()
	out := make([]int32, len(ids))
	for i, id := range ids {
		if id < 0 || id >= int64(vocab) {
			return nil, badRequest("prompt", "prompt token %d = %d is outside the vocabulary [0, %d)", i, id, vocab)
		}
		out[i] = int32(id)
	}
	return out, nil
}

func (s *Server) completions(w http.ResponseWriter, r *http.Request) {
	var req completionRequest
	if err := decodeBody(r, s.maxBody, &req); err != nil {
		writeError(w, err)
		return
	}
	m := s.engine.Model()
	switch {
	case req.Echo:
		writeError(w, badRequest("echo", "echo is not supported"))
		return
	case req.Suffix != nil && *req.Suffix != "":
		writeError(w, badRequest("suffix", "suffix is not supported"))
		return
	case req.BestOf != nil && *req.BestOf != 1:
		writeError(w, badRequest("best_of", "best_of = %d: only 1 is supported", *req.BestOf))
		return
	}
	top := -1
	if req.Logprobs != nil {
		if top = *req.Logprobs; top < 0 || top > stage.MaxLogprobs {
			writeError(w, badRequest("logprobs", "logprobs %d: want 0 to %d", top, stage.MaxLogprobs))
			return
		}
	}
	p, err := req.resolve(m, top)
	if err != nil {
		writeError(w, err)
		return
	}
	prompt, err := req.prompt(m)
	if err != nil {
		writeError(w, err)
		return
	}
	if err := p.setMaxTokens(m, prompt, "max_tokens", "prompt", req.MaxTokens, defaultCompletionTokens); err != nil {
		writeError(w, err)
		return
	}
	ctx := r.Context()
	run, err := s.start(ctx, p)
	if err != nil {
		writeError(w, err)
		return
	}
	defer run.close()
	id, created := "cmpl-"+newID(), s.now().Unix()
	var lps *completionLogprobs
	offset := 0 // characters of the tokens' text so far, for text_offset
	addLogprob := func(l *completionLogprobs, ev event) {
		tok := tokenString(m, ev.token.Token)
		l.Tokens = append(l.Tokens, tok)
		l.TokenLogprobs = append(l.TokenLogprobs, finiteLogprob(ev.token.Logprob))
		top := map[string]float32{}
		for _, t := range ev.token.Top {
			top[tokenString(m, t.Token)] = finiteLogprob(t.Logprob)
		}
		l.TopLogprobs = append(l.TopLogprobs, top)
		l.TextOffset = append(l.TextOffset, offset)
		offset += utf8.RuneCountInString(tok)
	}
	newLogprobs := func() *completionLogprobs {
		return &completionLogprobs{Tokens: []string{}, TokenLogprobs: []float32{}, TopLogprobs: []map[string]float32{}, TextOffset: []int{}}
	}
	if !p.stream {
		if p.logprobs {
			lps = newLogprobs()
		}
		var text string
		for {
			ev, err := run.next(ctx)
			if err != nil {
				s.logFailure(r, err)
				writeError(w, err)
				return
			}
			text += ev.text
			if lps != nil {
				addLogprob(lps, ev)
			}
			if ev.finish != "" {
				writeJSON(w, http.StatusOK, completion{
					ID: id, Object: "text_completion", Created: created, Model: m.ID,
					Choices: []completionChoice{{Text: text, Logprobs: lps, FinishReason: strPtr(ev.finish)}},
					Usage:   mustJSON(newUsage(len(prompt), run.tokens)),
				})
				return
			}
		}
	}
	sse := newSSE(w)
	chunk := func(text string, l *completionLogprobs, finish *string) completion {
		c := completion{ID: id, Object: "text_completion", Created: created, Model: m.ID,
			Choices: []completionChoice{{Text: text, Logprobs: l, FinishReason: finish}}}
		if p.includeUsage {
			c.Usage = nullJSON
		}
		return c
	}
	for {
		ev, err := run.next(ctx)
		if err != nil {
			if ctx.Err() == nil {
				s.logFailure(r, err)
				_ = sse.send(toAPIError(err).body())
				_ = sse.done()
			}
			return
		}
		if ev.text != "" || p.logprobs {
			var l *completionLogprobs
			if p.logprobs {
				l = newLogprobs()
				addLogprob(l, ev)
			}
			if sse.send(chunk(ev.text, l, nil)) != nil {
				return
			}
		}
		if ev.finish != "" {
			if sse.send(chunk("", nil, strPtr(ev.finish))) != nil {
				return
			}
			if p.includeUsage {
				u := completion{ID: id, Object: "text_completion", Created: created, Model: m.ID,
					Choices: []completionChoice{}, Usage: mustJSON(newUsage(len(prompt), run.tokens))}
				if sse.send(u) != nil {
					return
				}
			}
			_ = sse.done()
			return
		}
	}
}
