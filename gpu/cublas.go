package gpu

import (
	"fmt"
	"unsafe"
)

// cublasLib is cuBLAS's symbol table.
type cublasLib struct {
	path string
	lib  library
	pre  []library

	create, destroy, setStream, setWorkspace, gemmEx, getStatusName,
	getStatusString, getVersion proc
}

func (b *cublasLib) symbols() []symbol {
	return []symbol{
		required(&b.create, "cublasCreate", "cublasCreate_v2"),
		required(&b.destroy, "cublasDestroy", "cublasDestroy_v2"),
		required(&b.setStream, "cublasSetStream", "cublasSetStream_v2"),
		required(&b.setWorkspace, "cublasSetWorkspace", "cublasSetWorkspace_v2"),
		required(&b.gemmEx, "cublasGemmEx"),
		required(&b.getVersion, "cublasGetVersion", "cublasGetVersion_v2"),
		optional(&b.getStatusName, "cublasGetStatusName"),
		optional(&b.getStatusString, "cublasGetStatusString"),
	}
}

func loadCUBLAS(ld *loader) (*cublasLib, error) {
	lib, path, pre, err := ld.load(specCUBLAS)
	if err != nil {
		return nil, fmt.Errorf("load cuBLAS: %w", err)
	}
	b := &cublasLib{path: path, lib: lib, pre: pre}
	if err := resolve(lib, path, b.symbols()); err != nil {
		return nil, fmt.Errorf("load cuBLAS: %w", err)
	}
	return b, nil
}

func cublas() (*cublasLib, error) { return loadLazy(&state.cublas, loadCUBLAS) }

// check turns a cublasStatus_t into an *Error (nil on success).
func (b *cublasLib) check(op string, code int32) error {
	if code == cublasStatusSuccess {
		return nil
	}
	e := &Error{Lib: "cublas", Op: op, Code: int(code)}
	if b.getStatusName.available() == nil {
		e.Name = goString(b.getStatusName.call(uintptr(code)))
	}
	if e.Name == "" {
		e.Name = statusName(cublasStatusNames, "CUBLAS_STATUS", code)
	}
	if b.getStatusString.available() == nil {
		e.Msg = goString(b.getStatusString.call(uintptr(code)))
	}
	return e
}

// DataType is a cudaDataType_t element type of a GEMM operand.
type DataType int32

// Element types of GEMM operands.
const (
	R32F  DataType = 0  // CUDA_R_32F
	R16F  DataType = 2  // CUDA_R_16F
	R16BF DataType = 14 // CUDA_R_16BF
)

// Op says whether a GEMM operand is used as stored or transposed
// (cublasOperation_t).
type Op int32

// GEMM operand operations.
const (
	OpN Op = 0 // as stored
	OpT Op = 1 // transposed
)

// BLAS is a cuBLAS handle bound to the context current where it was made.
// Use it on its device goroutine only.
type BLAS struct {
	lib *cublasLib
	h   uintptr
}

// NewBLAS creates a cuBLAS handle for the current device. Device goroutine
// only.
func NewBLAS() (*BLAS, error) {
	b, err := cublas()
	if err != nil {
		return nil, err
	}
	var h uintptr
	if err := b.check("cublasCreate", b.create.status(uintptr(unsafe.Pointer(&h)))); err != nil {
		return nil, err
	}
	return &BLAS{lib: b, h: h}, nil
}

// Version is the loaded cuBLAS's version, e.g. 130100. Device
// goroutine only.
func (b *BLAS) Version() (int, error) {
	var v int32
	if err := b.lib.check("cublasGetVersion", b.lib.getVersion.status(b.h, uintptr(unsafe.Pointer(&v)))); err != nil {
		return 0, err
	}
	return int(v), nil
}

// SetStream makes later calls order their work on s.
func (b *BLAS) SetStream(s Stream) error {
	return b.lib.check("cublasSetStream", b.lib.setStream.status(b.h, uintptr(s)))
}

// SetWorkspace gives cuBLAS a workspace of its own, so that it allocates
// nothing while a stream is captured. 32 MiB suits Hopper.
func (b *BLAS) SetWorkspace(ws Mem) error {
	return b.lib.check("cublasSetWorkspace", b.lib.setWorkspace.status(b.h, uintptr(ws.ptr), uintptr(ws.n)))
}

// Gemm computes C = alpha·op(A)·op(B) + beta·C in cuBLAS's column-major
// convention (cublasGemmEx with CUBLAS_COMPUTE_32F and the default
// algorithm): op(A) is m×k, op(B) k×n, C m×n, each stored column-major with
// its leading dimension. Accumulation is fp32 whatever the element types.
func (b *BLAS) Gemm(opA, opB Op, m, n, k int, alpha float32, a DevicePtr, aType DataType, lda int,
	bm DevicePtr, bType DataType, ldb int, beta float32, c DevicePtr, cType DataType, ldc int) error {
	const compute32F = 68
	const gemmDefault = 0xFFFFFFFF // CUBLAS_GEMM_DEFAULT, -1 as a 32-bit int
	err := b.lib.check("cublasGemmEx", b.lib.gemmEx.status(b.h, uintptr(opA), uintptr(opB),
		uintptr(m), uintptr(n), uintptr(k), uintptr(unsafe.Pointer(&alpha)),
		uintptr(a), uintptr(aType), uintptr(lda),
		uintptr(bm), uintptr(bType), uintptr(ldb),
		uintptr(unsafe.Pointer(&beta)),
		uintptr(c), uintptr(cType), uintptr(ldc),
		compute32F, gemmDefault))
	if err != nil {
		return fmt.Errorf("gemm m=%d n=%d k=%d: %w", m, n, k, err)
	}
	return nil
}

// LinearBF16 computes y = x·Wᵀ + beta·y for row-major bf16 matrices, the
// layout of Hugging Face weights: x is tokens×in, w is out×in (a
// [out, in] weight tensor), y is tokens×out; fp32 accumulation. beta 0
// overwrites y; beta 1 adds to it (a residual).
//
// Row-major y (tokens×out) is column-major yᵀ (out×tokens), so this is
// yᵀ = W·xᵀ: cuBLAS's A is w read transposed (stored column-major in×out,
// lda=in), B is x as stored (in×tokens, ldb=in), C is y (ldc=out).
func (b *BLAS) LinearBF16(y, x, w DevicePtr, tokens, in, out int, beta float32) error {
	return b.Gemm(OpT, OpN, out, tokens, in, 1, w, R16BF, in, x, R16BF, in, beta, y, R16BF, out)
}

// Destroy destroys the handle.
func (b *BLAS) Destroy() error {
	return b.lib.check("cublasDestroy", b.lib.destroy.status(b.h))
}
