package gpu

import (
	"errors"
	"fmt"
	"runtime"
	"runtime/debug"
	"sync"
	"unsafe"
)

// DeviceInfo describes a device.
type DeviceInfo struct {
	Ordinal      int
	Name         string
	Major, Minor int // compute capability
	SMs          int // multiprocessors
	TotalMem     int64
	L2Bytes      int
	// MaxSharedPerBlock is the default shared memory limit of a block;
	// MaxSharedPerBlockOptin the limit after SetMaxDynamicSharedMem.
	MaxSharedPerBlock, MaxSharedPerBlockOptin int
	// UnifiedAddressing says host and device share one address space:
	// page-locked host memory (AllocHost) is addressed by kernels at its
	// host address (HostPtr).
	UnifiedAddressing bool
}

// Arch is the NVRTC/ptxas architecture name, e.g. "sm_90".
func (i DeviceInfo) Arch() string { return fmt.Sprintf("sm_%d%d", i.Major, i.Minor) }

// Device owns one GPU: a goroutine locked to its OS thread on which the
// device's primary context is current. Everything that touches the device
// runs on that goroutine through Do.
type Device struct {
	info DeviceInfo
	dev  int32
	ctx  uintptr

	work      chan func()
	closing   chan struct{}
	closed    chan struct{}
	closeOnce sync.Once
	closeErr  error
}

// ErrClosed is returned by Do on a closed Device.
var ErrClosed = errors.New("gpu: device closed")

// Open starts the goroutine of device ordinal, retains its primary context
// and makes it current there. Init must have succeeded (Open calls Probe
// when Init has not run).
func Open(ordinal int) (*Device, error) {
	if err := Probe(); err != nil {
		return nil, err
	}
	c, err := driver()
	if err != nil {
		return nil, err
	}
	d := &Device{
		work:    make(chan func()),
		closing: make(chan struct{}),
		closed:  make(chan struct{}),
	}
	ready := make(chan error, 1)
	go d.loop(c, ordinal, ready)
	if err := <-ready; err != nil {
		return nil, fmt.Errorf("open device %d: %w", ordinal, err)
	}
	return d, nil
}

// loop is the device goroutine. It never unlocks its thread, so the thread
// ends with it.
func (d *Device) loop(c *cudaLib, ordinal int, ready chan<- error) {
	runtime.LockOSThread()
	defer close(d.closed)
	if err := d.setup(c, ordinal); err != nil {
		ready <- err
		return
	}
	ready <- nil
	for {
		select {
		case f := <-d.work:
			f()
		case <-d.closing:
			d.closeErr = c.check("cuDevicePrimaryCtxRelease", c.primaryCtxRelease.status(uintptr(d.dev)))
			return
		}
	}
}

func (d *Device) setup(c *cudaLib, ordinal int) error {
	if err := c.check("cuDeviceGet", c.deviceGet.status(uintptr(unsafe.Pointer(&d.dev)), uintptr(ordinal))); err != nil {
		return err
	}
	if err := c.check("cuDevicePrimaryCtxRetain", c.primaryCtxRetain.status(uintptr(unsafe.Pointer(&d.ctx)), uintptr(d.dev))); err != nil {
		return err
	}
	if err := c.check("cuCtxSetCurrent", c.ctxSetCurrent.status(d.ctx)); err != nil {
		c.primaryCtxRelease.status(uintptr(d.dev))
		return err
	}
	info, err := c.deviceInfo(d.dev)
	if err != nil {
		c.primaryCtxRelease.status(uintptr(d.dev))
		return err
	}
	info.Ordinal = ordinal
	d.info = info
	return nil
}

func (c *cudaLib) deviceInfo(dev int32) (DeviceInfo, error) {
	var info DeviceInfo
	name := make([]byte, 256)
	if err := c.check("cuDeviceGetName", c.deviceGetName.status(uintptr(unsafe.Pointer(&name[0])), uintptr(len(name)), uintptr(dev))); err != nil {
		return info, err
	}
	info.Name = cStringBytes(name)
	var total uintptr
	if err := c.check("cuDeviceTotalMem", c.deviceTotalMem.status(uintptr(unsafe.Pointer(&total)), uintptr(dev))); err != nil {
		return info, err
	}
	info.TotalMem = int64(total)
	// CUdevice_attribute values.
	var unified int
	attrs := []struct {
		attr int
		dst  *int
	}{
		{75, &info.Major},
		{76, &info.Minor},
		{16, &info.SMs},
		{38, &info.L2Bytes},
		{8, &info.MaxSharedPerBlock},
		{97, &info.MaxSharedPerBlockOptin},
		{41, &unified},
	}
	for _, a := range attrs {
		var v int32
		if err := c.check("cuDeviceGetAttribute", c.deviceGetAttribute.status(uintptr(unsafe.Pointer(&v)), uintptr(a.attr), uintptr(dev))); err != nil {
			return info, fmt.Errorf("attribute %d: %w", a.attr, err)
		}
		*a.dst = int(v)
	}
	info.UnifiedAddressing = unified != 0
	return info, nil
}

// LockThread locks the calling goroutine to its OS thread and makes the
// device's primary context current there, so that it may call device
// functions directly: for loops of cheap calls, such as polling an event,
// that should not pay a hop to the device goroutine per call. unlock
// restores the thread's previous context and unlocks it. Work ordered this
// way is ordered on streams like any other; keep it to queries and other
// calls that need no serialization with the device goroutine (such as an
// NCCL transfer ordered on a stream that the caller's own program order
// keeps apart from the device goroutine's work).
func (d *Device) LockThread() (unlock func(), err error) {
	c, err := driver()
	if err != nil {
		return nil, err
	}
	runtime.LockOSThread()
	var prev uintptr
	if err := c.check("cuCtxGetCurrent", c.ctxGetCurrent.status(uintptr(unsafe.Pointer(&prev)))); err != nil {
		runtime.UnlockOSThread()
		return nil, err
	}
	if err := c.check("cuCtxSetCurrent", c.ctxSetCurrent.status(d.ctx)); err != nil {
		runtime.UnlockOSThread()
		return nil, err
	}
	return func() {
		c.ctxSetCurrent.status(prev)
		runtime.UnlockOSThread()
	}, nil
}

// Info describes the device.
func (d *Device) Info() DeviceInfo { return d.info }

// Ordinal is the device's index.
func (d *Device) Ordinal() int { return d.info.Ordinal }

// panicError carries a panic of a function run by Do back to its caller.
type panicError struct {
	value any
	stack []byte
}

// Do runs f on the device goroutine, with the device's context current, and
// returns its error. Calls from several goroutines are serialized. f must
// not call Do of the same device (it would deadlock). A panic in f is
// re-raised in the caller.
func (d *Device) Do(f func() error) error {
	res := make(chan any, 1)
	job := func() {
		defer func() {
			if p := recover(); p != nil {
				res <- panicError{value: p, stack: debug.Stack()}
			}
		}()
		res <- f()
	}
	select {
	case d.work <- job:
	case <-d.closing:
		return ErrClosed
	}
	switch r := (<-res).(type) {
	case nil:
		return nil
	case error:
		return r
	case panicError:
		panic(fmt.Sprintf("gpu: panic on device %d goroutine: %v\n%s", d.info.Ordinal, r.value, r.stack))
	default:
		panic(fmt.Sprintf("gpu: unexpected device result %T", r))
	}
}

// Close releases the primary context and ends the device goroutine. Work
// in flight through Do finishes first. Resources created on the device
// (memory, streams, modules) should be freed before.
func (d *Device) Close() error {
	d.closeOnce.Do(func() { close(d.closing) })
	<-d.closed
	return d.closeErr
}
