package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"strings"

	"github.com/tandem-llm/tandem/daemon/textout"
	"github.com/tandem-llm/tandem/stage"
)

// commonRequest holds the fields chat and text completions share.
type commonRequest struct {
	Model         string          `json:"model"`
	MaxTokens     *int            `json:"max_tokens"`
	Temperature   *float64        `json:"temperature"`
	TopP          *float64        `json:"top_p"`
	TopK          *int            `json:"top_k"`
	Seed          *int64          `json:"seed"`
	Stop          json.RawMessage `json:"stop"`
	N             *int            `json:"n"`
	Stream        bool            `json:"stream"`
	StreamOptions *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	IgnoreEOS         bool               `json:"ignore_eos"`
	StopTokenIDs      []int              `json:"stop_token_ids"`
	SkipSpecialTokens *bool              `json:"skip_special_tokens"`
	PresencePenalty   *float64           `json:"presence_penalty"`
	FrequencyPenalty  *float64           `json:"frequency_penalty"`
	LogitBias         map[string]float64 `json:"logit_bias"`
}

// params is a validated request, ready to generate.
type params struct {
	gen          Generation
	logprobs     bool // report the sampled tokens' log-probabilities
	stream       bool
	includeUsage bool
}

// decodeBody reads a JSON request body into v; a malformed body is a 400
// naming the field whose type is wrong where there is one.
func decodeBody(r *http.Request, maxBytes int64, v any) error {
	body, err := io.ReadAll(http.MaxBytesReader(nil, r.Body, maxBytes))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return &apiError{status: http.StatusRequestEntityTooLarge, typ: "invalid_request_error", message: fmt.Sprintf("request body larger than %d bytes", maxBytes)}
		}
		return badRequest("", "read the request body: %v", err)
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := dec.Decode(v); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) && te.Field != "" {
			// The path names the embedded struct of shared fields too.
			field := strings.TrimPrefix(te.Field, "commonRequest.")
			return badRequest(field, "%s: want %s, got a JSON %s", field, te.Type, te.Value)
		}
		return badRequest("", "the request body is not a JSON object: %v", err)
	}
	if dec.More() {
		return badRequest("", "the request body holds more than one JSON value")
	}
	return nil
}

// resolve validates the fields both endpoints share against the model and
// fills in the checkpoint's defaults for what the request leaves unset.
// topLogprobs < 0 means no log-probabilities.
func (c *commonRequest) resolve(m *Model, topLogprobs int) (*params, error) {
	p := &params{stream: c.Stream, logprobs: topLogprobs >= 0}
	if c.Model != "" && c.Model != m.ID {
		return nil, modelNotFound(c.Model)
	}
	if c.N != nil && *c.N != 1 {
		return nil, badRequest("n", "n = %d: only n = 1 is supported", *c.N)
	}
	if c.StreamOptions != nil {
		if !c.Stream {
			return nil, badRequest("stream_options", "stream_options can only be set when stream is true")
		}
		p.includeUsage = c.StreamOptions.IncludeUsage
	}
	for _, f := range []struct {
		name string
		v    *float64
	}{{"presence_penalty", c.PresencePenalty}, {"frequency_penalty", c.FrequencyPenalty}} {
		if f.v != nil && *f.v != 0 {
			return nil, badRequest(f.name, "%s is not supported (only 0)", f.name)
		}
	}
	if len(c.LogitBias) > 0 {
		return nil, badRequest("logit_bias", "logit_bias is not supported")
	}
	vocab := m.Tokenizer.VocabSize()
	s := stage.Sampling{Temperature: 1, TopP: 1, Logprobs: max(topLogprobs, 0)}
	switch t := c.Temperature; {
	case t != nil:
		if math.IsNaN(*t) || math.IsInf(*t, 0) || *t < 0 {
			return nil, badRequest("temperature", "temperature %v: want a finite number ≥ 0", *t)
		}
		s.Temperature = float32(*t)
	case m.Defaults.Temperature != nil:
		s.Temperature = float32(*m.Defaults.Temperature)
	}
	switch v := c.TopP; {
	case v != nil:
		if math.IsNaN(*v) || *v <= 0 || *v > 1 {
			return nil, badRequest("top_p", "top_p %v: want a number in (0, 1]", *v)
		}
		s.TopP = float32(*v)
	case m.Defaults.TopP != nil:
		s.TopP = float32(*m.Defaults.TopP)
	}
	switch k := c.TopK; {
	case k != nil:
		if *k < -1 || *k > vocab {
			return nil, badRequest("top_k", "top_k %d: want -1 or 0 (no cut) or up to the vocabulary size %d", *k, vocab)
		}
		s.TopK = max(*k, 0)
	case m.Defaults.TopK != nil:
		s.TopK = *m.Defaults.TopK
	}
	if c.Seed != nil {
		s.Seed = uint64(*c.Seed)
	} else {
		s.Seed = rand.Uint64()
	}
	if err := s.Validate(stage.MaxLogprobs); err != nil {
		return nil, badRequest("", "%v", err)
	}
	p.gen.Sampling = s
	stop, err := parseStop(c.Stop)
	if err != nil {
		return nil, err
	}
	p.gen.Stop = stop
	if !c.IgnoreEOS {
		for _, id := range m.EOS {
			p.gen.StopTokens = append(p.gen.StopTokens, int32(id))
		}
	}
	for i, id := range c.StopTokenIDs {
		if id < 0 || id >= vocab {
			return nil, badRequest("stop_token_ids", "stop_token_ids[%d] = %d is outside the vocabulary [0, %d)", i, id, vocab)
		}
		p.gen.StopTokens = append(p.gen.StopTokens, int32(id))
	}
	p.gen.KeepSpecial = c.SkipSpecialTokens != nil && !*c.SkipSpecialTokens
	return p, nil
}

// parseStop reads stop: absent, null, a string or a list of strings.
func parseStop(raw json.RawMessage) ([]string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var one string
	var stop []string
	if err := json.Unmarshal(raw, &one); err == nil {
		stop = []string{one}
	} else if err := json.Unmarshal(raw, &stop); err != nil {
		return nil, badRequest("stop", "stop: want a string or a list of strings")
	}
	if err := textout.CheckStop(stop); err != nil {
		return nil, badRequest("stop", "%v", err)
	}
	return stop, nil
}

// setMaxTokens checks the prompt and sets the completion's length: asked
// (nil: up to the context, or def when def > 0) within the context.
func (p *params) setMaxTokens(m *Model, prompt []int32, field, promptField string, asked *int, def int) error {
	p.gen.Prompt = prompt
	n := len(prompt)
	if n == 0 {
		return badRequest(promptField, "the prompt is empty")
	}
	if n >= m.MaxContext {
		return badRequest(promptField, "the prompt is %d tokens; this model's maximum context length is %d tokens", n, m.MaxContext)
	}
	switch {
	case asked != nil:
		if *asked < 1 {
			return badRequest(field, "%s = %d: want ≥ 1", field, *asked)
		}
		if n+*asked > m.MaxContext {
			return badRequest(field, "this model's maximum context length is %d tokens; the request asks for %d (%d in the prompt, %d in the completion); reduce the prompt or %s",
				m.MaxContext, n+*asked, n, *asked, field)
		}
		p.gen.MaxTokens = *asked
	case def > 0:
		p.gen.MaxTokens = min(def, m.MaxContext-n)
	default:
		p.gen.MaxTokens = m.MaxContext - n
	}
	return nil
}

// tokenString is a token's text as logprobs show it: the token decoded on
// its own, special tokens included.
func tokenString(m *Model, id int32) string {
	return m.Tokenizer.Decode([]int32{id}, false)
}

// checkMessages validates the structure of chat messages that no template
// can be trusted to check: a non-empty array of objects with a role, and
// content that is null, a string or a list of text parts.
func checkMessages(raw json.RawMessage) error {
	var msgs []map[string]json.RawMessage
	if err := json.Unmarshal(raw, &msgs); err != nil {
		return badRequest("messages", "messages: want a list of message objects")
	}
	if len(msgs) == 0 {
		return badRequest("messages", "messages is empty")
	}
	for i, m := range msgs {
		var role string
		if err := json.Unmarshal(m["role"], &role); err != nil || role == "" {
			return badRequest(fmt.Sprintf("messages[%d].role", i), "messages[%d].role: want a non-empty string", i)
		}
		c, ok := m["content"]
		if !ok || string(c) == "null" {
			continue
		}
		var s string
		if json.Unmarshal(c, &s) == nil {
			continue
		}
		var parts []struct {
			Type string  `json:"type"`
			Text *string `json:"text"`
		}
		if err := json.Unmarshal(c, &parts); err != nil {
			return badRequest(fmt.Sprintf("messages[%d].content", i), "messages[%d].content: want a string or a list of content parts", i)
		}
		for j, part := range parts {
			if part.Type != "text" || part.Text == nil {
				return badRequest(fmt.Sprintf("messages[%d].content[%d]", i, j), "messages[%d].content[%d]: only text parts are supported (type %q)", i, j, part.Type)
			}
		}
	}
	return nil
}
