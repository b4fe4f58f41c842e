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
	s.respond(w, r, p, &completionOutput{id: "cmpl-" + newID(), created: s.now().Unix(), m: m, p: p})
}

// completionOutput shapes the answer of a text completion.
type completionOutput struct {
	id      string
	created int64
	m       *Model
	p       *params
	offset  int // characters of the tokens' text so far, for text_offset
}

// logprobs are the log-probabilities of toks, the tokens that follow
// those already shown.
func (o *completionOutput) logprobs(toks []event) *completionLogprobs {
	l := &completionLogprobs{Tokens: []string{}, TokenLogprobs: []float32{}, TopLogprobs: []map[string]float32{}, TextOffset: []int{}}
	for _, ev := range toks {
		tok := tokenString(o.m, ev.token.Token)
		l.Tokens = append(l.Tokens, tok)
		l.TokenLogprobs = append(l.TokenLogprobs, finiteLogprob(ev.token.Logprob))
		top := map[string]float32{}
		for _, t := range ev.token.Top {
			top[tokenString(o.m, t.Token)] = finiteLogprob(t.Logprob)
		}
		l.TopLogprobs = append(l.TopLogprobs, top)
		l.TextOffset = append(l.TextOffset, o.offset)
		o.offset += utf8.RuneCountInString(tok)
	}
	return l
}

func (o *completionOutput) whole(text string, toks []event, finish string, u *usage) any {
	var lps *completionLogprobs
	if o.p.logprobs {
		lps = o.logprobs(toks)
	}
	return completion{
		ID: o.id, Object: "text_completion", Created: o.created, Model: o.m.ID,
		Choices: []completionChoice{{Text: text, Logprobs: lps, FinishReason: strPtr(finish)}},
		Usage:   mustJSON(u),
	}
}

// chunk is a streamed chunk of the one choice.
func (o *completionOutput) chunk(text string, l *completionLogprobs, finish *string) completion {
	c := completion{ID: o.id, Object: "text_completion", Created: o.created, Model: o.m.ID,
		Choices: []completionChoice{{Text: text, Logprobs: l, FinishReason: finish}}}
	if o.p.includeUsage {
		c.Usage = nullJSON
	}
	return c
}

func (o *completionOutput) head() any { return nil }

func (o *completionOutput) token(ev event) any {
	var l *completionLogprobs
	if o.p.logprobs {
		l = o.logprobs([]event{ev})
	}
	return o.chunk(ev.text, l, nil)
}

func (o *completionOutput) end(finish string) any { return o.chunk("", nil, strPtr(finish)) }

func (o *completionOutput) usage(u *usage) any {
	return completion{ID: o.id, Object: "text_completion", Created: o.created, Model: o.m.ID,
		Choices: []completionChoice{}, Usage: mustJSON(u)}
}
