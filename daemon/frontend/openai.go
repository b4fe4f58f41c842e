package frontend

import (
	"context"

	"github.com/tandem-llm/tandem/daemon/openai"
	"github.com/tandem-llm/tandem/daemon/textout"
	"github.com/tandem-llm/tandem/sched"
)

// OpenAI is the engine the OpenAI HTTP API runs on (openai.Config.Engine):
// the same requests, text and metrics as Generate.
func (s *Server) OpenAI() openai.Engine { return openaiEngine{s} }

// openaiEngine implements openai.Engine over the frontend.
type openaiEngine struct{ s *Server }

// Model implements openai.Engine.
func (e openaiEngine) Model() *openai.Model { return e.s.openai }

// Ready implements openai.Engine: nil while a pipeline serves requests
// here.
func (e openaiEngine) Ready() error { return openaiError(e.s.engines.Ready()) }

// Submit implements openai.Engine.
func (e openaiEngine) Submit(ctx context.Context, g openai.Generation) (openai.Stream, error) {
	r, err := e.s.start(ctx, sched.Request{Prompt: g.Prompt, MaxTokens: g.MaxTokens, StopTokens: g.StopTokens, Sampling: g.Sampling},
		textout.Config{Stop: g.Stop, KeepSpecial: g.KeepSpecial})
	if err != nil {
		return nil, openaiError(err)
	}
	return openaiStream{r}, nil
}

// openaiStream implements openai.Stream over a run.
type openaiStream struct{ r *run }

func (st openaiStream) Recv(ctx context.Context) (openai.Token, error) {
	ev, err := st.r.next(ctx)
	if err != nil {
		return openai.Token{}, openaiError(err)
	}
	return openai.Token{Sampled: ev.token, Text: ev.text, Finish: openaiFinish[ev.finish]}, nil
}

var openaiFinish = map[string]string{sched.FinishStop: openai.FinishStop, sched.FinishLength: openai.FinishLength}

func (st openaiStream) Close() { st.r.close() }
