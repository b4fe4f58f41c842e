package daemon

import (
	"context"
	"log/slog"
	"runtime/debug"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// recovery turns a panic in an RPC handler into an INTERNAL error for that
// call, logged with its stack, so that no request can crash the daemon.
type recovery struct{ log *slog.Logger }

func (r recovery) caught(method string, p any) error {
	r.log.Error("panic in an RPC handler", "method", method, "panic", p, "stack", string(debug.Stack()))
	return status.Errorf(codes.Internal, "%s: internal error (the daemon logged it)", method)
}

func (r recovery) unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (resp any, err error) {
	defer func() {
		if p := recover(); p != nil {
			resp, err = nil, r.caught(info.FullMethod, p)
		}
	}()
	return handler(ctx, req)
}

func (r recovery) stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = r.caught(info.FullMethod, p)
		}
	}()
	return handler(srv, ss)
}
