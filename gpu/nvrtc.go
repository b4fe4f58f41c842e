package gpu

import (
	"fmt"
	"unsafe"
)

// nvrtcLib is NVRTC's symbol table.
type nvrtcLib struct {
	path string
	lib  library
	pre  []library

	version, createProgram, compileProgram, getProgramLogSize, getProgramLog,
	getCUBINSize, getCUBIN, getPTXSize, getPTX, destroyProgram,
	getErrorString proc
}

func (n *nvrtcLib) symbols() []symbol {
	return []symbol{
		required(&n.version, "nvrtcVersion"),
		required(&n.createProgram, "nvrtcCreateProgram"),
		required(&n.compileProgram, "nvrtcCompileProgram"),
		required(&n.getProgramLogSize, "nvrtcGetProgramLogSize"),
		required(&n.getProgramLog, "nvrtcGetProgramLog"),
		required(&n.getCUBINSize, "nvrtcGetCUBINSize"),
		required(&n.getCUBIN, "nvrtcGetCUBIN"),
		required(&n.getPTXSize, "nvrtcGetPTXSize"),
		required(&n.getPTX, "nvrtcGetPTX"),
		required(&n.destroyProgram, "nvrtcDestroyProgram"),
		required(&n.getErrorString, "nvrtcGetErrorString"),
	}
}

func loadNVRTC(ld *loader) (*nvrtcLib, error) {
	lib, path, pre, err := ld.load(specNVRTC)
	if err != nil {
		return nil, fmt.Errorf("load NVRTC: %w", err)
	}
	n := &nvrtcLib{path: path, lib: lib, pre: pre}
	if err := resolve(lib, path, n.symbols()); err != nil {
		return nil, fmt.Errorf("load NVRTC: %w", err)
	}
	return n, nil
}

func nvrtc() (*nvrtcLib, error) { return loadLazy(&state.nvrtc, loadNVRTC) }

// check turns an nvrtcResult into an *Error (nil on success).
func (n *nvrtcLib) check(op string, code int32) error {
	if code == nvrtcSuccess {
		return nil
	}
	name := goString(n.getErrorString.call(uintptr(code)))
	if name == "" {
		name = statusName(nvrtcResultNames, "NVRTC_ERROR", code)
	}
	return &Error{Lib: "nvrtc", Op: op, Code: int(code), Name: name}
}

// NVRTCVersion is the version of the loaded NVRTC.
func NVRTCVersion() (major, minor int, err error) {
	n, err := nvrtc()
	if err != nil {
		return 0, 0, err
	}
	var ma, mi int32
	if err := n.check("nvrtcVersion", n.version.status(uintptr(unsafe.Pointer(&ma)), uintptr(unsafe.Pointer(&mi)))); err != nil {
		return 0, 0, err
	}
	return int(ma), int(mi), nil
}

// Compiled is the output of Compile.
type Compiled struct {
	// Image is the CUBIN, or NUL-terminated PTX when PTX is set; either
	// can be given to LoadModule.
	Image []byte
	PTX   bool
	// Log is the compiler's log (warnings), possibly empty.
	Log string
}

// Compile compiles CUDA C++ source with NVRTC. name names the source in
// messages; opts are nvcc-style options, e.g. "--gpu-architecture=sm_90",
// "-default-device", "-std=c++17". With a real architecture (sm_XX) the
// result is CUBIN; with a virtual one (compute_XX) NVRTC makes only PTX,
// which is returned instead. A failed compilation's error includes the log.
// Compile may be called from any goroutine.
func Compile(src, name string, opts ...string) (Compiled, error) {
	n, err := nvrtc()
	if err != nil {
		return Compiled{}, err
	}
	var prog uintptr
	csrc, cname := cString(src), cString(name)
	if err := n.check("nvrtcCreateProgram", n.createProgram.status(uintptr(unsafe.Pointer(&prog)),
		uintptr(unsafe.Pointer(&csrc[0])), uintptr(unsafe.Pointer(&cname[0])), 0, 0, 0)); err != nil {
		return Compiled{}, fmt.Errorf("compile %s: %w", name, err)
	}
	defer n.destroyProgram.status(uintptr(unsafe.Pointer(&prog)))

	copts := make([][]byte, len(opts))
	optPtrs := make([]unsafe.Pointer, len(opts)+1)
	for i, o := range opts {
		copts[i] = cString(o)
		optPtrs[i] = unsafe.Pointer(&copts[i][0])
	}
	compileErr := n.check("nvrtcCompileProgram", n.compileProgram.status(prog, uintptr(len(opts)), uintptr(unsafe.Pointer(&optPtrs[0]))))
	log := n.programLog(prog)
	if compileErr != nil {
		if e, ok := compileErr.(*Error); ok {
			e.Detail = log
		}
		return Compiled{}, fmt.Errorf("compile %s: %w", name, compileErr)
	}
	out := Compiled{Log: log}
	var size uintptr
	if err := n.check("nvrtcGetCUBINSize", n.getCUBINSize.status(prog, uintptr(unsafe.Pointer(&size)))); err == nil && size > 0 {
		out.Image = make([]byte, size)
		if err := n.check("nvrtcGetCUBIN", n.getCUBIN.status(prog, uintptr(unsafe.Pointer(&out.Image[0])))); err != nil {
			return Compiled{}, fmt.Errorf("compile %s: %w", name, err)
		}
		return out, nil
	}
	if err := n.check("nvrtcGetPTXSize", n.getPTXSize.status(prog, uintptr(unsafe.Pointer(&size)))); err != nil {
		return Compiled{}, fmt.Errorf("compile %s: %w", name, err)
	}
	if size == 0 {
		return Compiled{}, fmt.Errorf("compile %s: NVRTC produced neither CUBIN nor PTX", name)
	}
	out.Image = make([]byte, size)
	if err := n.check("nvrtcGetPTX", n.getPTX.status(prog, uintptr(unsafe.Pointer(&out.Image[0])))); err != nil {
		return Compiled{}, fmt.Errorf("compile %s: %w", name, err)
	}
	out.PTX = true
	return out, nil
}

// programLog returns the program's log without its trailing NUL.
func (n *nvrtcLib) programLog(prog uintptr) string {
	var size uintptr
	if n.getProgramLogSize.status(prog, uintptr(unsafe.Pointer(&size))) != nvrtcSuccess || size <= 1 {
		return ""
	}
	buf := make([]byte, size)
	if n.getProgramLog.status(prog, uintptr(unsafe.Pointer(&buf[0]))) != nvrtcSuccess {
		return ""
	}
	return cStringBytes(buf)
}
