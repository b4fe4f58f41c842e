#!/usr/bin/env bash
# Regenerates the Go code of tandem's gRPC API (proto/tandem/v1) from its
# .proto files. Needs protoc (Debian: apt-get install protobuf-compiler);
# protoc-gen-go and protoc-gen-go-grpc are the versions go.mod pins as tools.
# Also run by `go generate ./proto`.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
go build -o "$bin/protoc-gen-go" google.golang.org/protobuf/cmd/protoc-gen-go
go build -o "$bin/protoc-gen-go-grpc" google.golang.org/grpc/cmd/protoc-gen-go-grpc
cd proto
PATH="$bin:$PATH" protoc \
  --go_out=. --go_opt=paths=source_relative \
  --go-grpc_out=. --go-grpc_opt=paths=source_relative \
  tandem/v1/*.proto
