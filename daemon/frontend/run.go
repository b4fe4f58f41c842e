package frontend

import (
	"context"
	"errors"
	"time"

	"github.com/tandem-llm/tandem/daemon/textout"
	"github.com/tandem-llm/tandem/sched"
	"github.com/tandem-llm/tandem/stage"
)

// run is one request in progress, whatever API it came from: the
// scheduler's token stream read through the request's output processor
// (package textout), cancelled as soon as its output is complete, and
// recorded in the metrics.
type run struct {
	stream *sched.Stream
	text   *textout.Processor
	cancel context.CancelFunc
	rec    record
	done   bool
}

// event is what one token adds to the output.
type event struct {
	token stage.Sampled
	text  string
	// finish is set on the last event: sched.FinishStop (a stop token or
	// a stop string) or sched.FinishLength.
	finish string
}

// start submits a request. Its output's text is made as tc says. The run
// must be closed; cancelling ctx cancels the request.
func (s *Server) start(ctx context.Context, req sched.Request, tc textout.Config) (*run, error) {
	e, err := s.engines.Engine()
	if err != nil {
		return nil, err
	}
	arrival := time.Now()
	ctx, cancel := context.WithCancel(ctx)
	st, err := e.Submit(ctx, req)
	if err != nil {
		cancel()
		return nil, err
	}
	return &run{
		stream: st,
		text:   textout.New(s.tok, tc),
		cancel: cancel,
		rec:    record{m: s.metrics, arrival: arrival, prompt: len(req.Prompt)},
	}, nil
}

// next waits for the next token and returns what it adds to the output.
// After the last event, or an error, the run is closed. Its errors are
// ctx's, or domain errors (streamError).
func (r *run) next(ctx context.Context) (event, error) {
	o, err := r.stream.Recv(ctx)
	if err != nil {
		r.close()
		if ctx.Err() != nil {
			return event{}, ctx.Err()
		}
		return event{}, streamError(err)
	}
	return r.apply(o), nil
}

// apply turns the stream's next token into its event.
func (r *run) apply(o sched.Output) event {
	r.rec.token(o, time.Now())
	ev := event{token: o.Token}
	switch {
	case o.Finish == sched.FinishStop:
		// A stop token: its text is not part of the output.
		ev.text, ev.finish = r.text.Finish(), sched.FinishStop
	default:
		d := r.text.Add(o.Token.Token)
		ev.text = d.Text
		switch {
		case d.Stopped:
			ev.finish = sched.FinishStop
		case o.Finish != "":
			ev.text += r.text.Finish()
			ev.finish = sched.FinishLength
		}
	}
	if ev.finish != "" {
		r.rec.finish(ev.finish, time.Now())
		r.close()
	}
	return ev
}

// errNoneReady cancels the context of a Recv that must not wait.
var errNoneReady = errors.New("no token ready")

// ready waits for the next token and returns its event with those of
// every other token already delivered, up to the last one, so that one
// message can carry them all.
func (r *run) ready(ctx context.Context) ([]event, error) {
	ev, err := r.next(ctx)
	if err != nil {
		return nil, err
	}
	evs := []event{ev}
	now, cancel := context.WithCancelCause(ctx)
	cancel(errNoneReady)
	for ev.finish == "" {
		o, err := r.stream.Recv(now)
		if err != nil {
			break // nothing more ready, or the end, which the next call sees
		}
		ev = r.apply(o)
		evs = append(evs, ev)
	}
	return evs, nil
}

// tokens is the number of tokens generated so far.
func (r *run) tokens() int { return r.rec.generated }

// close ends the request: an unfinished one is cancelled, which frees it
// in the scheduler at once, and counts as aborted. It may be called more
// than once.
func (r *run) close() {
	if r.done {
		return
	}
	r.done = true
	r.cancel()
	r.rec.finish(reasonAbort, time.Now())
}
