package openai

import (
	"context"
	"net/http"
	"strings"

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

// output is one endpoint's shapes of the answer to a generation.
type output interface {
	// whole is the answer when it is not streamed: all of the text, the
	// tokens (nil unless log-probabilities are asked), why it ended.
	whole(text string, toks []event, finish string, u *usage) any
	// head is the event streamed before the first token (nil: none).
	head() any
	// token is the event streamed for a token that adds text (for every
	// token when log-probabilities are asked).
	token(ev event) any
	// end is the event streamed with the finish reason.
	end(finish string) any
	// usage is the event streamed after end when
	// stream_options.include_usage is set.
	usage(u *usage) any
}

// respond runs the generation of p and answers in out's shapes: one JSON
// object once it ends, or, when p.stream, server-sent events as it goes
// and "[DONE]" last. An error after the stream began is sent as an event.
func (s *Server) respond(w http.ResponseWriter, r *http.Request, p *params, out output) {
	ctx := r.Context()
	run, err := s.start(ctx, p)
	if err != nil {
		writeError(w, err)
		return
	}
	defer run.close()
	if !p.stream {
		var text strings.Builder
		var toks []event
		for {
			ev, err := run.next(ctx)
			if err != nil {
				s.logFailure(r, err)
				writeError(w, err)
				return
			}
			text.WriteString(ev.text)
			if p.logprobs {
				toks = append(toks, ev)
			}
			if ev.finish != "" {
				writeJSON(w, http.StatusOK, out.whole(text.String(), toks, ev.finish, newUsage(len(p.gen.Prompt), run.tokens)))
				return
			}
		}
	}
	sse := newSSE(w)
	if h := out.head(); h != nil && sse.send(h) != nil {
		return // the client went away: the deferred close cancels the generation
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
		if (ev.text != "" || p.logprobs) && sse.send(out.token(ev)) != nil {
			return
		}
		if ev.finish != "" {
			if sse.send(out.end(ev.finish)) != nil {
				return
			}
			if p.includeUsage && sse.send(out.usage(newUsage(len(p.gen.Prompt), run.tokens))) != nil {
				return
			}
			_ = sse.done()
			return
		}
	}
}
