package nccl

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/gpu"
)

// DeviceBuffer is device memory a transfer reads or writes. gpu.Mem
// implements it.
type DeviceBuffer interface {
	collective.Buffer
	// Ptr is the device address of the buffer.
	Ptr() gpu.DevicePtr
}

// Config says which communicator, peer and stream a Sender or Receiver uses.
type Config struct {
	// Device is the device the communicator and the stream belong to.
	Device *gpu.Device
	// Comm is this rank's communicator handle.
	Comm *gpu.NCCLComm
	// Peer is the rank sent to or received from.
	Peer int
	// Stream orders the transfers after the caller's work.
	Stream gpu.Stream
	// Ordered makes Send and Recv return once the transfer is on Stream,
	// without waiting for it: Stream is then the stream of the work that
	// writes what is sent and reads what is received (a CUDA stage's own),
	// which stream order alone keeps from reusing a buffer too early. A
	// transfer whose peer never comes holds Stream until the communicator
	// is aborted, which its owner does when the pipeline ends. Otherwise
	// (false) each transfer is waited for, within its ctx.
	Ordered bool
	// Spin is how long a transfer's wait checks for completion back to
	// back before it starts to sleep between checks (default 10 ms;
	// negative: it sleeps from the first check on). Waits in a running
	// pipeline last up to a neighbour's step; spinning through them
	// avoids timer sleeps, which on Linux last at least about 1 ms
	// whatever their duration, at the cost of a CPU core while waiting.
	Spin time.Duration
	// Sleep is the pause between checks once Spin has passed (default
	// 1 ms).
	Sleep time.Duration
}

// endpoint is what Sender and Receiver share.
type endpoint struct {
	cfg    Config
	done   gpu.Event
	closed bool
	verb   string // "send" or "recv", for messages
}

func newEndpoint(cfg Config, verb string) (*endpoint, error) {
	if cfg.Device == nil || cfg.Comm == nil {
		return nil, fmt.Errorf("nccl %s: Config needs Device and Comm", verb)
	}
	if cfg.Peer < 0 || cfg.Peer >= cfg.Comm.Ranks() || cfg.Peer == cfg.Comm.Rank() {
		return nil, fmt.Errorf("nccl %s: peer %d is not another rank of a %d-rank communicator (this is rank %d)", verb, cfg.Peer, cfg.Comm.Ranks(), cfg.Comm.Rank())
	}
	if cfg.Spin == 0 {
		cfg.Spin = 10 * time.Millisecond
	}
	if cfg.Sleep <= 0 {
		cfg.Sleep = time.Millisecond
	}
	e := &endpoint{cfg: cfg, verb: verb}
	err := cfg.Device.Do(func() (err error) {
		e.done, err = gpu.NewEvent()
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("nccl %s: create completion event: %w", verb, err)
	}
	return e, nil
}

// transfer orders one send or receive of h.Bytes() bytes of b and waits for
// it to complete.
func (e *endpoint) transfer(ctx context.Context, h collective.Header, b collective.Buffer) error {
	what := fmt.Sprintf("nccl %s batch %d (%dx%d %s) peer %d", e.verb, h.Batch, h.Rows, h.Cols, h.DType, e.cfg.Peer)
	if e.closed {
		return fmt.Errorf("%s: closed", what)
	}
	db, ok := b.(DeviceBuffer)
	if !ok {
		return fmt.Errorf("%s: buffer %T is not device memory", what, b)
	}
	if h.Rows < 0 || h.Cols < 0 || h.DType.Size() == 0 {
		return fmt.Errorf("%s: invalid header", what)
	}
	n := h.Bytes()
	if n > db.Len() {
		return fmt.Errorf("%s: %d bytes do not fit the %d-byte buffer", what, n, db.Len())
	}
	if n == 0 {
		return nil
	}
	comm, s := e.cfg.Comm, e.cfg.Stream
	spinUntil := time.Now().Add(e.cfg.Spin)
	// Order and wait on this goroutine's own thread with the context
	// current: a hop to the device goroutine and back costs more than a
	// small transfer takes. Only the caller uses the communicator.
	unlock, err := e.cfg.Device.LockThread()
	if err != nil {
		return fmt.Errorf("%s: %w", what, e.fail(err))
	}
	defer unlock()
	if err := comm.AsyncError(); err != nil {
		return fmt.Errorf("%s: %w", what, e.fail(err))
	}
	err = comm.P2P(e.verb == "send", db.Ptr(), n, gpu.NCCLUint8, e.cfg.Peer, s)
	if err == nil && comm.NonBlocking() {
		// The group may still be connecting and issuing: the transfer is
		// on the stream only once the communicator is ready.
		err = poll(ctx, spinUntil, e.cfg.Sleep, comm.Ready)
	}
	if err != nil {
		return fmt.Errorf("%s: %w", what, e.fail(err))
	}
	if e.cfg.Ordered {
		return nil
	}
	if err := e.done.Record(s); err != nil {
		return fmt.Errorf("%s: %w", what, e.fail(err))
	}
	err = poll(ctx, spinUntil, e.cfg.Sleep, func() (bool, error) {
		done, err := e.done.Done()
		if err != nil || done {
			return done, err
		}
		return false, comm.AsyncError()
	})
	if err != nil {
		return fmt.Errorf("%s: %w", what, e.fail(err))
	}
	return nil
}

// poll calls check until it reports done or an error, or ctx ends. Until
// spinUntil it calls check back to back, without yielding: the caller may
// hold its OS thread locked, and a locked goroutine's runtime.Gosched hands
// the thread over and back (tens of microseconds); the Go scheduler still
// preempts a long spin. Then it sleeps for sleep between calls.
func poll(ctx context.Context, spinUntil time.Time, sleep time.Duration, check func() (bool, error)) error {
	var timer *time.Timer
	for {
		done, err := check()
		if err != nil {
			return err
		}
		if done {
			return nil
		}
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("waiting for peer: %w", err)
		}
		if time.Now().Before(spinUntil) {
			continue
		}
		if timer == nil {
			timer = time.NewTimer(sleep)
			defer timer.Stop()
		} else {
			timer.Reset(sleep)
		}
		select {
		case <-timer.C:
		case <-ctx.Done():
			return fmt.Errorf("waiting for peer: %w", ctx.Err())
		}
	}
}

// fail aborts the communicator after err, so that no transfer stays stuck
// on the device, and returns err with what happened to the communicator.
func (e *endpoint) fail(err error) error {
	if errors.Is(err, gpu.ErrCommAborted) {
		return err
	}
	if aerr := e.cfg.Comm.Abort(); aerr != nil {
		return fmt.Errorf("%w (abort communicator: %v)", err, aerr)
	}
	return fmt.Errorf("%w (communicator aborted)", err)
}

func (e *endpoint) close() error {
	if e.closed {
		return nil
	}
	e.closed = true
	err := e.cfg.Device.Do(func() error { return e.done.Destroy() })
	if err != nil {
		return fmt.Errorf("nccl %s: close: %w", e.verb, err)
	}
	return nil
}

// Sender sends activations to one peer. It implements collective.Sender.
type Sender struct{ e *endpoint }

// NewSender makes a Sender to cfg.Peer.
func NewSender(cfg Config) (*Sender, error) {
	e, err := newEndpoint(cfg, "send")
	if err != nil {
		return nil, err
	}
	return &Sender{e: e}, nil
}

// Send sends h.Bytes() bytes of b, which must be a DeviceBuffer, after the
// work already ordered on the stream, and waits until the peer has them
// (Config.Ordered: until the send is on the stream).
func (s *Sender) Send(ctx context.Context, h collective.Header, b collective.Buffer) error {
	return s.e.transfer(ctx, h, b)
}

// StreamOrdered implements collective.StreamOrdered: Config.Ordered.
func (s *Sender) StreamOrdered() bool { return s.e.cfg.Ordered }

// Close releases the Sender; the communicator and stream stay the caller's.
func (s *Sender) Close() error { return s.e.close() }

// Receiver receives activations from one peer. It implements
// collective.Receiver.
type Receiver struct{ e *endpoint }

// NewReceiver makes a Receiver from cfg.Peer.
func NewReceiver(cfg Config) (*Receiver, error) {
	e, err := newEndpoint(cfg, "recv")
	if err != nil {
		return nil, err
	}
	return &Receiver{e: e}, nil
}

// Recv receives the message h describes into b, which must be a
// DeviceBuffer, and waits until it is there (Config.Ordered: until the
// receive is on the stream, before work ordered after it). NCCL carries
// no header: h is trusted.
func (r *Receiver) Recv(ctx context.Context, h collective.Header, b collective.Buffer) error {
	return r.e.transfer(ctx, h, b)
}

// StreamOrdered implements collective.StreamOrdered: Config.Ordered.
func (r *Receiver) StreamOrdered() bool { return r.e.cfg.Ordered }

// Close releases the Receiver; the communicator and stream stay the
// caller's.
func (r *Receiver) Close() error { return r.e.close() }

// Connect joins rank of an nranks communicator identified by id on dev as a
// non-blocking communicator, and waits until every rank has joined. When
// ctx ends first it aborts the join and returns an error, so a peer that
// never comes does not hang the caller. Transfers on the communicator are
// bounded by their ctx the same way, connection setup included.
func Connect(ctx context.Context, dev *gpu.Device, nranks int, id gpu.NCCLUniqueID, rank int) (*gpu.NCCLComm, error) {
	var comm *gpu.NCCLComm
	err := dev.Do(func() (err error) {
		comm, err = gpu.NCCLInitRankNonBlocking(nranks, id, rank)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("nccl connect rank %d of %d: %w", rank, nranks, err)
	}
	if err := poll(ctx, time.Time{}, 10*time.Millisecond, comm.Ready); err != nil {
		if aerr := comm.Abort(); aerr != nil {
			err = fmt.Errorf("%w (abort: %v)", err, aerr)
		}
		return nil, fmt.Errorf("nccl connect rank %d of %d: %w", rank, nranks, err)
	}
	return comm, nil
}

// NewUniqueID makes the id of a new communicator (on rank 0).
func NewUniqueID() (gpu.NCCLUniqueID, error) {
	id, err := gpu.NewNCCLUniqueID()
	if err != nil {
		return id, fmt.Errorf("nccl unique id: %w", err)
	}
	return id, nil
}

// EncodeUniqueID is the id's 128 bytes, for the control plane.
func EncodeUniqueID(id gpu.NCCLUniqueID) []byte {
	return append([]byte(nil), id.Internal[:]...)
}

// DecodeUniqueID parses bytes made by EncodeUniqueID.
func DecodeUniqueID(b []byte) (gpu.NCCLUniqueID, error) {
	var id gpu.NCCLUniqueID
	if len(b) != len(id.Internal) {
		return id, fmt.Errorf("nccl unique id: %d bytes, want %d", len(b), len(id.Internal))
	}
	copy(id.Internal[:], b)
	return id, nil
}

var (
	_ collective.Sender        = (*Sender)(nil)
	_ collective.Receiver      = (*Receiver)(nil)
	_ collective.StreamOrdered = (*Sender)(nil)
	_ collective.StreamOrdered = (*Receiver)(nil)
	_ DeviceBuffer             = gpu.Mem{}
)
