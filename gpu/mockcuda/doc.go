// Package mockcuda is a test helper: it builds and drives the mock CUDA library of
// gpu/testdata/mockabi.c for GPU-free tests of package gpu and its users.
//
// # Usage
//
//	path, err := mockcuda.Build(dir) // errors.Is(err, mockcuda.ErrNoCompiler): skip
//	m, err := mockcuda.Open(path)
//	gpu.Init(gpu.Config{LibCUDA: path, NVRTC: path, CUBLAS: path, NCCL: path})
//	m.SetBusy(true) // streams and events stop completing
//
// # Concurrency
//
// The mock's state is process-wide: tests that use it must not run in
// parallel.
package mockcuda
