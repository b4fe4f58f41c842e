package gpu

import (
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"
)

// state is the process-wide set of loaded libraries. The driver is loaded
// by Init; NVRTC, cuBLAS and NCCL on first use, with Init's Config.
var state struct {
	mu   sync.Mutex
	done bool  // Init ran
	err  error // Init's result
	ld   *loader

	nvrtc  lazy[nvrtcLib]
	cublas lazy[cublasLib]
	nccl   lazy[ncclLib]
}

// cu is the loaded driver, set once Init succeeds.
var cu atomic.Pointer[cudaLib]

// lazy is a library loaded on first use.
type lazy[T any] struct {
	done bool
	lib  *T
	err  error
}

// Init loads the CUDA driver library, binds its symbols and initializes it
// (cuInit). It fails, wrapping ErrNoDriver, when no driver library or no
// device is found; the message says what was searched. Init is idempotent:
// the first call's Config is used for every library and later calls return
// the first call's result.
func Init(cfg Config) error {
	return initWith(newLoader(cfg))
}

// Probe is Init with the default Config (environment and search only).
func Probe() error { return Init(Config{}) }

func initWith(ld *loader) error {
	state.mu.Lock()
	defer state.mu.Unlock()
	if state.done {
		return state.err
	}
	state.done = true
	state.ld = ld
	state.err = loadDriver(ld)
	return state.err
}

func loadDriver(ld *loader) error {
	lib, path, pre, err := ld.load(specCUDA)
	if err != nil {
		return fmt.Errorf("%w: %v", ErrNoDriver, err)
	}
	c := &cudaLib{path: path, lib: lib, pre: pre}
	if err := resolve(lib, path, c.symbols()); err != nil {
		return fmt.Errorf("%w: %v", ErrNoDriver, err)
	}
	if err := c.check("cuInit", c.init.status(0)); err != nil {
		return fmt.Errorf("%w: %v", ErrNoDriver, err)
	}
	var n int32
	if err := c.check("cuDeviceGetCount", c.deviceGetCount.status(uintptr(unsafe.Pointer(&n)))); err != nil {
		return fmt.Errorf("%w: %v", ErrNoDriver, err)
	}
	if n == 0 {
		return fmt.Errorf("%w: %s loaded but it reports no CUDA device", ErrNoDriver, path)
	}
	cu.Store(c)
	return nil
}

// driver returns the loaded driver, or ErrNotInitialized.
func driver() (*cudaLib, error) {
	c := cu.Load()
	if c == nil {
		return nil, ErrNotInitialized
	}
	return c, nil
}

// loadLazy loads a library on first use with Init's loader.
func loadLazy[T any](l *lazy[T], load func(*loader) (*T, error)) (*T, error) {
	state.mu.Lock()
	defer state.mu.Unlock()
	if !state.done {
		return nil, ErrNotInitialized
	}
	if state.err != nil {
		return nil, state.err
	}
	if !l.done {
		l.done = true
		l.lib, l.err = load(state.ld)
	}
	return l.lib, l.err
}
