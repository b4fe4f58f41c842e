#!/usr/bin/env bash
# Regenerates the Go code of tandem's protobuf definitions: the gRPC API
# (proto/tandem/v1, Go code beside it) and the internal control protocol
# (proto/tandem/control/v1, Go code in pipeline/controlpb). Needs protoc
# (Debian: apt-get install protobuf-compiler); protoc-gen-go and
# protoc-gen-go-grpc are the versions go.mod pins as tools. Also run by
# `go generate ./proto`.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
go build -o "$bin/protoc-gen-go" google.golang.org/protobuf/cmd/protoc-gen-go
go build -o "$bin/protoc-gen-go-grpc" google.golang.org/grpc/cmd/protoc-gen-go-grpc
PATH="$bin:$PATH" protoc -I proto \
  --go_out=proto --go_opt=paths=source_relative \
  --go-grpc_out=proto --go-grpc_opt=paths=source_relative \
  proto/tandem/v1/*.proto
PATH="$bin:$PATH" protoc -I proto \
  --go_out=. --go_opt=module=github.com/tandem-llm/tandem \
  proto/tandem/control/v1/*.proto
