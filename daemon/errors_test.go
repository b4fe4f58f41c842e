package daemon

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestGRPCError(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want codes.Code
	}{
		{nil, codes.OK},
		{invalidf("bad"), codes.InvalidArgument},
		{fmt.Errorf("wrapped: %w", exhaustedf("full")), codes.ResourceExhausted},
		{unavailablef("none"), codes.Unavailable},
		{preconditionf("stale"), codes.FailedPrecondition},
		{newKind(kindUnauthenticated, "token"), codes.Unauthenticated},
		{fmt.Errorf("call: %w", context.Canceled), codes.Canceled},
		{context.DeadlineExceeded, codes.DeadlineExceeded},
		{status.Error(codes.NotFound, "x"), codes.NotFound},
		{errors.New("surprise"), codes.Internal},
	} {
		got := grpcError(tc.err)
		if status.Code(got) != tc.want {
			t.Errorf("grpcError(%v) = %v, want %v", tc.err, got, tc.want)
		}
		if tc.err != nil && status.Convert(got).Message() != tc.err.Error() && status.Code(tc.err) == codes.Unknown {
			t.Errorf("grpcError(%v) message %q, want the error's", tc.err, status.Convert(got).Message())
		}
	}
}
