// Package gputest checks package gpu and collective/nccl on a real GPU. It
// is tests only; every test skips when no CUDA driver is found, and the
// NCCL tests when fewer than two devices are present.
//
// # Usage
//
// Build here, run on a GPU machine (scripts/gpu-bindings-check.sh):
//
//	CGO_ENABLED=0 go test -c -o gputest.test ./gpu/gputest
//	NCCL_NVLS_ENABLE=0 ./gputest.test -test.v
//
// # Concurrency
//
// The tests run one after another; each opens its devices and closes them.
package gputest
