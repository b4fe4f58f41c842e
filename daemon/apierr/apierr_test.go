package apierr

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestGRPC(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want codes.Code
	}{
		{nil, codes.OK},
		{Invalidf("bad"), codes.InvalidArgument},
		{fmt.Errorf("wrapped: %w", Exhaustedf("full")), codes.ResourceExhausted},
		{Unavailablef("none"), codes.Unavailable},
		{Preconditionf("stale"), codes.FailedPrecondition},
		{Unauthenticatedf("token"), codes.Unauthenticated},
		{Overloadedf("1024 waiting"), codes.ResourceExhausted},
		{fmt.Errorf("call: %w", context.Canceled), codes.Canceled},
		{context.DeadlineExceeded, codes.DeadlineExceeded},
		{status.Error(codes.NotFound, "x"), codes.NotFound},
		{errors.New("surprise"), codes.Internal},
	} {
		got := GRPC(tc.err)
		if status.Code(got) != tc.want {
			t.Errorf("GRPC(%v) = %v, want %v", tc.err, got, tc.want)
		}
		if tc.err != nil && status.Convert(got).Message() != tc.err.Error() && status.Code(tc.err) == codes.Unknown {
			t.Errorf("GRPC(%v) message %q, want the error's", tc.err, status.Convert(got).Message())
		}
	}
}

func TestKindOf(t *testing.T) {
	if k := KindOf(fmt.Errorf("x: %w", Unavailablef("y"))); k != Unavailable {
		t.Errorf("wrapped Unavailable: kind %v", k)
	}
	if k := KindOf(errors.New("plain")); k != 0 {
		t.Errorf("plain error: kind %v, want 0", k)
	}
}
