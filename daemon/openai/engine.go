package openai

import (
	"context"
	"errors"
	"time"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/chat"
	"github.com/tandem-llm/tandem/model/tokenizer"
	"github.com/tandem-llm/tandem/stage"
)

// Engine is what the HTTP API needs of the leader: the model it serves,
// whether it serves now, and generation of tokens. The request frontend
// implements it over the scheduler.
type Engine interface {
	// Model describes the served model. It is the same for the life of
	// the Server.
	Model() *Model
	// Ready is nil while requests can be served, else why not (no
	// pipeline, draining): /health answers 503 with it.
	Ready() error
	// Submit starts generating. Cancelling ctx cancels the request and
	// frees what it holds at once. Errors wrap ErrUnavailable,
	// ErrOverloaded or ErrInvalid to tell the client which it is.
	Submit(ctx context.Context, g Generation) (Stream, error)
}

// Model is the served model.
type Model struct {
	// ID is the model's name in the API ("model" of requests, /v1/models).
	ID      string
	Created time.Time
	// MaxContext is the most tokens a request may hold, prompt and
	// completion together.
	MaxContext int
	Tokenizer  *tokenizer.Tokenizer
	// Chat holds the checkpoint's chat templates; nil or empty when it
	// has none (chat completions are then refused).
	Chat *chat.Set
	// Defaults are generation_config.json's: they fill what a request
	// leaves unset.
	Defaults model.GenerationConfig
	// EOS are the ids that end generation unless a request sets
	// ignore_eos (model.EOSIDs).
	EOS []int
}

// promptTokens tokenises a prompt's text (rendered: from the chat
// template; see chat.PromptTokens), refusing unencoded a text longer than
// any prompt of the context can be (tokenizer.MaxTextBytes): encoding
// megabytes costs memory and time for nothing.
func (m *Model) promptTokens(field, text string, rendered bool) ([]int32, error) {
	if n, most := len(text), m.Tokenizer.MaxTextBytes(m.MaxContext); n > most {
		return nil, badRequest(field, "%s of %d bytes: longer than any prompt of the context length %d tokens can be (%d bytes)", field, n, m.MaxContext, most)
	}
	return chat.PromptTokens(m.Tokenizer, text, rendered), nil
}

// Generation is one tokenised request.
type Generation struct {
	Prompt    []int32
	MaxTokens int
	// StopTokens end the generation when sampled (EOS unless ignore_eos,
	// and the request's stop_token_ids); their text is not part of the
	// output.
	StopTokens []int32
	// Stop strings end the output before the first of them to appear
	// (textout.Config.Stop).
	Stop []string
	// KeepSpecial keeps special tokens in the text (skip_special_tokens
	// false).
	KeepSpecial bool
	Sampling    stage.Sampling
}

// Stream is the tokens of one generation, in order, with their text: the
// engine owns the output's text (incremental detokenisation, stop strings,
// text held back while it may begin one).
type Stream interface {
	// Recv waits for the next token. The last one has Finish set. An
	// error ends the stream: ctx's when it is cancelled, else why the
	// generation failed (wrapping ErrUnavailable when it may succeed
	// later; anything else is an internal error).
	Recv(ctx context.Context) (Token, error)
	// Close ends the generation: an unfinished one is cancelled and frees
	// what it holds at once. It may be called more than once.
	Close()
}

// Token is one generated token.
type Token struct {
	stage.Sampled
	// Text is the output's text this token releases ("" while text is
	// held back; on the last token, whatever was held).
	Text string
	// Finish is set on the last token: FinishStop (a stop token or stop
	// string) or FinishLength (MaxTokens reached).
	Finish string
}

// Finish reasons of a Token.
const (
	FinishStop   = "stop"
	FinishLength = "length"
)

// Kinds of Engine errors, told apart with errors.Is.
var (
	// ErrUnavailable: no pipeline serves, the node drains, or the
	// pipeline failed (503).
	ErrUnavailable = errors.New("unavailable")
	// ErrOverloaded: too many requests wait (429).
	ErrOverloaded = errors.New("overloaded")
	// ErrInvalid: the request can never be served, for example it needs
	// more KV cache than the pipeline has (400).
	ErrInvalid = errors.New("invalid request")
)
