package gpu

import (
	"errors"
	"fmt"
	"strings"

	"github.com/ebitengine/purego"
)

// library is the dlopen seam: a loaded shared object whose symbols can be
// looked up. The real implementation wraps purego.Dlopen; tests use fakes.
type library interface {
	// Lookup returns the address of the named symbol.
	Lookup(sym string) (uintptr, error)
	Close() error
}

// dlLibrary is a library loaded with dlopen.
type dlLibrary struct {
	path   string
	handle uintptr
}

// dlopenLibrary loads path with RTLD_NOW, and RTLD_GLOBAL when global is set
// (libraries that others resolve symbols from: libcublasLt,
// libnvrtc-builtins).
func dlopenLibrary(path string, global bool) (library, error) {
	mode := purego.RTLD_NOW | purego.RTLD_LOCAL
	if global {
		mode = purego.RTLD_NOW | purego.RTLD_GLOBAL
	}
	h, err := purego.Dlopen(path, mode)
	if err != nil {
		return nil, fmt.Errorf("dlopen %s: %w", path, err)
	}
	return &dlLibrary{path: path, handle: h}, nil
}

func (l *dlLibrary) Lookup(sym string) (uintptr, error) {
	a, err := purego.Dlsym(l.handle, sym)
	if err != nil {
		return 0, fmt.Errorf("dlsym %s in %s: %w", sym, l.path, err)
	}
	return a, nil
}

func (l *dlLibrary) Close() error {
	if err := purego.Dlclose(l.handle); err != nil {
		return fmt.Errorf("dlclose %s: %w", l.path, err)
	}
	return nil
}

// proc is one C function of a loaded library, bound by address.
type proc struct {
	name     string   // the name in the C headers, e.g. cuMemAlloc
	abi      []string // the exported symbols tried in order, e.g. cuMemAlloc_v2
	optional bool
	lib      string // the file it came from, for messages
	addr     uintptr
}

// symbol ties a proc to its entry in a symbol table.
type symbol struct {
	p        *proc
	name     string
	abi      []string
	optional bool
}

// required declares a symbol that must resolve. abi lists the exported names
// to try in order; when empty the header name is the ABI name.
func required(p *proc, name string, abi ...string) symbol {
	if len(abi) == 0 {
		abi = []string{name}
	}
	return symbol{p: p, name: name, abi: abi}
}

// optional declares a symbol whose absence leaves a proc that errors when
// called.
func optional(p *proc, name string, abi ...string) symbol {
	s := required(p, name, abi...)
	s.optional = true
	return s
}

// resolve binds every symbol of the table to its address in lib, which was
// loaded from path. A missing required symbol is an error naming it; a
// missing optional one leaves its proc unavailable.
func resolve(lib library, path string, table []symbol) error {
	var missing []string
	for _, s := range table {
		*s.p = proc{name: s.name, abi: s.abi, optional: s.optional, lib: path}
		for _, abi := range s.abi {
			if a, err := lib.Lookup(abi); err == nil && a != 0 {
				s.p.addr = a
				break
			}
		}
		if s.p.addr == 0 && !s.optional {
			missing = append(missing, strings.Join(s.abi, " or "))
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("%s: required symbols not found: %s", path, strings.Join(missing, ", "))
	}
	return nil
}

// errUnavailable reports a call of an optional symbol the library lacks.
var errUnavailable = errors.New("symbol not available")

// available returns nil when the proc is bound, else an error naming it.
func (p *proc) available() error {
	if p.addr == 0 {
		return fmt.Errorf("%s (%s) in %s: %w", p.name, strings.Join(p.abi, " or "), p.lib, errUnavailable)
	}
	return nil
}

// call invokes the proc with integer-class arguments and returns the raw
// value of the integer return register. Callers that pass Go pointers
// convert them in the argument list, so that go:uintptrescapes keeps the
// pointed-to memory alive and in place for the call.
//
//go:uintptrescapes
func (p *proc) call(args ...uintptr) uintptr {
	r, _, _ := purego.SyscallN(p.addr, args...)
	return r
}

// status invokes a proc returning a 32-bit status enum (CUresult,
// nvrtcResult, cublasStatus_t, ncclResult_t); the upper half of the return
// register is undefined and is dropped.
//
//go:uintptrescapes
func (p *proc) status(args ...uintptr) int32 {
	r, _, _ := purego.SyscallN(p.addr, args...)
	return int32(uint32(r))
}
