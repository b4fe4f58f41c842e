package gpu

import (
	"bytes"
	"errors"
	"fmt"
	"unsafe"
)

// Error is a failed call into a CUDA library. It carries the status code,
// its name and message as the library reports them.
type Error struct {
	// Lib is the library: "cuda" (the driver), "nvrtc", "cublas" or
	// "nccl".
	Lib string
	// Op is the C function that failed, e.g. "cuMemAlloc".
	Op string
	// Code is the status the function returned (CUresult, nvrtcResult,
	// cublasStatus_t or ncclResult_t).
	Code int
	// Name is the status's name, e.g. "CUDA_ERROR_OUT_OF_MEMORY".
	Name string
	// Msg is the library's description of the status.
	Msg string
	// Detail is further text the library gave: the NVRTC program log, or
	// NCCL's last error.
	Detail string
}

func (e *Error) Error() string {
	s := fmt.Sprintf("%s: %s (%d)", e.Op, e.Name, e.Code)
	if e.Msg != "" && e.Msg != e.Name {
		s += ": " + e.Msg
	}
	if e.Detail != "" {
		s += ": " + e.Detail
	}
	return s
}

// ErrNoDriver is wrapped by the errors of Init and Probe when no usable CUDA
// driver or device is present.
var ErrNoDriver = errors.New("no CUDA driver")

// ErrNotInitialized is returned by calls made before Init succeeded.
var ErrNotInitialized = errors.New("gpu: not initialized (call gpu.Init)")

// Status codes the package acts on.
const (
	cudaSuccess         = 0
	cudaErrorNotReady   = 600
	nvrtcSuccess        = 0
	cublasStatusSuccess = 0
	ncclSuccess         = 0
	ncclInProgress      = 7
)

// IsNotReady reports whether err is CUDA_ERROR_NOT_READY.
func IsNotReady(err error) bool {
	var e *Error
	return errors.As(err, &e) && e.Lib == "cuda" && e.Code == cudaErrorNotReady
}

// cublasStatusNames are the names of cublasStatus_t values, used when the
// library lacks cublasGetStatusName.
var cublasStatusNames = map[int32]string{
	0:  "CUBLAS_STATUS_SUCCESS",
	1:  "CUBLAS_STATUS_NOT_INITIALIZED",
	3:  "CUBLAS_STATUS_ALLOC_FAILED",
	7:  "CUBLAS_STATUS_INVALID_VALUE",
	8:  "CUBLAS_STATUS_ARCH_MISMATCH",
	11: "CUBLAS_STATUS_MAPPING_ERROR",
	13: "CUBLAS_STATUS_EXECUTION_FAILED",
	14: "CUBLAS_STATUS_INTERNAL_ERROR",
	15: "CUBLAS_STATUS_NOT_SUPPORTED",
	16: "CUBLAS_STATUS_LICENSE_ERROR",
}

// ncclResultNames are the names of ncclResult_t values (NCCL reports only a
// message).
var ncclResultNames = map[int32]string{
	0: "ncclSuccess",
	1: "ncclUnhandledCudaError",
	2: "ncclSystemError",
	3: "ncclInternalError",
	4: "ncclInvalidArgument",
	5: "ncclInvalidUsage",
	6: "ncclRemoteError",
	7: "ncclInProgress",
}

// nvrtcResultNames are the names of nvrtcResult values, used when
// nvrtcGetErrorString is unavailable.
var nvrtcResultNames = map[int32]string{
	0:  "NVRTC_SUCCESS",
	1:  "NVRTC_ERROR_OUT_OF_MEMORY",
	2:  "NVRTC_ERROR_PROGRAM_CREATION_FAILURE",
	3:  "NVRTC_ERROR_INVALID_INPUT",
	4:  "NVRTC_ERROR_INVALID_PROGRAM",
	5:  "NVRTC_ERROR_INVALID_OPTION",
	6:  "NVRTC_ERROR_COMPILATION",
	7:  "NVRTC_ERROR_BUILTIN_OPERATION_FAILURE",
	8:  "NVRTC_ERROR_NO_NAME_EXPRESSIONS_AFTER_COMPILATION",
	9:  "NVRTC_ERROR_NO_LOWERED_NAMES_BEFORE_COMPILATION",
	10: "NVRTC_ERROR_NAME_EXPRESSION_NOT_VALID",
	11: "NVRTC_ERROR_INTERNAL_ERROR",
}

// statusName looks code up in names, with a fallback that still shows the
// code's family.
func statusName(names map[int32]string, family string, code int32) string {
	if n, ok := names[code]; ok {
		return n
	}
	return fmt.Sprintf("%s_UNKNOWN_%d", family, code)
}

// goString copies the NUL-terminated C string at p (empty for NULL).
func goString(p uintptr) string {
	if p == 0 {
		return ""
	}
	base := *(*unsafe.Pointer)(unsafe.Pointer(&p))
	n := 0
	for *(*byte)(unsafe.Add(base, n)) != 0 {
		n++
	}
	return string(unsafe.Slice((*byte)(base), n))
}

// cStringBytes is the text of a NUL-terminated string written into b.
func cStringBytes(b []byte) string {
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	return string(b)
}

// cString returns s as a NUL-terminated byte slice for passing to C.
func cString(s string) []byte {
	b := make([]byte, len(s)+1)
	copy(b, s)
	return b
}
