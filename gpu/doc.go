// Package gpu binds the CUDA driver, NVRTC, cuBLAS and NCCL at run time,
// without cgo: the libraries are opened with dlopen (purego) and their
// functions called by address, so tandem builds with CGO_ENABLED=0 and runs
// on machines without CUDA, where Init reports why no GPU can be used.
//
// # Libraries
//
// Init loads the driver (libcuda.so.1); NVRTC, cuBLAS and NCCL are loaded
// on first use. Each library is looked for, in order:
//
//  1. an explicit path: Config.LibCUDA/NVRTC/CUBLAS/NCCL, else the
//     environment variables TANDEM_LIBCUDA, TANDEM_NVRTC, TANDEM_CUBLAS,
//     TANDEM_NCCL (TANDEM_CUBLASLT / Config.CUBLASLt names the cuBLASLt to
//     preload); a failure here is final;
//  2. Config.LibDir or TANDEM_CUDA_LIBDIR (not for the driver);
//  3. the dynamic loader's search by soname (LD_LIBRARY_PATH, ld cache);
//  4. $CUDA_HOME and $CUDA_PATH, /usr/local/cuda, /usr/local/cuda-X.Y
//     (newest first), each lib64 and targets/<arch>-linux/lib (not for the
//     driver, whose toolkit compat copy must not shadow the installed one;
//     the driver is looked for in the system's driver directories instead);
//  5. NVIDIA's pip wheels: site-packages/nvidia/{cu13,cublas,cuda_nvrtc,
//     nccl}/lib under $VIRTUAL_ENV, /opt/torch/.venv, /usr/local/lib and
//     ~/.local.
//
// Found in a directory, libcublasLt is loaded (RTLD_GLOBAL) before
// libcublas and libnvrtc-builtins before libnvrtc. Which file was loaded is
// logged with slog. Functions are bound by their ABI names (cuMemAlloc_v2,
// cuGraphInstantiateWithFlags, ...); a missing required symbol fails the
// load naming it, a missing optional one (cuGraphGetNodes,
// cublasGetStatusName, ncclGetLastError) fails only its calls.
//
// Failed calls return *Error, carrying the library, the C function, the
// status code and its name and message.
//
// # Usage
//
//	if err := gpu.Init(gpu.Config{}); err != nil {
//		slog.Info("using CPU backend", "reason", err)
//	}
//	dev, err := gpu.Open(0)
//	...
//	err = dev.Do(func() error {
//		s, err := gpu.NewStream()
//		...
//		mod, err := gpu.LoadModule(compiled.Image)
//		fn, err := mod.Function("vec_add")
//		var args gpu.KernelArgs
//		args.Ptr(x.Ptr()).Ptr(y.Ptr()).Int32(n)
//		return fn.Launch(gpu.Dim3{X: blocks}, gpu.Dim3{X: 256}, 0, s, &args)
//	})
//
// GEMMs use cuBLAS's column-major convention (BLAS.Gemm); BLAS.LinearBF16
// does the row-major y = x·Wᵀ of Hugging Face [out, in] weights.
//
// # Concurrency
//
// CUDA makes a context current per OS thread. A Device owns one goroutine
// locked to its thread, with the device's primary context current; every
// call that touches the device (memory, streams, events, modules, launches,
// graphs, cuBLAS handles, NCCL communicator setup and p2p) must run inside
// Device.Do, which serializes calls from several goroutines. Functions
// documented "device goroutine only" fail with CUDA_ERROR_INVALID_CONTEXT
// (or act on another device) elsewhere. Do must not be called from inside
// Do. Device.LockThread makes the context current on the caller's own
// thread for loops of cheap queries (polling an event) that should not hop
// to the device goroutine per call, and for the NCCL transfers a link
// orders on its own (NCCLComm.P2P). Init, Probe, DeviceCount, DriverVersion, Compile, NVRTCVersion,
// NCCLVersion, NewNCCLUniqueID, NCCLComm.Abort, NCCLComm.AsyncError and
// NCCLComm.Ready may
// be called from any goroutine. Handles (Stream, Event, Module, BLAS,
// NCCLComm) belong to the device they were made on.
//
// Hot calls (kernel launch, async copies, graph launch, NCCL send and
// receive) go through purego.SyscallN with addresses resolved at load;
// graph replay is the cheapest way to issue many kernels.
package gpu
