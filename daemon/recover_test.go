package daemon

import (
	"context"
	"log/slog"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

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
