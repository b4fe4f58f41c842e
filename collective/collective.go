package collective

import (
	"context"
	"fmt"
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

// Sender sends messages to the next stage, in order.
type Sender interface {
	// Send sends h.Bytes() bytes of b. It returns once the transport no
	// longer needs b (for NCCL: once the send is ordered on the stream).
	Send(ctx context.Context, h Header, b Buffer) error
	Close() error
}

// Receiver receives messages from the previous stage, in order.
type Receiver interface {
	// Recv receives the message h describes into b. A message whose header
	// differs from h is an error.
	Recv(ctx context.Context, h Header, b Buffer) error
	Close() error
}
