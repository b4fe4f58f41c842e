package gpu

import (
	"fmt"
	"time"
	"unsafe"
)

// cudaLib is the driver library's symbol table.
type cudaLib struct {
	path string
	lib  library
	pre  []library

	init, driverGetVersion, deviceGetCount, deviceGet, deviceGetName,
	deviceGetAttribute, deviceTotalMem, primaryCtxRetain, primaryCtxRelease,
	ctxSetCurrent, ctxGetCurrent,
	memAlloc, memFree, memAllocHost, memFreeHost, memcpyHtoD, memcpyDtoH,
	memcpyHtoDAsync, memcpyDtoHAsync, memcpyDtoDAsync, memsetD32Async,
	memsetD8Async, memGetInfo,
	streamCreate, streamSynchronize, streamQuery, streamWaitEvent, streamDestroy,
	eventCreate, eventRecord, eventSynchronize, eventQuery, eventElapsedTime,
	eventDestroy,
	moduleLoadData, moduleGetFunction, moduleUnload, launchKernel, launchKernelEx,
	funcSetAttribute,
	streamBeginCapture, streamEndCapture, graphInstantiate, graphUpload,
	graphLaunch, graphExecDestroy, graphDestroy, graphGetNodes,
	getErrorName, getErrorString proc
}

// symbols is the driver's symbol table. The header names of many functions
// are macros for versioned ABI symbols; the unversioned symbols still exist
// with older signatures, so binding the wrong one fails silently.
func (c *cudaLib) symbols() []symbol {
	return []symbol{
		required(&c.init, "cuInit"),
		required(&c.driverGetVersion, "cuDriverGetVersion"),
		required(&c.deviceGetCount, "cuDeviceGetCount"),
		required(&c.deviceGet, "cuDeviceGet"),
		required(&c.deviceGetName, "cuDeviceGetName"),
		required(&c.deviceGetAttribute, "cuDeviceGetAttribute"),
		required(&c.deviceTotalMem, "cuDeviceTotalMem", "cuDeviceTotalMem_v2"),
		required(&c.primaryCtxRetain, "cuDevicePrimaryCtxRetain"),
		required(&c.primaryCtxRelease, "cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxRelease_v2"),
		required(&c.ctxSetCurrent, "cuCtxSetCurrent"),
		required(&c.ctxGetCurrent, "cuCtxGetCurrent"),
		required(&c.memAlloc, "cuMemAlloc", "cuMemAlloc_v2"),
		required(&c.memFree, "cuMemFree", "cuMemFree_v2"),
		required(&c.memAllocHost, "cuMemAllocHost", "cuMemAllocHost_v2"),
		required(&c.memFreeHost, "cuMemFreeHost"),
		required(&c.memcpyHtoD, "cuMemcpyHtoD", "cuMemcpyHtoD_v2"),
		required(&c.memcpyDtoH, "cuMemcpyDtoH", "cuMemcpyDtoH_v2"),
		required(&c.memcpyHtoDAsync, "cuMemcpyHtoDAsync", "cuMemcpyHtoDAsync_v2"),
		required(&c.memcpyDtoHAsync, "cuMemcpyDtoHAsync", "cuMemcpyDtoHAsync_v2"),
		required(&c.memcpyDtoDAsync, "cuMemcpyDtoDAsync", "cuMemcpyDtoDAsync_v2"),
		required(&c.memsetD32Async, "cuMemsetD32Async"),
		required(&c.memsetD8Async, "cuMemsetD8Async"),
		required(&c.memGetInfo, "cuMemGetInfo", "cuMemGetInfo_v2"),
		required(&c.streamCreate, "cuStreamCreate"),
		required(&c.streamSynchronize, "cuStreamSynchronize"),
		required(&c.streamQuery, "cuStreamQuery"),
		required(&c.streamWaitEvent, "cuStreamWaitEvent"),
		required(&c.streamDestroy, "cuStreamDestroy", "cuStreamDestroy_v2"),
		required(&c.eventCreate, "cuEventCreate"),
		required(&c.eventRecord, "cuEventRecord"),
		required(&c.eventSynchronize, "cuEventSynchronize"),
		required(&c.eventQuery, "cuEventQuery"),
		required(&c.eventElapsedTime, "cuEventElapsedTime", "cuEventElapsedTime_v2", "cuEventElapsedTime"),
		required(&c.eventDestroy, "cuEventDestroy", "cuEventDestroy_v2"),
		required(&c.moduleLoadData, "cuModuleLoadData"),
		required(&c.moduleGetFunction, "cuModuleGetFunction"),
		required(&c.moduleUnload, "cuModuleUnload"),
		required(&c.launchKernel, "cuLaunchKernel"),
		optional(&c.launchKernelEx, "cuLaunchKernelEx"),
		required(&c.funcSetAttribute, "cuFuncSetAttribute"),
		required(&c.streamBeginCapture, "cuStreamBeginCapture", "cuStreamBeginCapture_v2"),
		required(&c.streamEndCapture, "cuStreamEndCapture"),
		required(&c.graphInstantiate, "cuGraphInstantiate", "cuGraphInstantiateWithFlags"),
		required(&c.graphUpload, "cuGraphUpload"),
		required(&c.graphLaunch, "cuGraphLaunch"),
		required(&c.graphExecDestroy, "cuGraphExecDestroy"),
		required(&c.graphDestroy, "cuGraphDestroy"),
		optional(&c.graphGetNodes, "cuGraphGetNodes"),
		required(&c.getErrorName, "cuGetErrorName"),
		required(&c.getErrorString, "cuGetErrorString"),
	}
}

// check turns a CUresult into an *Error (nil on success).
func (c *cudaLib) check(op string, code int32) error {
	if code == cudaSuccess {
		return nil
	}
	e := &Error{Lib: "cuda", Op: op, Code: int(code)}
	var name, msg uintptr
	if c.getErrorName.status(uintptr(code), uintptr(unsafe.Pointer(&name))) == cudaSuccess {
		e.Name = goString(name)
	} else {
		e.Name = fmt.Sprintf("CUDA_ERROR_UNKNOWN_CODE_%d", code)
	}
	if c.getErrorString.status(uintptr(code), uintptr(unsafe.Pointer(&msg))) == cudaSuccess {
		e.Msg = goString(msg)
	}
	return e
}

// DriverVersion is the CUDA version the driver supports, e.g. 13000 for
// 13.0.
func DriverVersion() (int, error) {
	c, err := driver()
	if err != nil {
		return 0, err
	}
	var v int32
	if err := c.check("cuDriverGetVersion", c.driverGetVersion.status(uintptr(unsafe.Pointer(&v)))); err != nil {
		return 0, err
	}
	return int(v), nil
}

// DeviceCount is the number of CUDA devices.
func DeviceCount() (int, error) {
	c, err := driver()
	if err != nil {
		return 0, err
	}
	var n int32
	if err := c.check("cuDeviceGetCount", c.deviceGetCount.status(uintptr(unsafe.Pointer(&n)))); err != nil {
		return 0, err
	}
	return int(n), nil
}

// DevicePtr is a device memory address (CUdeviceptr).
type DevicePtr uintptr

// Mem is a range of device memory. It implements collective.Buffer.
type Mem struct {
	ptr DevicePtr
	n   int
}

// Alloc allocates bytes of device memory (cuMemAlloc). The memory is not
// initialized. Device goroutine only.
func Alloc(bytes int) (Mem, error) {
	c, err := driver()
	if err != nil {
		return Mem{}, err
	}
	var p DevicePtr
	if err := c.check("cuMemAlloc", c.memAlloc.status(uintptr(unsafe.Pointer(&p)), uintptr(bytes))); err != nil {
		return Mem{}, fmt.Errorf("allocate %d bytes: %w", bytes, err)
	}
	return Mem{ptr: p, n: bytes}, nil
}

// MemOf describes n bytes of device memory at p, e.g. part of a larger
// allocation.
func MemOf(p DevicePtr, n int) Mem { return Mem{ptr: p, n: n} }

// Ptr is the device address of the memory.
func (m Mem) Ptr() DevicePtr { return m.ptr }

// Len is the size of the memory in bytes.
func (m Mem) Len() int { return m.n }

// Slice is the n bytes at offset off of m (not separately freeable).
func (m Mem) Slice(off, n int) Mem {
	if off < 0 || n < 0 || off+n > m.n {
		panic(fmt.Sprintf("gpu: Mem.Slice(%d, %d) out of range of %d bytes", off, n, m.n))
	}
	return Mem{ptr: m.ptr + DevicePtr(off), n: n}
}

// Free frees memory returned by Alloc (cuMemFree). Device goroutine only.
func (m Mem) Free() error {
	c, err := driver()
	if err != nil {
		return err
	}
	return c.check("cuMemFree", c.memFree.status(uintptr(m.ptr)))
}

// AllocHost allocates bytes of page-locked host memory (cuMemAllocHost),
// which async copies and captured graphs can use. Free it with FreeHost.
// Device goroutine only.
func AllocHost(bytes int) ([]byte, error) {
	c, err := driver()
	if err != nil {
		return nil, err
	}
	var p unsafe.Pointer
	if err := c.check("cuMemAllocHost", c.memAllocHost.status(uintptr(unsafe.Pointer(&p)), uintptr(bytes))); err != nil {
		return nil, fmt.Errorf("allocate %d bytes of pinned host memory: %w", bytes, err)
	}
	return unsafe.Slice((*byte)(p), bytes), nil
}

// HostPtr is the device address of page-locked memory b from AllocHost on
// a device with unified addressing (DeviceInfo.UnifiedAddressing): its
// host address, at which kernels read and write it directly.
func HostPtr(b []byte) DevicePtr { return DevicePtr(uintptr(unsafe.Pointer(unsafe.SliceData(b)))) }

// FreeHost frees memory returned by AllocHost. Device goroutine only.
func FreeHost(b []byte) error {
	c, err := driver()
	if err != nil {
		return err
	}
	return c.check("cuMemFreeHost", c.memFreeHost.status(uintptr(unsafe.Pointer(unsafe.SliceData(b)))))
}

// AsBytes views a slice of fixed-size elements as bytes, for the copy
// functions.
func AsBytes[T any](s []T) []byte {
	var zero T
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(s))), len(s)*int(unsafe.Sizeof(zero)))
}

// CopyHtoD copies src to device memory at dst and waits for the copy.
// Device goroutine only.
func CopyHtoD(dst DevicePtr, src []byte) error {
	c, err := driver()
	if err != nil || len(src) == 0 {
		return err
	}
	return c.check("cuMemcpyHtoD", c.memcpyHtoD.status(uintptr(dst), uintptr(unsafe.Pointer(unsafe.SliceData(src))), uintptr(len(src))))
}

// CopyDtoH copies len(dst) bytes of device memory at src to dst and waits
// for the copy. Device goroutine only.
func CopyDtoH(dst []byte, src DevicePtr) error {
	c, err := driver()
	if err != nil || len(dst) == 0 {
		return err
	}
	return c.check("cuMemcpyDtoH", c.memcpyDtoH.status(uintptr(unsafe.Pointer(unsafe.SliceData(dst))), uintptr(src), uintptr(len(dst))))
}

// CopyHtoDAsync orders a copy of src to dst on s. src must stay alive and
// unchanged until the copy completes; use AllocHost memory for copies that
// overlap other work or are captured in a graph. Device goroutine only.
func CopyHtoDAsync(dst DevicePtr, src []byte, s Stream) error {
	c, err := driver()
	if err != nil || len(src) == 0 {
		return err
	}
	return c.check("cuMemcpyHtoDAsync", c.memcpyHtoDAsync.status(uintptr(dst), uintptr(unsafe.Pointer(unsafe.SliceData(src))), uintptr(len(src)), uintptr(s)))
}

// CopyDtoHAsync orders a copy of len(dst) bytes at src into dst on s; dst
// holds the data once the stream has passed the copy. Device goroutine
// only.
func CopyDtoHAsync(dst []byte, src DevicePtr, s Stream) error {
	c, err := driver()
	if err != nil || len(dst) == 0 {
		return err
	}
	return c.check("cuMemcpyDtoHAsync", c.memcpyDtoHAsync.status(uintptr(unsafe.Pointer(unsafe.SliceData(dst))), uintptr(src), uintptr(len(dst)), uintptr(s)))
}

// CopyDtoDAsync orders a copy of bytes from src to dst on s. Device
// goroutine only.
func CopyDtoDAsync(dst, src DevicePtr, bytes int, s Stream) error {
	c, err := driver()
	if err != nil || bytes == 0 {
		return err
	}
	return c.check("cuMemcpyDtoDAsync", c.memcpyDtoDAsync.status(uintptr(dst), uintptr(src), uintptr(bytes), uintptr(s)))
}

// MemsetD32Async orders setting n 32-bit words at dst to v on s. Device
// goroutine only.
func MemsetD32Async(dst DevicePtr, v uint32, n int, s Stream) error {
	c, err := driver()
	if err != nil {
		return err
	}
	return c.check("cuMemsetD32Async", c.memsetD32Async.status(uintptr(dst), uintptr(v), uintptr(n), uintptr(s)))
}

// MemsetD8Async orders setting n bytes at dst to v on s. Device goroutine
// only.
func MemsetD8Async(dst DevicePtr, v byte, n int, s Stream) error {
	c, err := driver()
	if err != nil {
		return err
	}
	return c.check("cuMemsetD8Async", c.memsetD8Async.status(uintptr(dst), uintptr(v), uintptr(n), uintptr(s)))
}

// MemInfo returns the free and total device memory in bytes of the current
// device. Device goroutine only.
func MemInfo() (free, total int, err error) {
	c, err := driver()
	if err != nil {
		return 0, 0, err
	}
	var f, t uintptr
	if err := c.check("cuMemGetInfo", c.memGetInfo.status(uintptr(unsafe.Pointer(&f)), uintptr(unsafe.Pointer(&t)))); err != nil {
		return 0, 0, err
	}
	return int(f), int(t), nil
}

// Stream is a CUDA stream (CUstream). The zero Stream is the legacy default
// stream.
type Stream uintptr

// NewStream creates a non-blocking stream (CU_STREAM_NON_BLOCKING), which
// can be captured into a graph. Device goroutine only.
func NewStream() (Stream, error) {
	c, err := driver()
	if err != nil {
		return 0, err
	}
	var s Stream
	const nonBlocking = 1
	if err := c.check("cuStreamCreate", c.streamCreate.status(uintptr(unsafe.Pointer(&s)), nonBlocking)); err != nil {
		return 0, err
	}
	return s, nil
}

// Synchronize waits until all work ordered on s has completed. Device
// goroutine only.
func (s Stream) Synchronize() error {
	c, err := driver()
	if err != nil {
		return err
	}
	return c.check("cuStreamSynchronize", c.streamSynchronize.status(uintptr(s)))
}

// Done reports whether all work ordered on s has completed, without
// waiting (cuStreamQuery). Device goroutine only.
func (s Stream) Done() (bool, error) {
	c, err := driver()
	if err != nil {
		return false, err
	}
	switch r := c.streamQuery.status(uintptr(s)); r {
	case cudaSuccess:
		return true, nil
	case cudaErrorNotReady:
		return false, nil
	default:
		return false, c.check("cuStreamQuery", r)
	}
}

// WaitEvent makes later work on s wait until e has completed. Device
// goroutine only.
func (s Stream) WaitEvent(e Event) error {
	c, err := driver()
	if err != nil {
		return err
	}
	return c.check("cuStreamWaitEvent", c.streamWaitEvent.status(uintptr(s), uintptr(e), 0))
}

// Destroy destroys s once its work has completed. Device goroutine only.
func (s Stream) Destroy() error {
	c, err := driver()
	if err != nil {
		return err
	}
	return c.check("cuStreamDestroy", c.streamDestroy.status(uintptr(s)))
}

// Event is a CUDA event (CUevent) with timing enabled.
type Event uintptr

// NewEvent creates an event. Device goroutine only.
func NewEvent() (Event, error) {
	c, err := driver()
	if err != nil {
		return 0, err
	}
	var e Event
	if err := c.check("cuEventCreate", c.eventCreate.status(uintptr(unsafe.Pointer(&e)), 0)); err != nil {
		return 0, err
	}
	return e, nil
}

// Record records e on s: it completes when the work ordered on s before it
// has. Device goroutine only.
func (e Event) Record(s Stream) error {
	c, err := driver()
	if err != nil {
		return err
	}
	return c.check("cuEventRecord", c.eventRecord.status(uintptr(e), uintptr(s)))
}

// Synchronize waits until e has completed. Device goroutine only.
func (e Event) Synchronize() error {
	c, err := driver()
	if err != nil {
		return err
	}
	return c.check("cuEventSynchronize", c.eventSynchronize.status(uintptr(e)))
}

// Done reports whether e has completed, without waiting. Device goroutine
// only.
func (e Event) Done() (bool, error) {
	c, err := driver()
	if err != nil {
		return false, err
	}
	switch r := c.eventQuery.status(uintptr(e)); r {
	case cudaSuccess:
		return true, nil
	case cudaErrorNotReady:
		return false, nil
	default:
		return false, c.check("cuEventQuery", r)
	}
}

// Elapsed is the device time between two completed events (resolution
// about 0.5 µs). Device goroutine only.
func Elapsed(start, end Event) (time.Duration, error) {
	c, err := driver()
	if err != nil {
		return 0, err
	}
	var ms float32
	if err := c.check("cuEventElapsedTime", c.eventElapsedTime.status(uintptr(unsafe.Pointer(&ms)), uintptr(start), uintptr(end))); err != nil {
		return 0, err
	}
	return time.Duration(float64(ms) * float64(time.Millisecond)), nil
}

// Destroy destroys e. Device goroutine only.
func (e Event) Destroy() error {
	c, err := driver()
	if err != nil {
		return err
	}
	return c.check("cuEventDestroy", c.eventDestroy.status(uintptr(e)))
}

// Module is a loaded CUDA module (CUmodule).
type Module uintptr

// LoadModule loads a CUBIN, fatbin or NUL-terminated PTX image into the
// current context. Device goroutine only.
func LoadModule(image []byte) (Module, error) {
	c, err := driver()
	if err != nil {
		return 0, err
	}
	if len(image) == 0 {
		return 0, fmt.Errorf("load module: empty image")
	}
	var m Module
	if err := c.check("cuModuleLoadData", c.moduleLoadData.status(uintptr(unsafe.Pointer(&m)), uintptr(unsafe.Pointer(unsafe.SliceData(image))))); err != nil {
		return 0, fmt.Errorf("load module (%d bytes): %w", len(image), err)
	}
	return m, nil
}

// Function looks up a kernel by its (extern "C" or mangled) name. Device
// goroutine only.
func (m Module) Function(name string) (Function, error) {
	c, err := driver()
	if err != nil {
		return Function{}, err
	}
	var f uintptr
	cname := cString(name)
	if err := c.check("cuModuleGetFunction", c.moduleGetFunction.status(uintptr(unsafe.Pointer(&f)), uintptr(m), uintptr(unsafe.Pointer(&cname[0])))); err != nil {
		return Function{}, fmt.Errorf("kernel %q: %w", name, err)
	}
	return Function{h: f, name: name}, nil
}

// Unload unloads m; its functions become invalid. Device goroutine only.
func (m Module) Unload() error {
	c, err := driver()
	if err != nil {
		return err
	}
	return c.check("cuModuleUnload", c.moduleUnload.status(uintptr(m)))
}

// Graph is a captured CUDA graph (CUgraph).
type Graph uintptr

// GraphExec is an instantiated, launchable graph (CUgraphExec).
type GraphExec uintptr

// CaptureMode is a stream capture mode (CUstreamCaptureMode).
type CaptureMode int

// Capture modes: Global forbids unsafe calls (e.g. synchronous copies) from
// any thread during the capture, ThreadLocal only from the capturing
// thread, Relaxed not at all.
const (
	CaptureGlobal      CaptureMode = 0
	CaptureThreadLocal CaptureMode = 1
	CaptureRelaxed     CaptureMode = 2
)

// BeginCapture starts capturing the work ordered on s into a graph instead
// of running it. s must not be the legacy default stream. Device goroutine
// only.
func (s Stream) BeginCapture(mode CaptureMode) error {
	c, err := driver()
	if err != nil {
		return err
	}
	return c.check("cuStreamBeginCapture", c.streamBeginCapture.status(uintptr(s), uintptr(mode)))
}

// EndCapture ends the capture on s and returns the graph. Device goroutine
// only.
func (s Stream) EndCapture() (Graph, error) {
	c, err := driver()
	if err != nil {
		return 0, err
	}
	var g Graph
	if err := c.check("cuStreamEndCapture", c.streamEndCapture.status(uintptr(s), uintptr(unsafe.Pointer(&g)))); err != nil {
		return 0, err
	}
	return g, nil
}

// Instantiate makes a launchable graph of g (cuGraphInstantiateWithFlags,
// no flags). Device goroutine only.
func (g Graph) Instantiate() (GraphExec, error) {
	c, err := driver()
	if err != nil {
		return 0, err
	}
	var e GraphExec
	if err := c.check("cuGraphInstantiateWithFlags", c.graphInstantiate.status(uintptr(unsafe.Pointer(&e)), uintptr(g), 0)); err != nil {
		return 0, err
	}
	return e, nil
}

// NodeCount is the number of nodes of g. It needs cuGraphGetNodes, which is
// optional. Device goroutine only.
func (g Graph) NodeCount() (int, error) {
	c, err := driver()
	if err != nil {
		return 0, err
	}
	if err := c.graphGetNodes.available(); err != nil {
		return 0, err
	}
	var n uintptr
	if err := c.check("cuGraphGetNodes", c.graphGetNodes.status(uintptr(g), 0, uintptr(unsafe.Pointer(&n)))); err != nil {
		return 0, err
	}
	return int(n), nil
}

// Destroy destroys g; executable graphs made from it stay valid. Device
// goroutine only.
func (g Graph) Destroy() error {
	c, err := driver()
	if err != nil {
		return err
	}
	return c.check("cuGraphDestroy", c.graphDestroy.status(uintptr(g)))
}

// Upload prepares e's device resources on s ahead of its first launch.
// Device goroutine only.
func (e GraphExec) Upload(s Stream) error {
	c, err := driver()
	if err != nil {
		return err
	}
	return c.check("cuGraphUpload", c.graphUpload.status(uintptr(e), uintptr(s)))
}

// Launch orders a replay of e on s. Device goroutine only.
func (e GraphExec) Launch(s Stream) error {
	c, err := driver()
	if err != nil {
		return err
	}
	return c.check("cuGraphLaunch", c.graphLaunch.status(uintptr(e), uintptr(s)))
}

// Destroy destroys e. Device goroutine only.
func (e GraphExec) Destroy() error {
	c, err := driver()
	if err != nil {
		return err
	}
	return c.check("cuGraphExecDestroy", c.graphExecDestroy.status(uintptr(e)))
}
