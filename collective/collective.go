package collective

import (
	"context"
	"errors"
	"fmt"
	"strings"
)

// ErrClosed is wrapped by every error that reports a link closed by either
// end.
var ErrClosed = errors.New("collective: link closed")

// Limits on the shape a Header may describe.
const (
	// MaxDim is the largest Rows or Cols.
	MaxDim = 1<<31 - 1
	// MaxPayload is the largest message in bytes.
	MaxPayload = 1 << 40
)

// DType is the element type of an activation message.
type DType uint8

// Element types that travel between stages.
const (
	F32  DType = 1
	BF16 DType = 2
	F16  DType = 3
	I32  DType = 4
)

// Size is the size of one element in bytes.
func (d DType) Size() int {
	switch d {
	case F32, I32:
		return 4
	case BF16, F16:
		return 2
	}
	return 0
}

func (d DType) String() string {
	switch d {
	case F32:
		return "f32"
	case BF16:
		return "bf16"
	case F16:
		return "f16"
	case I32:
		return "i32"
	}
	return fmt.Sprintf("dtype(%d)", uint8(d))
}

// Header describes one message: which batch it belongs to and the shape of
// the activations (Rows tokens of Cols elements). Both ends know the header
// from the batch description, so a receiver states what it expects and a
// transport that carries headers (TCP) checks them; one that does not (NCCL)
// trusts the control plane.
type Header struct {
	Batch uint64
	Rows  int
	Cols  int
	DType DType
}

// Bytes is the payload size the header describes.
func (h Header) Bytes() int { return h.Rows * h.Cols * h.DType.Size() }

// Validate reports whether h describes a message a transport can carry: a
// known dtype, Rows and Cols in [0, MaxDim] and at most MaxPayload bytes.
func (h Header) Validate() error {
	size := h.DType.Size()
	switch {
	case size == 0:
		return fmt.Errorf("header %v: unknown dtype", h)
	case h.Rows < 0 || h.Rows > MaxDim:
		return fmt.Errorf("header %v: rows %d out of range [0, %d]", h, h.Rows, MaxDim)
	case h.Cols < 0 || h.Cols > MaxDim:
		return fmt.Errorf("header %v: cols %d out of range [0, %d]", h, h.Cols, MaxDim)
	case uint64(h.Rows)*uint64(h.Cols) > MaxPayload/uint64(size):
		return fmt.Errorf("header %v: payload larger than %d bytes", h, uint64(MaxPayload))
	}
	return nil
}

func (h Header) String() string {
	return fmt.Sprintf("batch %d [%dx%d %v]", h.Batch, h.Rows, h.Cols, h.DType)
}

// checkHeader returns an error naming every field of got that differs from
// want, or nil when they are equal.
func checkHeader(want, got Header) error {
	var diffs []string
	if got.Batch != want.Batch {
		diffs = append(diffs, fmt.Sprintf("batch %d, want %d", got.Batch, want.Batch))
	}
	if got.Rows != want.Rows {
		diffs = append(diffs, fmt.Sprintf("rows %d, want %d", got.Rows, want.Rows))
	}
	if got.Cols != want.Cols {
		diffs = append(diffs, fmt.Sprintf("cols %d, want %d", got.Cols, want.Cols))
	}
	if got.DType != want.DType {
		diffs = append(diffs, fmt.Sprintf("dtype %v, want %v", got.DType, want.DType))
	}
	if diffs == nil {
		return nil
	}
	return fmt.Errorf("header mismatch: got %s", strings.Join(diffs, "; "))
}

// Buffer is memory a transport reads from or writes into: host memory for the
// CPU transports (Host), device memory for NCCL. Buffers are owned by the
// stage and persistent; transports never allocate them.
type Buffer interface {
	// Len is the capacity of the buffer in bytes.
	Len() int
}

// Host is a Buffer in host memory.
type Host []byte

// Len implements Buffer.
func (h Host) Len() int { return len(h) }

// hostPayload validates h and returns the h.Bytes() bytes of b it describes;
// b must be Host memory of at least that size.
func hostPayload(h Header, b Buffer) ([]byte, error) {
	if err := h.Validate(); err != nil {
		return nil, err
	}
	host, ok := b.(Host)
	if !ok {
		return nil, fmt.Errorf("buffer is %T, want collective.Host", b)
	}
	if n := h.Bytes(); n <= len(host) {
		return host[:n], nil
	}
	return nil, fmt.Errorf("%v needs %d bytes, buffer holds %d", h, h.Bytes(), len(host))
}

// Sender sends messages to the next stage, in order.
type Sender interface {
	// Send sends h.Bytes() bytes of b. It returns once the transport no
	// longer needs b, or (an NCCL link ordered on its stage's stream) once
	// the send is ordered on that stream, before anything that writes b.
	Send(ctx context.Context, h Header, b Buffer) error
	Close() error
}

// Receiver receives messages from the previous stage, in order.
type Receiver interface {
	// Recv receives the message h describes into b. A message whose header
	// differs from h is an error. An NCCL link ordered on its stage's
	// stream returns once the receive is ordered there, before the work
	// that reads b.
	Recv(ctx context.Context, h Header, b Buffer) error
	Close() error
}

// StreamOrdered is implemented by a link whose transfers may be ordered on
// the stream of its stage's own device work rather than waited for (an
// NCCL link with nccl.Config.Ordered): StreamOrdered reports whether they
// are. A worker keeps steps launched ahead on a stage only when every
// link of the stage is ordered so (stage.LinkedLauncher).
type StreamOrdered interface {
	StreamOrdered() bool
}
