package mockcuda

import (
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"runtime"

	"github.com/ebitengine/purego"
)

// ErrNoCompiler is returned by Build when no C compiler is installed.
var ErrNoCompiler = errors.New("no C compiler (cc) to build the mock CUDA library")

// Build compiles the mock into dir with the host C compiler and returns the
// shared library's path.
func Build(dir string) (string, error) {
	cc, err := exec.LookPath("cc")
	if err != nil {
		return "", ErrNoCompiler
	}
	_, self, _, _ := runtime.Caller(0)
	src := filepath.Join(filepath.Dir(self), "..", "testdata", "mockabi.c")
	out := filepath.Join(dir, "libmockcuda.so")
	cmd := exec.Command(cc, "-shared", "-fPIC", "-O1", "-Wall", "-o", out, src)
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build mock %s: %w\n%s", src, err, b)
	}
	return out, nil
}

// Lib drives a loaded mock.
type Lib struct {
	reset         func()
	setBusy       func(int32)
	setAsyncError func(int32)
	aborts        func() int32
	lastLaunch    func(*[11]uint64)
	lastGemm      func(*[19]uint64, *float32, *float32)
	lastInit      func(*[4]uint64)
	lastOptions   func(*byte, int32)
	lastFuncAttr  func(*[3]int32)
	uniqueIDSize  func() uintptr
	lastConfig    func(*[4]uint64)
}

// Open loads the mock at path (the same handle package gpu gets).
func Open(path string) (*Lib, error) {
	h, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_GLOBAL)
	if err != nil {
		return nil, fmt.Errorf("open mock %s: %w", path, err)
	}
	m := &Lib{}
	for name, fn := range map[string]any{
		"mock_reset":           &m.reset,
		"mock_set_busy":        &m.setBusy,
		"mock_set_async_error": &m.setAsyncError,
		"mock_aborts":          &m.aborts,
		"mock_last_launch":     &m.lastLaunch,
		"mock_last_gemm":       &m.lastGemm,
		"mock_last_init":       &m.lastInit,
		"mock_last_options":    &m.lastOptions,
		"mock_last_func_attr":  &m.lastFuncAttr,
		"mock_unique_id_size":  &m.uniqueIDSize,
		"mock_last_config":     &m.lastConfig,
	} {
		sym, err := purego.Dlsym(h, name)
		if err != nil {
			return nil, fmt.Errorf("mock %s: %w", path, err)
		}
		purego.RegisterFunc(fn, sym)
	}
	return m, nil
}

// Reset clears the recorded calls, the injected conditions and the NCCL
// messages sent but not yet received.
func (m *Lib) Reset() { m.reset() }

// SetBusy makes streams and events report CUDA_ERROR_NOT_READY and
// non-blocking NCCL work stay in progress forever (a peer that is gone).
func (m *Lib) SetBusy(b bool) {
	v := int32(0)
	if b {
		v = 1
	}
	m.setBusy(v)
}

// SetAsyncError sets what ncclCommGetAsyncError reports.
func (m *Lib) SetAsyncError(code int32) { m.setAsyncError(code) }

// Aborts counts ncclCommAbort calls since Reset.
func (m *Lib) Aborts() int { return int(m.aborts()) }

// LastLaunch is the 11 arguments of the last cuLaunchKernel call, as the C
// side received them.
func (m *Lib) LastLaunch() [11]uint64 {
	var v [11]uint64
	m.lastLaunch(&v)
	return v
}

// LastGemm is the 19 arguments of the last cublasGemmEx call and the alpha
// and beta it read through its pointer arguments.
func (m *Lib) LastGemm() (args [19]uint64, alpha, beta float32) {
	m.lastGemm(&args, &alpha, &beta)
	return args, alpha, beta
}

// LastInit is ncclCommInitRank's nranks, rank, the FNV-1a checksum of the
// unique id it received by value, and 1 once it was called.
func (m *Lib) LastInit() [4]uint64 {
	var v [4]uint64
	m.lastInit(&v)
	return v
}

// LastOptions is the options of the last NVRTC compile, space-separated.
func (m *Lib) LastOptions() string {
	buf := make([]byte, 1024)
	m.lastOptions(&buf[0], int32(len(buf)))
	for i, c := range buf {
		if c == 0 {
			return string(buf[:i])
		}
	}
	return string(buf)
}

// LastFuncAttr is the last cuFuncSetAttribute call: whether the function
// was vec_add (1), the attribute and the value.
func (m *Lib) LastFuncAttr() [3]int32 {
	var v [3]int32
	m.lastFuncAttr(&v)
	return v
}

// UniqueIDSize is sizeof(ncclUniqueId) in C.
func (m *Lib) UniqueIDSize() int { return int(m.uniqueIDSize()) }

// LastConfig is the ncclConfig_t of the last ncclCommInitRankConfig call:
// size, magic, version and blocking.
func (m *Lib) LastConfig() [4]uint64 {
	var v [4]uint64
	m.lastConfig(&v)
	return v
}
