package openai

import (
	"context"

	"github.com/tandem-llm/tandem/stage"
)

// run is one generation in progress: the engine's stream of tokens and
// their text.
type run struct {
	stream Stream
	tokens int // generated so far
}

// event is what one token adds to the output.
type event struct {
	text   string
	token  stage.Sampled
	finish string // set on the last event: "stop" or "length"
}

// start submits the generation. ctx is the HTTP request's: a client that
// goes away cancels the generation at once; close ends it in any case.
func (s *Server) start(ctx context.Context, p *params) (*run, error) {
	st, err := s.engine.Submit(ctx, p.gen)
	if err != nil {
		return nil, err
	}
	return &run{stream: st}, nil
}

// next waits for the next token and returns what it adds. After the last
// event (finish set) or an error the generation is closed.
func (r *run) next(ctx context.Context) (event, error) {
	tok, err := r.stream.Recv(ctx)
	if err != nil {
		r.close()
		if ctx.Err() != nil {
			return event{}, ctx.Err()
		}
		return event{}, err
	}
	r.tokens++
	ev := event{text: tok.Text, token: tok.Sampled, finish: tok.Finish}
	if ev.finish != "" {
		r.close()
	}
	return ev, nil
}

// close ends the generation (a no-op once it has finished).
func (r *run) close() { r.stream.Close() }
