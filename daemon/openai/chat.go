package openai

import (
	"encoding/json"
	"errors"
	"net/http"

	"github.com/tandem-llm/tandem/model/chat"
	"github.com/tandem-llm/tandem/stage"
)

// chatRequest is POST /v1/chat/completions.
type chatRequest struct {
	commonRequest
	Messages             json.RawMessage            `json:"messages"`
	Tools                json.RawMessage            `json:"tools"`
	ToolChoice           json.RawMessage            `json:"tool_choice"`
	MaxCompletionTokens  *int                       `json:"max_completion_tokens"`
	Logprobs             bool                       `json:"logprobs"`
	TopLogprobs          *int                       `json:"top_logprobs"`
	ChatTemplate         string                     `json:"chat_template_name"`
	ChatTemplateKwargs   map[string]json.RawMessage `json:"chat_template_kwargs"`
	AddGenerationPrompt  *bool                      `json:"add_generation_prompt"`
	ContinueFinalMessage bool                       `json:"continue_final_message"`
	ResponseFormat       *struct {
		Type string `json:"type"`
	} `json:"response_format"`
}

// prompt renders the conversation with the model's chat template and
// tokenises it.
func (c *chatRequest) prompt(m *Model) ([]int32, error) {
	text, err := c.render(m)
	if err != nil {
		return nil, err
	}
	return m.promptTokens("messages", text, true)
}

// render renders the conversation with the model's chat template; a
// template that fails or raises is a 400 naming it.
func (c *chatRequest) render(m *Model) (string, error) {
	if len(c.Messages) == 0 {
		return "", badRequest("messages", "messages is required")
	}
	if err := checkMessages(c.Messages); err != nil {
		return "", err
	}
	if len(c.ToolChoice) > 0 {
		var choice string
		if json.Unmarshal(c.ToolChoice, &choice) != nil || (choice != "auto" && choice != "none") {
			return "", badRequest("tool_choice", "tool_choice: only \"auto\" and \"none\" are supported (tool calls are not parsed from the output)")
		}
	}
	if c.ResponseFormat != nil && c.ResponseFormat.Type != "" && c.ResponseFormat.Type != "text" {
		return "", badRequest("response_format", "response_format %q is not supported (only \"text\")", c.ResponseFormat.Type)
	}
	if m.Chat == nil {
		return "", badRequest("messages", "%v; use /v1/completions", chat.ErrNoTemplate)
	}
	hasTools := len(c.Tools) > 0 && string(c.Tools) != "null" && string(c.Tools) != "[]"
	tmpl, err := m.Chat.Select(c.ChatTemplate, hasTools)
	if err != nil {
		return "", badRequest("chat_template_name", "%v", err)
	}
	addGen := c.AddGenerationPrompt == nil || *c.AddGenerationPrompt
	if c.ContinueFinalMessage {
		addGen = c.AddGenerationPrompt != nil && *c.AddGenerationPrompt
	}
	text, err := tmpl.Render(chat.Request{
		Messages:             c.Messages,
		Tools:                c.Tools,
		AddGenerationPrompt:  addGen,
		ContinueFinalMessage: c.ContinueFinalMessage,
		Kwargs:               c.ChatTemplateKwargs,
		FlattenTextContent:   true,
	})
	if err != nil {
		var ie *chat.InputError
		if errors.As(err, &ie) {
			return "", badRequest(ie.Field, "%v", err)
		}
		return "", badRequest("messages", "%v", err)
	}
	return text, nil
}

func (s *Server) chatCompletions(w http.ResponseWriter, r *http.Request) {
	var req chatRequest
	if err := decodeBody(r, s.maxBody, &req); err != nil {
		writeError(w, err)
		return
	}
	m := s.engine.Model()
	top := -1
	if req.Logprobs {
		top = 0
		if req.TopLogprobs != nil {
			top = *req.TopLogprobs
		}
	} else if req.TopLogprobs != nil && *req.TopLogprobs > 0 {
		writeError(w, badRequest("top_logprobs", "top_logprobs needs logprobs set to true"))
		return
	}
	if top > stage.MaxLogprobs || top < -1 {
		writeError(w, badRequest("top_logprobs", "top_logprobs %d: want 0 to %d", top, stage.MaxLogprobs))
		return
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
	asked, field := req.MaxCompletionTokens, "max_completion_tokens"
	if asked == nil {
		asked, field = req.MaxTokens, "max_tokens"
	}
	if err := p.setMaxTokens(m, prompt, field, "messages", asked, 0); err != nil {
		writeError(w, err)
		return
	}
	s.respond(w, r, p, &chatOutput{id: "chatcmpl-" + newID(), created: s.now().Unix(), m: m, p: p})
}

// chatOutput shapes the answer of a chat completion.
type chatOutput struct {
	id      string
	created int64
	m       *Model
	p       *params
}

func (o *chatOutput) whole(text string, toks []event, finish string, u *usage) any {
	var lps *chatLogprobs
	if o.p.logprobs {
		lps = &chatLogprobs{Content: []tokenLogprob{}}
		for _, ev := range toks {
			lps.Content = append(lps.Content, chatLogprob(o.m, ev))
		}
	}
	return chatCompletion{
		ID: o.id, Object: "chat.completion", Created: o.created, Model: o.m.ID,
		Choices: []chatChoice{{Message: chatMessage{Role: "assistant", Content: text}, Logprobs: lps, FinishReason: finish}},
		Usage:   u,
	}
}

// chunk is a streamed chunk of the one choice.
func (o *chatOutput) chunk(d chunkDelta, lps *chatLogprobs, finish *string) chatChunk {
	c := chatChunk{ID: o.id, Object: "chat.completion.chunk", Created: o.created, Model: o.m.ID,
		Choices: []chunkChoice{{Delta: d, Logprobs: lps, FinishReason: finish}}}
	if o.p.includeUsage {
		c.Usage = nullJSON
	}
	return c
}

func (o *chatOutput) head() any {
	return o.chunk(chunkDelta{Role: "assistant", Content: strPtr("")}, nil, nil)
}

func (o *chatOutput) token(ev event) any {
	var lps *chatLogprobs
	if o.p.logprobs {
		lps = &chatLogprobs{Content: []tokenLogprob{chatLogprob(o.m, ev)}}
	}
	return o.chunk(chunkDelta{Content: strPtr(ev.text)}, lps, nil)
}

func (o *chatOutput) end(finish string) any { return o.chunk(chunkDelta{}, nil, strPtr(finish)) }

func (o *chatOutput) usage(u *usage) any {
	return chatChunk{ID: o.id, Object: "chat.completion.chunk", Created: o.created, Model: o.m.ID,
		Choices: []chunkChoice{}, Usage: mustJSON(u)}
}

// chatLogprob is a token's entry in a chat completion's logprobs.
func chatLogprob(m *Model, ev event) tokenLogprob {
	s := tokenString(m, ev.token.Token)
	lp := tokenLogprob{Token: s, Logprob: finiteLogprob(ev.token.Logprob), Bytes: utf8Bytes(s), TopLogprobs: []topLogprobJS{}}
	for _, t := range ev.token.Top {
		ts := tokenString(m, t.Token)
		lp.TopLogprobs = append(lp.TopLogprobs, topLogprobJS{Token: ts, Logprob: finiteLogprob(t.Logprob), Bytes: utf8Bytes(ts)})
	}
	return lp
}
