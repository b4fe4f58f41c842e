package stagehost

import (
	"context"
	"errors"
	"fmt"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/collective/nccl"
	"github.com/tandem-llm/tandem/gpu"
)

// A stage's links to its neighbours. Activations go from each stage to the
// next, and with on-device hand-off the sampled tokens go from the last
// stage back to the first. Between two CUDA stages a link is an NCCL
// communicator of its own (two ranks: the sender is rank 0 and makes the
// id, the receiver rank 1); otherwise it is TCP (collective), and a CUDA
// end copies its device buffer through host memory.

// handoffLink names the TCP hand-off link into the first stage.
const handoffLink = "handoff->layer0"

// gpuStage is what an NCCL link needs of a CUDA stage: the device it runs
// on.
type gpuStage interface {
	Device() *gpu.Device
}

// ncclJoin is an NCCL communicator being joined in the background.
type ncclJoin struct {
	done chan struct{} // closed when the join has ended
	comm *gpu.NCCLComm // set before done is closed, on success
	err  error
	// taken is set by the one that wraps comm in a link (whose Close
	// aborts it); otherwise whoever ends the assignment aborts it.
	taken bool
}

// startNCCLJoin joins rank of a 2-rank communicator with id on dev in the
// background, for at most wireTimeout within ctx.
func startNCCLJoin(ctx context.Context, dev *gpu.Device, id gpu.NCCLUniqueID, rank int) *ncclJoin {
	j := &ncclJoin{done: make(chan struct{})}
	go func() {
		defer close(j.done)
		ctx, cancel := context.WithTimeout(ctx, wireTimeout)
		defer cancel()
		j.comm, j.err = nccl.Connect(ctx, dev, 2, id, rank)
	}()
	return j
}

// wait waits for the join to end (ctx bounds it too).
func (j *ncclJoin) wait() (*gpu.NCCLComm, error) {
	<-j.done
	return j.comm, j.err
}

// ncclLink is what an NCCL link owns besides its endpoint: a
// communicator and a stream of its own. Each link orders its transfers on
// its own stream, so that the transfers of a stage's links never queue
// behind one another (the first transfers of two links must run at once
// to connect them) and never behind the stage's own work (Forward has
// finished before a transfer starts, and a transfer has completed before
// Forward reads it).
type ncclLink struct {
	dev    *gpu.Device
	comm   *gpu.NCCLComm
	stream gpu.Stream
}

// newNCCLLink makes the link's stream; on failure it aborts comm.
func newNCCLLink(dev *gpu.Device, comm *gpu.NCCLComm) (*ncclLink, error) {
	l := &ncclLink{dev: dev, comm: comm}
	if err := dev.Do(func() (err error) { l.stream, err = gpu.NewStream(); return err }); err != nil {
		comm.Abort()
		return nil, fmt.Errorf("create the NCCL link's stream: %w", err)
	}
	return l, nil
}

// close aborts the communicator, which frees it without waiting for the
// peer, then destroys the stream.
func (l *ncclLink) close() error {
	err := l.comm.Abort()
	return errors.Join(err, l.dev.Do(l.stream.Destroy))
}

// ncclSender is a Sender over an NCCL link of its own.
type ncclSender struct {
	*nccl.Sender
	link *ncclLink
}

func (s ncclSender) Close() error { return errors.Join(s.Sender.Close(), s.link.close()) }

// ncclReceiver is a Receiver over an NCCL link of its own.
type ncclReceiver struct {
	*nccl.Receiver
	link *ncclLink
}

func (r ncclReceiver) Close() error { return errors.Join(r.Receiver.Close(), r.link.close()) }

// newNCCLSender wraps a joined communicator (rank 0) as the sender of a
// link; on failure it aborts the communicator.
func newNCCLSender(dev *gpu.Device, comm *gpu.NCCLComm) (collective.Sender, error) {
	l, err := newNCCLLink(dev, comm)
	if err != nil {
		return nil, err
	}
	s, err := nccl.NewSender(nccl.Config{Device: dev, Comm: comm, Peer: 1, Stream: l.stream})
	if err != nil {
		l.close()
		return nil, err
	}
	return ncclSender{s, l}, nil
}

// newNCCLReceiver wraps a joined communicator (rank 1) as the receiver of
// a link; on failure it aborts the communicator.
func newNCCLReceiver(dev *gpu.Device, comm *gpu.NCCLComm) (collective.Receiver, error) {
	l, err := newNCCLLink(dev, comm)
	if err != nil {
		return nil, err
	}
	r, err := nccl.NewReceiver(nccl.Config{Device: dev, Comm: comm, Peer: 0, Stream: l.stream})
	if err != nil {
		l.close()
		return nil, err
	}
	return ncclReceiver{r, l}, nil
}

// warmUp moves one small message over a new NCCL link, from its sender
// (send set) or into its receiver, so that NCCL connects the link now.
// NCCL connects point-to-point links at their first transfer, which needs
// both ends: otherwise the last stage's first hand-off send would wait for
// the first stage's first hand-off receive, which comes only steps later,
// while the first stage waits to send it activations. Connected, a link
// buffers small messages (hand-off rows) until they are received.
func warmUp(ctx context.Context, dev *gpu.Device, send collective.Sender, recv collective.Receiver) error {
	h := collective.Header{Rows: 1, Cols: 1, DType: collective.I32}
	var m gpu.Mem
	if err := dev.Do(func() (err error) { m, err = gpu.Alloc(h.Bytes()); return err }); err != nil {
		return fmt.Errorf("warm up the NCCL link: %w", err)
	}
	var err error
	if send != nil {
		err = send.Send(ctx, h, m)
	} else {
		err = recv.Recv(ctx, h, m)
	}
	if ferr := dev.Do(m.Free); err == nil && ferr != nil {
		err = ferr
	}
	if err != nil {
		return fmt.Errorf("warm up the NCCL link: %w", err)
	}
	return nil
}

// stagedSender sends over TCP what a CUDA stage has in device memory: it
// copies the message into a host buffer first. Host buffers go straight
// through.
type stagedSender struct {
	collective.Sender
	dev  *gpu.Device
	host collective.Host
}

func (s *stagedSender) Send(ctx context.Context, h collective.Header, b collective.Buffer) error {
	m, ok := b.(gpu.Mem)
	if !ok {
		return s.Sender.Send(ctx, h, b)
	}
	n := h.Bytes()
	if n > len(s.host) || n > m.Len() {
		return fmt.Errorf("stage %v through host memory: %d bytes, the buffers hold %d (host) and %d (device)", h, n, len(s.host), m.Len())
	}
	if err := s.dev.Do(func() error { return gpu.CopyDtoH(s.host[:n], m.Ptr()) }); err != nil {
		return fmt.Errorf("copy %v from the device: %w", h, err)
	}
	return s.Sender.Send(ctx, h, s.host[:n])
}

// stagedReceiver receives over TCP into a CUDA stage's device memory
// through a host buffer.
type stagedReceiver struct {
	collective.Receiver
	dev  *gpu.Device
	host collective.Host
}

func (r *stagedReceiver) Recv(ctx context.Context, h collective.Header, b collective.Buffer) error {
	m, ok := b.(gpu.Mem)
	if !ok {
		return r.Receiver.Recv(ctx, h, b)
	}
	n := h.Bytes()
	if n > len(r.host) || n > m.Len() {
		return fmt.Errorf("stage %v through host memory: %d bytes, the buffers hold %d (host) and %d (device)", h, n, len(r.host), m.Len())
	}
	if err := r.Receiver.Recv(ctx, h, r.host[:n]); err != nil {
		return err
	}
	if err := r.dev.Do(func() error { return gpu.CopyHtoD(m.Ptr(), r.host[:n]) }); err != nil {
		return fmt.Errorf("copy %v to the device: %w", h, err)
	}
	return nil
}

// stageTCPSender wraps a TCP sender of a stage: a CUDA stage's messages of
// up to bytes bytes go through a host buffer.
func stageTCPSender(s collective.Sender, st any, bytes int) collective.Sender {
	if g, ok := st.(gpuStage); ok {
		return &stagedSender{Sender: s, dev: g.Device(), host: make(collective.Host, bytes)}
	}
	return s
}

// stageTCPReceiver wraps a TCP receiver of a stage likewise.
func stageTCPReceiver(r collective.Receiver, st any, bytes int) collective.Receiver {
	if g, ok := st.(gpuStage); ok {
		return &stagedReceiver{Receiver: r, dev: g.Device(), host: make(collective.Host, bytes)}
	}
	return r
}
