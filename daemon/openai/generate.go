package openai

import (
	"context"
	"fmt"

	"github.com/tandem-llm/tandem/daemon/textout"
	"github.com/tandem-llm/tandem/stage"
)

// run is one generation in progress: the engine's token stream read
// through the request's output processor.
type run struct {
	stream Stream
	text   *textout.Processor
	cancel context.CancelFunc
	tokens int // generated so far
	done   bool
}

// event is what one token adds to the output.
type event struct {
	text   string
	token  stage.Sampled
	finish string // set on the last event: "stop" or "length"
}

// start submits the generation. The run's context is cancelled by close,
// and by the caller's ctx (the HTTP request's: a client that goes away
// cancels the generation at once).
func (s *Server) start(ctx context.Context, m *Model, p *params) (*run, error) {
	ctx, cancel := context.WithCancel(ctx)
	st, err := s.engine.Submit(ctx, p.gen)
	if err != nil {
		cancel()
		return nil, err
	}
	return &run{stream: st, text: textout.New(m.Tokenizer, textout.Config{Stop: p.stop, KeepSpecial: p.keepSpecial}), cancel: cancel}, nil
}

// next waits for the next token and returns what it adds. After the last
// event (finish set) the request is cancelled, which frees it at once when
// a stop string ended it.
func (r *run) next(ctx context.Context) (event, error) {
	tok, err := r.stream.Recv(ctx)
	if err != nil {
		r.close()
		if ctx.Err() != nil {
			return event{}, ctx.Err()
		}
		return event{}, fmt.Errorf("%w: the generation failed: %w", ErrUnavailable, err)
	}
	r.tokens++
	ev := event{token: tok.Sampled}
	switch {
	case tok.Finish == FinishStop:
		// A stop token: its text is not part of the output.
		ev.text, ev.finish = r.text.Finish(), FinishStop
	default:
		d := r.text.Add(tok.Token)
		ev.text = d.Text
		switch {
		case d.Stopped:
			ev.finish = FinishStop
		case tok.Finish != "":
			ev.text += r.text.Finish()
			ev.finish = FinishLength
		}
	}
	if ev.finish != "" {
		r.close()
	}
	return ev, nil
}

// close cancels the generation (a no-op once it has finished).
func (r *run) close() {
	if !r.done {
		r.done = true
		r.cancel()
	}
}
