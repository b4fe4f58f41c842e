package gpu

import (
	"errors"
	"strings"
	"testing"
)

// resetState forgets the loaded libraries now and after the test.
func resetState(t *testing.T) {
	reset := func() {
		state.mu.Lock()
		defer state.mu.Unlock()
		state.done, state.err, state.ld = false, nil, nil
		state.nvrtc = lazy[nvrtcLib]{}
		state.cublas = lazy[cublasLib]{}
		state.nccl = lazy[ncclLib]{}
		cu.Store(nil)
	}
	reset()
	t.Cleanup(reset)
}

// allSymbols gives every ABI name of a table an address, distinct per name.
func allSymbols(table []symbol) map[string]uintptr {
	m := map[string]uintptr{}
	for _, s := range table {
		for _, a := range s.abi {
			m[a] = uintptr(0x1000 + len(m))
		}
	}
	return m
}

func TestResolveVersionedNames(t *testing.T) {
	var c cudaLib
	syms := allSymbols(c.symbols())
	// The legacy unversioned symbols exist too, with older signatures:
	// they must not be the ones bound.
	for _, legacy := range []string{"cuMemAlloc", "cuMemFree", "cuMemcpyHtoD", "cuStreamDestroy", "cuGraphInstantiate", "cuDeviceTotalMem", "cuMemGetInfo"} {
		syms[legacy] = 0xbad
	}
	if err := resolve(&fakeLib{syms: syms}, "libcuda.so.1", c.symbols()); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		p   *proc
		abi string
	}{
		{&c.memAlloc, "cuMemAlloc_v2"},
		{&c.memFree, "cuMemFree_v2"},
		{&c.memcpyHtoD, "cuMemcpyHtoD_v2"},
		{&c.memcpyDtoDAsync, "cuMemcpyDtoDAsync_v2"},
		{&c.streamDestroy, "cuStreamDestroy_v2"},
		{&c.eventDestroy, "cuEventDestroy_v2"},
		{&c.streamBeginCapture, "cuStreamBeginCapture_v2"},
		{&c.graphInstantiate, "cuGraphInstantiateWithFlags"},
		{&c.deviceTotalMem, "cuDeviceTotalMem_v2"},
		{&c.primaryCtxRelease, "cuDevicePrimaryCtxRelease_v2"},
		{&c.memGetInfo, "cuMemGetInfo_v2"},
		{&c.eventElapsedTime, "cuEventElapsedTime_v2"},
	} {
		if tc.p.addr != syms[tc.abi] {
			t.Errorf("%s bound to %#x, want %s at %#x", tc.p.name, tc.p.addr, tc.abi, syms[tc.abi])
		}
	}
	var b cublasLib
	bs := allSymbols(b.symbols())
	bs["cublasCreate"] = 0xbad
	if err := resolve(&fakeLib{syms: bs}, "libcublas.so.13", b.symbols()); err != nil {
		t.Fatal(err)
	}
	if b.create.addr != bs["cublasCreate_v2"] || b.gemmEx.addr != bs["cublasGemmEx"] {
		t.Errorf("cuBLAS bound create %#x gemm %#x", b.create.addr, b.gemmEx.addr)
	}
}

func TestResolveFallbackName(t *testing.T) {
	var c cudaLib
	syms := allSymbols(c.symbols())
	delete(syms, "cuEventElapsedTime_v2") // drivers before CUDA 12.8
	if err := resolve(&fakeLib{syms: syms}, "libcuda.so.1", c.symbols()); err != nil {
		t.Fatal(err)
	}
	if c.eventElapsedTime.addr != syms["cuEventElapsedTime"] {
		t.Fatalf("cuEventElapsedTime bound to %#x, want the unversioned symbol", c.eventElapsedTime.addr)
	}
}

func TestResolveMissingRequired(t *testing.T) {
	var c cudaLib
	syms := allSymbols(c.symbols())
	delete(syms, "cuMemAlloc_v2")
	delete(syms, "cuGraphInstantiateWithFlags")
	syms["cuMemAlloc"] = 0x1 // the legacy symbol does not count
	err := resolve(&fakeLib{syms: syms}, "libcuda.so.1", c.symbols())
	if err == nil {
		t.Fatal("resolve succeeded without cuMemAlloc_v2")
	}
	want := "libcuda.so.1: required symbols not found: cuMemAlloc_v2, cuGraphInstantiateWithFlags"
	if err.Error() != want {
		t.Fatalf("err = %q, want %q", err, want)
	}
}

func TestResolveMissingOptional(t *testing.T) {
	var c cudaLib
	syms := allSymbols(c.symbols())
	delete(syms, "cuGraphGetNodes")
	if err := resolve(&fakeLib{syms: syms}, "libcuda.so.1", c.symbols()); err != nil {
		t.Fatalf("optional symbol missing: %v", err)
	}
	err := c.graphGetNodes.available()
	if !errors.Is(err, errUnavailable) || !strings.Contains(err.Error(), "cuGraphGetNodes") || !strings.Contains(err.Error(), "libcuda.so.1") {
		t.Fatalf("available() = %v", err)
	}
	if c.memAlloc.available() != nil {
		t.Fatal("bound symbol reported unavailable")
	}
	// Through the public API: the graph call fails, naming the symbol.
	resetState(t)
	cu.Store(&c)
	_, err = Graph(1).NodeCount()
	if !errors.Is(err, errUnavailable) {
		t.Fatalf("NodeCount without cuGraphGetNodes: %v", err)
	}
}

func TestStatusTables(t *testing.T) {
	tests := []struct {
		names  map[int32]string
		family string
		code   int32
		want   string
	}{
		{cublasStatusNames, "CUBLAS_STATUS", 7, "CUBLAS_STATUS_INVALID_VALUE"},
		{cublasStatusNames, "CUBLAS_STATUS", 13, "CUBLAS_STATUS_EXECUTION_FAILED"},
		{cublasStatusNames, "CUBLAS_STATUS", 99, "CUBLAS_STATUS_UNKNOWN_99"},
		{ncclResultNames, "ncclResult", 6, "ncclRemoteError"},
		{ncclResultNames, "ncclResult", 2, "ncclSystemError"},
		{nvrtcResultNames, "NVRTC_ERROR", 6, "NVRTC_ERROR_COMPILATION"},
	}
	for _, tc := range tests {
		if got := statusName(tc.names, tc.family, tc.code); got != tc.want {
			t.Errorf("statusName(%s, %d) = %q, want %q", tc.family, tc.code, got, tc.want)
		}
	}
}

func TestErrorText(t *testing.T) {
	tests := []struct {
		e    Error
		want string
	}{
		{Error{Lib: "cuda", Op: "cuMemAlloc", Code: 2, Name: "CUDA_ERROR_OUT_OF_MEMORY", Msg: "out of memory"}, "cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory"},
		{Error{Lib: "nvrtc", Op: "nvrtcCompileProgram", Code: 6, Name: "NVRTC_ERROR_COMPILATION", Detail: "k.cu(3): error: x"}, "nvrtcCompileProgram: NVRTC_ERROR_COMPILATION (6): k.cu(3): error: x"},
		{Error{Lib: "cublas", Op: "cublasGemmEx", Code: 7, Name: "CUBLAS_STATUS_INVALID_VALUE", Msg: "CUBLAS_STATUS_INVALID_VALUE"}, "cublasGemmEx: CUBLAS_STATUS_INVALID_VALUE (7)"},
	}
	for _, tc := range tests {
		if got := tc.e.Error(); got != tc.want {
			t.Errorf("Error() = %q, want %q", got, tc.want)
		}
	}
	if !IsNotReady(&Error{Lib: "cuda", Code: 600}) || IsNotReady(&Error{Lib: "nccl", Code: 600}) {
		t.Error("IsNotReady")
	}
}
