package gpu

import (
	"fmt"
	"math"
	"unsafe"

	"github.com/ebitengine/purego"
)

// Function is a kernel of a loaded module (CUfunction).
type Function struct {
	h    uintptr
	name string
}

// Name is the kernel's name.
func (f Function) Name() string { return f.name }

// SetMaxDynamicSharedMem lets launches of f use up to bytes of dynamic
// shared memory (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES); needed
// above 48 KiB. Device goroutine only.
func (f Function) SetMaxDynamicSharedMem(bytes int) error {
	const maxDynamicSharedSizeBytes = 8
	return f.setAttribute(maxDynamicSharedSizeBytes, bytes, "max dynamic shared memory")
}

// SetSharedCarveout sets the share of a multiprocessor's unified L1 and
// shared memory that f prefers as shared memory, in percent
// (CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT). Kernels that prefer
// different shares cannot share a multiprocessor: the device switches
// between them. Device goroutine only.
func (f Function) SetSharedCarveout(percent int) error {
	const preferredSharedMemoryCarveout = 9
	return f.setAttribute(preferredSharedMemoryCarveout, percent, "preferred shared memory carveout (%)")
}

// setAttribute sets f's attribute attr (a CUfunction_attribute) to v;
// what names it in the error.
func (f Function) setAttribute(attr, v int, what string) error {
	c, err := driver()
	if err != nil {
		return err
	}
	if err := c.check("cuFuncSetAttribute", c.funcSetAttribute.status(f.h, uintptr(attr), uintptr(v))); err != nil {
		return fmt.Errorf("kernel %s: set %s to %d: %w", f.name, what, v, err)
	}
	return nil
}

// Dim3 is a grid or block shape. Zero components count as 1.
type Dim3 struct{ X, Y, Z uint32 }

func (d Dim3) norm() Dim3 {
	if d.X == 0 {
		d.X = 1
	}
	if d.Y == 0 {
		d.Y = 1
	}
	if d.Z == 0 {
		d.Z = 1
	}
	return d
}

// KernelArgs holds the parameters of a kernel launch in the order of the
// kernel's signature. Build it once per call site and Reset it before each
// launch: after its buffers have grown, launches allocate nothing. Each
// parameter occupies its own 8-byte-aligned slot, as cuLaunchKernel reads
// it through a pointer.
type KernelArgs struct {
	words []uint64
	offs  []int
	ptrs  []unsafe.Pointer
	// ex holds a CUlaunchConfig and its attribute for LaunchDependent,
	// so that those launches allocate nothing after the first either.
	ex []uint64
}

// Reset drops all parameters, keeping the buffers.
func (a *KernelArgs) Reset() *KernelArgs {
	a.words = a.words[:0]
	a.offs = a.offs[:0]
	return a
}

// Len is the number of parameters.
func (a *KernelArgs) Len() int { return len(a.offs) }

func (a *KernelArgs) word(v uint64) *KernelArgs {
	a.offs = append(a.offs, len(a.words))
	a.words = append(a.words, v)
	return a
}

// Ptr appends a device pointer parameter (T* in the kernel).
func (a *KernelArgs) Ptr(p DevicePtr) *KernelArgs { return a.word(uint64(p)) }

// Int32 appends an int parameter.
func (a *KernelArgs) Int32(v int32) *KernelArgs { return a.word(uint64(uint32(v))) }

// Uint32 appends an unsigned int parameter.
func (a *KernelArgs) Uint32(v uint32) *KernelArgs { return a.word(uint64(v)) }

// Int64 appends a long long parameter.
func (a *KernelArgs) Int64(v int64) *KernelArgs { return a.word(uint64(v)) }

// Uint64 appends an unsigned long long parameter.
func (a *KernelArgs) Uint64(v uint64) *KernelArgs { return a.word(v) }

// Float32 appends a float parameter.
func (a *KernelArgs) Float32(v float32) *KernelArgs { return a.word(uint64(math.Float32bits(v))) }

// Bytes appends a parameter passed by value whose memory image is b (a
// struct of the kernel's signature, laid out as C lays it out). Its slot is
// 8-byte aligned.
func (a *KernelArgs) Bytes(b []byte) *KernelArgs {
	a.offs = append(a.offs, len(a.words))
	for i := 0; i < len(b); i += 8 {
		var w [8]byte
		copy(w[:], b[i:])
		a.words = append(a.words, *(*uint64)(unsafe.Pointer(&w)))
	}
	if len(b) == 0 {
		a.words = append(a.words, 0)
	}
	return a
}

// pointers fills and returns the array of parameter addresses that
// cuLaunchKernel takes (nil without parameters).
func (a *KernelArgs) pointers() unsafe.Pointer {
	if a == nil || len(a.offs) == 0 {
		return nil
	}
	a.ptrs = a.ptrs[:0]
	for _, o := range a.offs {
		a.ptrs = append(a.ptrs, unsafe.Pointer(&a.words[o]))
	}
	return unsafe.Pointer(&a.ptrs[0])
}

// Launch orders a launch of f on s with the given grid, block, dynamic
// shared memory and parameters (nil for none). Device goroutine only.
func (f Function) Launch(grid, block Dim3, sharedMem int, s Stream, args *KernelArgs) error {
	c, err := driver()
	if err != nil {
		return err
	}
	g, b := grid.norm(), block.norm()
	params := args.pointers()
	r, _, _ := purego.SyscallN(c.launchKernel.addr, f.h,
		uintptr(g.X), uintptr(g.Y), uintptr(g.Z),
		uintptr(b.X), uintptr(b.Y), uintptr(b.Z),
		uintptr(sharedMem), uintptr(s), uintptr(params), 0)
	if code := int32(uint32(r)); code != cudaSuccess {
		return fmt.Errorf("launch %s grid %v block %v shared %d: %w", f.name, g, b, sharedMem, c.check("cuLaunchKernel", code))
	}
	return nil
}

// LaunchDependentAvailable reports whether the driver can launch kernels
// with programmatic dependent launch (cuLaunchKernelEx).
func LaunchDependentAvailable() bool {
	c, err := driver()
	return err == nil && c.launchKernelEx.available() == nil
}

// Layout of the driver's CUlaunchConfig (56 bytes: grid and block sizes and
// the dynamic shared memory as seven unsigned ints, the stream at byte 32,
// the attribute array at 40, their count at 48) and of one CUlaunchAttribute
// (72 bytes: the id, padding to 8 bytes, a 64-byte value union), as words.
const (
	launchConfigWords = 7
	launchAttrWords   = 9
	// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
	attrProgrammaticStreamSerialization = 6
)

// LaunchDependent orders a launch of f on s like Launch, with programmatic
// dependent launch allowed (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION):
// the launch may begin while the kernel before it on s is still running,
// once every block of that kernel has executed griddepcontrol.launch_dependents
// (or exited), and f must execute griddepcontrol.wait before it touches
// anything the kernels before it write or read. Inside a stream capture
// the dependency becomes a programmatic edge of the graph. It fails when
// the driver lacks cuLaunchKernelEx (LaunchDependentAvailable). Device
// goroutine only.
func (f Function) LaunchDependent(grid, block Dim3, sharedMem int, s Stream, args *KernelArgs) error {
	c, err := driver()
	if err != nil {
		return err
	}
	if err := c.launchKernelEx.available(); err != nil {
		return fmt.Errorf("launch %s: %w", f.name, err)
	}
	g, b := grid.norm(), block.norm()
	if args == nil {
		args = &KernelArgs{}
	}
	params := args.pointers()
	if cap(args.ex) < launchConfigWords+launchAttrWords {
		args.ex = make([]uint64, launchConfigWords+launchAttrWords)
	}
	ex := args.ex[:launchConfigWords+launchAttrWords]
	clear(ex)
	attr := unsafe.Pointer(&ex[launchConfigWords])
	ex[0] = uint64(g.X) | uint64(g.Y)<<32
	ex[1] = uint64(g.Z) | uint64(b.X)<<32
	ex[2] = uint64(b.Y) | uint64(b.Z)<<32
	ex[3] = uint64(uint32(sharedMem))
	ex[4] = uint64(s)
	ex[5] = uint64(uintptr(attr))
	ex[6] = 1 // numAttrs
	ex[launchConfigWords] = attrProgrammaticStreamSerialization
	ex[launchConfigWords+1] = 1 // programmaticStreamSerializationAllowed
	code := c.launchKernelEx.status(uintptr(unsafe.Pointer(&ex[0])), f.h, uintptr(params), 0)
	if code != cudaSuccess {
		return fmt.Errorf("launch %s grid %v block %v shared %d (dependent): %w", f.name, g, b, sharedMem, c.check("cuLaunchKernelEx", code))
	}
	return nil
}
