// Package tandemv1 is the generated Go code of tandem's gRPC API, package
// tandem.v1: Inference (Generate, the public API of the leader), Admin
// (Status, for operators) and Node (the leader's management of the other
// daemons' stages). The .proto files next to it are the source; regenerate
// with `go generate ./proto` after editing them, never edit the .pb.go
// files by hand.
//
// # Usage
//
//	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
//	...
//	stream, err := tandemv1.NewInferenceClient(conn).Generate(ctx, &tandemv1.GenerateRequest{Prompt: "Hello", MaxTokens: 32})
//
// # Concurrency
//
// Clients are safe for concurrent use, as gRPC clients are; messages are
// not: a message must not be read while another goroutine modifies it.
package tandemv1
