package frontend

import (
	"context"
	"errors"

	"github.com/tandem-llm/tandem/daemon/apierr"
	"github.com/tandem-llm/tandem/daemon/openai"
	"github.com/tandem-llm/tandem/sched"
)

// streamError is the domain error of a request's stream that ended before
// its last token other than by its own context: the engine's own reason
// as it is (no pipeline served it within the recovery timeout),
// RESOURCE_EXHAUSTED when a rebuilt pipeline cannot hold it, INTERNAL
// naming the stage when a stage failed it alone (sched.ErrRequestFailed),
// else UNAVAILABLE.
func streamError(err error) error {
	switch {
	case apierr.KindOf(err) != 0:
		return err
	case errors.Is(err, sched.ErrTooLarge):
		return apierr.Exhaustedf("%v", err)
	case errors.Is(err, sched.ErrRequestFailed):
		return apierr.Internalf("%w", err)
	}
	return apierr.Unavailablef("the request was cut short: %v", err)
}

// openaiError maps the frontend's domain errors onto the kinds the OpenAI
// API answers with (the one place this is decided; package openai turns
// them into HTTP statuses): a malformed request or one that can never fit
// the pipeline is ErrInvalid (400), a full queue ErrOverloaded (429), a
// refusal that may pass later ErrUnavailable (503). Context errors,
// internal errors (a stage failed the request) and errors of no kind
// (500) pass unchanged.
func openaiError(err error) error {
	var kind error
	switch apierr.KindOf(err) {
	case apierr.Invalid, apierr.Exhausted:
		kind = openai.ErrInvalid
	case apierr.Overloaded:
		kind = openai.ErrOverloaded
	case apierr.Unavailable, apierr.Precondition:
		kind = openai.ErrUnavailable
	}
	if kind == nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return kindError{kind: kind, err: err}
}

// kindError is err, of the OpenAI API's kind: its message is err's alone.
type kindError struct{ kind, err error }

func (e kindError) Error() string   { return e.err.Error() }
func (e kindError) Unwrap() []error { return []error{e.kind, e.err} }
