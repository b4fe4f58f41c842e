package gpu

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"unsafe"

	"github.com/ebitengine/purego"
)

// ncclLib is NCCL's symbol table. ncclCommInitRank takes the 128-byte
// ncclUniqueId by value, which SyscallN cannot express; it is bound with
// purego.RegisterFunc, whose struct passing follows the C ABI.
type ncclLib struct {
	path string
	lib  library
	pre  []library

	getVersion, getUniqueID, commInitRankSym, commInitRankConfigSym, send,
	recv, groupStart, groupEnd, commGetAsyncError, commAbort, commDestroy,
	getErrorString, getLastError proc

	commInitRank       func(comm *uintptr, nranks int32, id NCCLUniqueID, rank int32) int32
	commInitRankConfig func(comm *uintptr, nranks int32, id NCCLUniqueID, rank int32, cfg *ncclConfig) int32
}

// ncclConfig is ncclConfig_t as NCCL 2.14 defined it. NCCL copies
// min(size, its own sizeof) bytes over its defaults and then resets every
// field newer than version, so this prefix is valid for later versions; the
// padding word overlays cgaClusterSize (NCCL 2.17), which is reset.
type ncclConfig struct {
	size     uintptr
	magic    uint32
	version  uint32
	blocking int32
	_        int32
}

// ncclConfigVersion is NCCL_VERSION(2, 14, 0), the layout of ncclConfig.
const ncclConfigVersion = 21400

func (l *ncclLib) symbols() []symbol {
	return []symbol{
		required(&l.getVersion, "ncclGetVersion"),
		required(&l.getUniqueID, "ncclGetUniqueId"),
		required(&l.commInitRankSym, "ncclCommInitRank"),
		optional(&l.commInitRankConfigSym, "ncclCommInitRankConfig"),
		required(&l.send, "ncclSend"),
		required(&l.recv, "ncclRecv"),
		required(&l.groupStart, "ncclGroupStart"),
		required(&l.groupEnd, "ncclGroupEnd"),
		required(&l.commGetAsyncError, "ncclCommGetAsyncError"),
		required(&l.commAbort, "ncclCommAbort"),
		required(&l.commDestroy, "ncclCommDestroy"),
		required(&l.getErrorString, "ncclGetErrorString"),
		optional(&l.getLastError, "ncclGetLastError"),
	}
}

func loadNCCL(ld *loader) (*ncclLib, error) {
	// NVLink multicast (NVLS) can take a shared host's GPUs out of
	// service; it stays off unless the environment says otherwise. NCCL
	// reads its environment on first use, so this precedes loading.
	if _, ok := os.LookupEnv("NCCL_NVLS_ENABLE"); !ok {
		os.Setenv("NCCL_NVLS_ENABLE", "0")
	}
	lib, path, pre, err := ld.load(specNCCL)
	if err != nil {
		return nil, fmt.Errorf("load NCCL: %w", err)
	}
	l := &ncclLib{path: path, lib: lib, pre: pre}
	if err := resolve(lib, path, l.symbols()); err != nil {
		return nil, fmt.Errorf("load NCCL: %w", err)
	}
	purego.RegisterFunc(&l.commInitRank, l.commInitRankSym.addr)
	if l.commInitRankConfigSym.available() == nil {
		purego.RegisterFunc(&l.commInitRankConfig, l.commInitRankConfigSym.addr)
	}
	return l, nil
}

func nccl() (*ncclLib, error) { return loadLazy(&state.nccl, loadNCCL) }

// check turns an ncclResult_t into an *Error (nil on success). comm, when
// not zero, supplies NCCL's last error text.
func (l *ncclLib) check(op string, code int32, comm uintptr) error {
	if code == ncclSuccess {
		return nil
	}
	e := &Error{Lib: "nccl", Op: op, Code: int(code), Name: statusName(ncclResultNames, "ncclResult", code)}
	e.Msg = goString(l.getErrorString.call(uintptr(code)))
	if l.getLastError.available() == nil {
		e.Detail = goString(l.getLastError.call(comm))
	}
	return e
}

// NCCLVersion is the loaded NCCL's version code, e.g. 22809 for 2.28.9.
func NCCLVersion() (int, error) {
	l, err := nccl()
	if err != nil {
		return 0, err
	}
	var v int32
	if err := l.check("ncclGetVersion", l.getVersion.status(uintptr(unsafe.Pointer(&v))), 0); err != nil {
		return 0, err
	}
	return int(v), nil
}

// NCCLUniqueID identifies a communicator to its ranks (ncclUniqueId, 128
// bytes). Rank 0 makes it and the control plane hands it to the others.
type NCCLUniqueID struct {
	Internal [128]byte
}

// NewNCCLUniqueID makes a new unique id (ncclGetUniqueId). It may be
// called from any goroutine.
func NewNCCLUniqueID() (NCCLUniqueID, error) {
	var id NCCLUniqueID
	l, err := nccl()
	if err != nil {
		return id, err
	}
	if err := l.check("ncclGetUniqueId", l.getUniqueID.status(uintptr(unsafe.Pointer(&id))), 0); err != nil {
		return id, err
	}
	return id, nil
}

// NCCLDataType is an ncclDataType_t element type.
type NCCLDataType int32

// NCCL element types.
const (
	NCCLInt8     NCCLDataType = 0
	NCCLUint8    NCCLDataType = 1
	NCCLInt32    NCCLDataType = 2
	NCCLFloat16  NCCLDataType = 6
	NCCLFloat32  NCCLDataType = 7
	NCCLBfloat16 NCCLDataType = 9
)

// NCCLComm is one rank's handle of an NCCL communicator. Its operations
// run on the goroutine of the device it was created on (Device.Do), except
// Abort, AsyncError and Ready, which may be called from any goroutine, and
// P2P, also from a thread of Device.LockThread. Each holds the
// communicator while it calls NCCL, so Abort from another goroutine never
// frees it under a call.
type NCCLComm struct {
	lib         *ncclLib
	h           uintptr
	rank        int
	ranks       int
	nonBlocking bool

	mu      sync.Mutex
	aborted bool
}

// ErrCommAborted is returned by operations on an aborted communicator.
var ErrCommAborted = errors.New("nccl communicator aborted")

// NCCLInitRank joins rank of an nranks communicator identified by id on the
// current device (ncclCommInitRank). It blocks until every rank has joined.
// Device goroutine only.
func NCCLInitRank(nranks int, id NCCLUniqueID, rank int) (*NCCLComm, error) {
	l, err := nccl()
	if err != nil {
		return nil, err
	}
	var h uintptr
	if err := l.check("ncclCommInitRank", l.commInitRank(&h, int32(nranks), id, int32(rank)), 0); err != nil {
		return nil, fmt.Errorf("join rank %d of %d: %w", rank, nranks, err)
	}
	return &NCCLComm{lib: l, h: h, rank: rank, ranks: nranks}, nil
}

// NCCLInitRankNonBlocking starts joining rank of an nranks communicator
// identified by id on the current device as a non-blocking communicator
// (ncclCommInitRankConfig with blocking = 0, NCCL 2.14 or later). It
// returns at once; the communicator is usable once Ready reports true, and
// Abort stops a join whose peers never come. Later group ends return before
// connections are made: poll Ready after each before relying on the
// stream. Device goroutine only.
func NCCLInitRankNonBlocking(nranks int, id NCCLUniqueID, rank int) (*NCCLComm, error) {
	l, err := nccl()
	if err != nil {
		return nil, err
	}
	if err := l.commInitRankConfigSym.available(); err != nil {
		return nil, fmt.Errorf("non-blocking NCCL communicator: %w", err)
	}
	cfg := ncclConfig{magic: 0xcafebeef, version: ncclConfigVersion, blocking: 0}
	cfg.size = unsafe.Sizeof(cfg)
	var h uintptr
	r := l.commInitRankConfig(&h, int32(nranks), id, int32(rank), &cfg)
	if r != ncclInProgress {
		if err := l.check("ncclCommInitRankConfig", r, 0); err != nil {
			if h != 0 {
				l.commAbort.status(h)
			}
			return nil, fmt.Errorf("join rank %d of %d: %w", rank, nranks, err)
		}
	}
	return &NCCLComm{lib: l, h: h, rank: rank, ranks: nranks, nonBlocking: true}, nil
}

// NonBlocking reports whether the communicator was made by
// NCCLInitRankNonBlocking.
func (c *NCCLComm) NonBlocking() bool { return c.nonBlocking }

// Ready reports whether the communicator has finished its pending work
// (joining, or issuing a group): ncclCommGetAsyncError is ncclSuccess
// rather than ncclInProgress. An asynchronous error is returned as such.
func (c *NCCLComm) Ready() (bool, error) {
	issuing, err := c.state()
	return !issuing && err == nil, err
}

// state reads the communicator's state (ncclCommGetAsyncError): whether
// work is still being issued, else the error of work already ordered.
func (c *NCCLComm) state() (issuing bool, err error) {
	err = c.locked(func(h uintptr) error {
		var r int32
		if err := c.lib.check("ncclCommGetAsyncError", c.lib.commGetAsyncError.status(h, uintptr(unsafe.Pointer(&r))), h); err != nil {
			return err
		}
		if r == ncclInProgress {
			issuing = true
			return nil
		}
		return c.lib.check("ncclCommGetAsyncError", r, h)
	})
	return issuing, err
}

// Rank is this rank's index in the communicator.
func (c *NCCLComm) Rank() int { return c.rank }

// Ranks is the communicator's size.
func (c *NCCLComm) Ranks() int { return c.ranks }

// locked runs f with the communicator's handle, holding it against Abort
// from another goroutine; ErrCommAborted once it is aborted.
func (c *NCCLComm) locked(f func(h uintptr) error) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.aborted || c.h == 0 {
		return ErrCommAborted
	}
	return f(c.h)
}

// Send orders sending count elements at buf to rank peer on s (ncclSend).
// Device goroutine only.
func (c *NCCLComm) Send(buf DevicePtr, count int, dt NCCLDataType, peer int, s Stream) error {
	return c.locked(func(h uintptr) error { return c.send(h, buf, count, dt, peer, s) })
}

func (c *NCCLComm) send(h uintptr, buf DevicePtr, count int, dt NCCLDataType, peer int, s Stream) error {
	return c.lib.check("ncclSend", notInProgress(c.lib.send.status(uintptr(buf), uintptr(count), uintptr(dt), uintptr(peer), h, uintptr(s))), h)
}

// Recv orders receiving count elements from rank peer into buf on s
// (ncclRecv). Device goroutine only.
func (c *NCCLComm) Recv(buf DevicePtr, count int, dt NCCLDataType, peer int, s Stream) error {
	return c.locked(func(h uintptr) error { return c.recv(h, buf, count, dt, peer, s) })
}

func (c *NCCLComm) recv(h uintptr, buf DevicePtr, count int, dt NCCLDataType, peer int, s Stream) error {
	return c.lib.check("ncclRecv", notInProgress(c.lib.recv.status(uintptr(buf), uintptr(count), uintptr(dt), uintptr(peer), h, uintptr(s))), h)
}

// P2P orders one send (send set) or receive of count elements at buf with
// rank peer on s, in a group of its own (ncclGroupStart, ncclSend or
// ncclRecv, ncclGroupEnd), holding the communicator throughout: an Abort
// from another goroutine comes before or after it, never between its
// calls. With a non-blocking communicator the transfer is on the stream
// once Ready reports true. Device goroutine, or a thread of
// Device.LockThread.
func (c *NCCLComm) P2P(send bool, buf DevicePtr, count int, dt NCCLDataType, peer int, s Stream) error {
	return c.locked(func(h uintptr) error {
		if err := NCCLGroupStart(); err != nil {
			return err
		}
		var err error
		if send {
			err = c.send(h, buf, count, dt, peer, s)
		} else {
			err = c.recv(h, buf, count, dt, peer, s)
		}
		if gerr := NCCLGroupEnd(); err == nil {
			err = gerr
		}
		return err
	})
}

// NCCLGroupStart opens a group of NCCL calls that are issued together at
// NCCLGroupEnd (needed for p2p calls that depend on each other).
func NCCLGroupStart() error {
	l, err := nccl()
	if err != nil {
		return err
	}
	return l.check("ncclGroupStart", l.groupStart.status(), 0)
}

// NCCLGroupEnd closes a group opened by NCCLGroupStart and issues its
// calls. With non-blocking communicators the calls may still be in
// progress when it returns (see NCCLComm.Ready). Device goroutine, or a
// thread of Device.LockThread (the group is the thread's: open and close
// it on the same one).
func NCCLGroupEnd() error {
	l, err := nccl()
	if err != nil {
		return err
	}
	return l.check("ncclGroupEnd", notInProgress(l.groupEnd.status()), 0)
}

// notInProgress maps ncclInProgress, which non-blocking communicators return
// for work under way, to success.
func notInProgress(r int32) int32 {
	if r == ncclInProgress {
		return ncclSuccess
	}
	return r
}

// AsyncError returns the communicator's asynchronous error, if any
// (ncclCommGetAsyncError): a failure of work already ordered, e.g. a lost
// peer. It does not wait.
func (c *NCCLComm) AsyncError() error {
	_, err := c.state()
	return err
}

// Abort aborts the communicator's outstanding work and frees it
// (ncclCommAbort); later operations return ErrCommAborted. It may be called
// from any goroutine, e.g. while another one waits for a stuck transfer.
func (c *NCCLComm) Abort() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.aborted || c.h == 0 {
		return nil
	}
	c.aborted = true
	h := c.h
	c.h = 0
	return c.lib.check("ncclCommAbort", notInProgress(c.lib.commAbort.status(h)), 0)
}

// Destroy frees the communicator once its work has completed
// (ncclCommDestroy). Device goroutine only.
func (c *NCCLComm) Destroy() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.aborted || c.h == 0 {
		return nil
	}
	h := c.h
	c.h = 0
	return c.lib.check("ncclCommDestroy", notInProgress(c.lib.commDestroy.status(h)), 0)
}
