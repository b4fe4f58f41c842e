package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"google.golang.org/grpc"
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

// TestRecovery checks that a panicking handler fails its call with
// INTERNAL instead of crashing the daemon.
func TestRecovery(t *testing.T) {
	var logged strings.Builder
	r := recovery{log: slog.New(slog.NewTextHandler(&logged, nil))}
	_, err := r.unary(context.Background(), nil, &grpc.UnaryServerInfo{FullMethod: "/x/Y"}, func(context.Context, any) (any, error) {
		panic("boom")
	})
	if status.Code(err) != codes.Internal || !strings.Contains(logged.String(), "panic in an RPC handler") || !strings.Contains(logged.String(), "/x/Y") {
		t.Errorf("unary panic: %v, logged %q", err, logged.String())
	}
	err = r.stream(nil, nil, &grpc.StreamServerInfo{FullMethod: "/x/Z"}, func(any, grpc.ServerStream) error { panic("boom") })
	if status.Code(err) != codes.Internal {
		t.Errorf("stream panic: %v, want INTERNAL", err)
	}
	if err := r.stream(nil, nil, &grpc.StreamServerInfo{FullMethod: "/x/Z"}, func(any, grpc.ServerStream) error { return nil }); err != nil {
		t.Errorf("stream without panic: %v", err)
	}
}
