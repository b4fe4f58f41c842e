package apierr

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Kind classifies a domain error; GRPC maps kinds to gRPC codes.
type Kind int

const (
	// Invalid: the request is malformed (INVALID_ARGUMENT).
	Invalid Kind = iota + 1
	// Exhausted: the request can never fit the pipeline
	// (RESOURCE_EXHAUSTED; HTTP 400).
	Exhausted
	// Unavailable: no pipeline is ready, this node is not the leader, it
	// is draining, or no pipeline could serve the request in time
	// (UNAVAILABLE).
	Unavailable
	// Precondition: a stale leader epoch or another model
	// (FAILED_PRECONDITION).
	Precondition
	// Unauthenticated: a missing or wrong admin token (UNAUTHENTICATED).
	Unauthenticated
	// Overloaded: too many requests wait; the client should retry later
	// (RESOURCE_EXHAUSTED; HTTP 429).
	Overloaded
	// Forbidden: the caller is authenticated but may not make the call,
	// such as a Node call from a node that is not the leader
	// (PERMISSION_DENIED).
	Forbidden
	// Internal: the daemon failed this request alone, such as a stage that
	// could not sample it (a row of non-finite logits); the message names
	// the stage (INTERNAL; HTTP 500).
	Internal
)

// kindError is an error of a kind; its message is the error's.
type kindError struct {
	kind Kind
	err  error
}

func (e *kindError) Error() string { return e.err.Error() }
func (e *kindError) Unwrap() error { return e.err }

// New returns an error of kind k, formatted as fmt.Errorf does (so %w
// wraps).
func New(k Kind, format string, args ...any) error {
	return &kindError{kind: k, err: fmt.Errorf(format, args...)}
}

// Invalidf is an Invalid error.
func Invalidf(format string, args ...any) error { return New(Invalid, format, args...) }

// Exhaustedf is an Exhausted error.
func Exhaustedf(format string, args ...any) error { return New(Exhausted, format, args...) }

// Unavailablef is an Unavailable error.
func Unavailablef(format string, args ...any) error { return New(Unavailable, format, args...) }

// Preconditionf is a Precondition error.
func Preconditionf(format string, args ...any) error { return New(Precondition, format, args...) }

// Overloadedf is an Overloaded error.
func Overloadedf(format string, args ...any) error { return New(Overloaded, format, args...) }

// Internalf is an Internal error.
func Internalf(format string, args ...any) error { return New(Internal, format, args...) }

// Forbiddenf is a Forbidden error.
func Forbiddenf(format string, args ...any) error { return New(Forbidden, format, args...) }

// Unauthenticatedf is an Unauthenticated error.
func Unauthenticatedf(format string, args ...any) error {
	return New(Unauthenticated, format, args...)
}

// KindOf is the kind of err's outermost domain error (0 when it has none).
func KindOf(err error) Kind {
	var ke *kindError
	if errors.As(err, &ke) {
		return ke.kind
	}
	return 0
}

var grpcCodes = map[Kind]codes.Code{
	Invalid:         codes.InvalidArgument,
	Exhausted:       codes.ResourceExhausted,
	Unavailable:     codes.Unavailable,
	Precondition:    codes.FailedPrecondition,
	Unauthenticated: codes.Unauthenticated,
	Overloaded:      codes.ResourceExhausted,
	Forbidden:       codes.PermissionDenied,
	Internal:        codes.Internal,
}

// GRPC turns an error of the daemon into the gRPC status a client gets:
// domain kinds by their code, context errors as CANCELED and
// DEADLINE_EXCEEDED, statuses as they are, anything else INTERNAL.
func GRPC(err error) error {
	if err == nil {
		return nil
	}
	var ke *kindError
	switch {
	case errors.As(err, &ke):
		return status.Error(grpcCodes[ke.kind], err.Error())
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, err.Error())
	case errors.Is(err, context.DeadlineExceeded):
		return status.Error(codes.DeadlineExceeded, err.Error())
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	return status.Error(codes.Internal, err.Error())
}
