// Package proto holds the protobuf definitions of tandem's gRPC API
// (package tandem.v1, in tandem/v1/*.proto) and of the internal control
// protocol between the leader and its stages (package tandem.control.v1,
// in tandem/control/v1/control.proto), and regenerates their Go code
// (package tandemv1, in tandem/v1; package controlpb, in
// pipeline/controlpb, below proto in the import layering), which is
// committed so that building needs no protoc.
//
// # Usage
//
// Regenerate after editing a .proto file (needs protoc, from Debian's
// protobuf-compiler package; protoc-gen-go and protoc-gen-go-grpc are the
// versions go.mod pins as tools):
//
//	go generate ./proto
//
// # Concurrency
//
// The package has no code; see package tandemv1 for the generated types.
package proto

//go:generate ../scripts/gen-proto.sh
