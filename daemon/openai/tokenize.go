package openai

import (
	"encoding/json"
	"net/http"

	"github.com/tandem-llm/tandem/model/chat"
)

// tokenizeRequest is POST /tokenize as vLLM shapes it: a prompt, or chat
// messages rendered with the model's template first.
type tokenizeRequest struct {
	Model                string                     `json:"model"`
	Prompt               *string                    `json:"prompt"`
	Messages             json.RawMessage            `json:"messages"`
	Tools                json.RawMessage            `json:"tools"`
	AddSpecialTokens     *bool                      `json:"add_special_tokens"`
	AddGenerationPrompt  *bool                      `json:"add_generation_prompt"`
	ContinueFinalMessage bool                       `json:"continue_final_message"`
	ChatTemplate         string                     `json:"chat_template_name"`
	ChatTemplateKwargs   map[string]json.RawMessage `json:"chat_template_kwargs"`
	ReturnTokenStrs      bool                       `json:"return_token_strs"`
}

type tokenizeResponse struct {
	Count       int       `json:"count"`
	MaxModelLen int       `json:"max_model_len"`
	Tokens      []int32   `json:"tokens"`
	TokenStrs   *[]string `json:"token_strs"`
}

func (s *Server) tokenize(w http.ResponseWriter, r *http.Request) {
	var req tokenizeRequest
	if err := decodeBody(r, s.maxBody, &req); err != nil {
		writeError(w, err)
		return
	}
	m := s.engine.Model()
	if req.Model != "" && req.Model != m.ID {
		writeError(w, modelNotFound(req.Model))
		return
	}
	var ids []int32
	switch {
	case req.Prompt != nil && len(req.Messages) > 0:
		writeError(w, badRequest("messages", "set prompt or messages, not both"))
		return
	case req.Prompt != nil:
		// Special tokens are added unless add_special_tokens is false.
		ids = chat.PromptTokens(m.Tokenizer, *req.Prompt, req.AddSpecialTokens != nil && !*req.AddSpecialTokens)
	case len(req.Messages) > 0:
		c := chatRequest{Messages: req.Messages, Tools: req.Tools, ChatTemplate: req.ChatTemplate,
			ChatTemplateKwargs: req.ChatTemplateKwargs, AddGenerationPrompt: req.AddGenerationPrompt,
			ContinueFinalMessage: req.ContinueFinalMessage}
		text, err := c.render(m)
		if err != nil {
			writeError(w, err)
			return
		}
		// vLLM's add_special_tokens on chat (off by default): the
		// tokenizer's special tokens on top of the template's, never
		// doubled.
		ids = chat.PromptTokens(m.Tokenizer, text, req.AddSpecialTokens == nil || !*req.AddSpecialTokens)
	default:
		writeError(w, badRequest("prompt", "set prompt or messages"))
		return
	}
	resp := tokenizeResponse{Count: len(ids), MaxModelLen: m.MaxContext, Tokens: ids}
	if req.ReturnTokenStrs {
		strs := make([]string, len(ids))
		for i, id := range ids {
			strs[i], _ = m.Tokenizer.Token(id)
		}
		resp.TokenStrs = &strs
	}
	writeJSON(w, http.StatusOK, resp)
}

type detokenizeRequest struct {
	Model  string  `json:"model"`
	Tokens []int64 `json:"tokens"`
}

func (s *Server) detokenize(w http.ResponseWriter, r *http.Request) {
	var req detokenizeRequest
	if err := decodeBody(r, s.maxBody, &req); err != nil {
		writeError(w, err)
		return
	}
	m := s.engine.Model()
	if req.Model != "" && req.Model != m.ID {
		writeError(w, modelNotFound(req.Model))
		return
	}
	if req.Tokens == nil {
		writeError(w, badRequest("tokens", "tokens is required"))
		return
	}
	ids := make([]int32, len(req.Tokens))
	vocab := m.Tokenizer.VocabSize()
	for i, id := range req.Tokens {
		if id < 0 || id >= int64(vocab) {
			writeError(w, badRequest("tokens", "tokens[%d] = %d is outside the vocabulary [0, %d)", i, id, vocab))
			return
		}
		ids[i] = int32(id)
	}
	writeJSON(w, http.StatusOK, map[string]string{"prompt": m.Tokenizer.Decode(ids, false)})
}
