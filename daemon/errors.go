package daemon

import (
	"context"
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// kind classifies a domain error; grpcError maps kinds to gRPC codes, the
// one place where that happens.
type kind int

const (
	// kindInvalid: the request is malformed (INVALID_ARGUMENT).
	kindInvalid kind = iota + 1
	// kindExhausted: the request can never fit, or too many wait
	// (RESOURCE_EXHAUSTED).
	kindExhausted
	// kindUnavailable: no pipeline is ready, this node is not the leader,
	// it is draining, or the pipeline failed under the request
	// (UNAVAILABLE).
	kindUnavailable
	// kindPrecondition: a stale leader epoch or another model
	// (FAILED_PRECONDITION).
	kindPrecondition
	// kindUnauthenticated: a missing or wrong admin token
	// (UNAUTHENTICATED).
	kindUnauthenticated
)

// kindError is an error of a kind; its message is the error's.
type kindError struct {
	kind kind
	err  error
}

func (e *kindError) Error() string { return e.err.Error() }
func (e *kindError) Unwrap() error { return e.err }

func newKind(k kind, format string, args ...any) error {
	return &kindError{kind: k, err: fmt.Errorf(format, args...)}
}

func invalidf(format string, args ...any) error { return newKind(kindInvalid, format, args...) }
func exhaustedf(format string, args ...any) error {
	return newKind(kindExhausted, format, args...)
}
func unavailablef(format string, args ...any) error {
	return newKind(kindUnavailable, format, args...)
}
func preconditionf(format string, args ...any) error {
	return newKind(kindPrecondition, format, args...)
}

var kindCodes = map[kind]codes.Code{
	kindInvalid:         codes.InvalidArgument,
	kindExhausted:       codes.ResourceExhausted,
	kindUnavailable:     codes.Unavailable,
	kindPrecondition:    codes.FailedPrecondition,
	kindUnauthenticated: codes.Unauthenticated,
}

// grpcError turns an error of the daemon into the gRPC status a client
// gets: domain kinds by their code, context errors as CANCELED and
// DEADLINE_EXCEEDED, statuses as they are, anything else INTERNAL.
func grpcError(err error) error {
	if err == nil {
		return nil
	}
	var ke *kindError
	switch {
	case errors.As(err, &ke):
		return status.Error(kindCodes[ke.kind], err.Error())
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
