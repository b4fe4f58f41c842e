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
// on, and the stream its steps run on, where the link orders its
// transfers.
type gpuStage interface {
	Device() *gpu.Device
	Stream() gpu.Stream
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

// ncclLink is what an NCCL link owns besides its endpoint: a communicator,
// and a stream of its own for the warm-up transfer (warmUp), which is
// waited for. Every later transfer is ordered on the stage's own stream
// (nccl.Config.Ordered) and not waited for: a receive is ordered before
// the step that reads it and a send after the step that wrote it, so the
// host launches the step while the data is still on its way and goes on
// as soon as a send is ordered, and the stream keeps each buffer from
// being reused before its transfer is done. A transfer whose peer is gone
// then holds the stage's stream, and the step waiting for it, until the
// communicator is aborted: the link aborts it as soon as its assignment
// ends (ctx), not only when it is closed after the worker returns.
type ncclLink struct {
	dev    *gpu.Device
	comm   *gpu.NCCLComm
	stream gpu.Stream
	stop   func() bool // stops the abort at the assignment's end
}

// newNCCLLink makes the link's stream and arranges for comm to be aborted
// when ctx ends; on failure it aborts comm.
func newNCCLLink(ctx context.Context, dev *gpu.Device, comm *gpu.NCCLComm) (*ncclLink, error) {
	l := &ncclLink{dev: dev, comm: comm}
	if err := dev.Do(func() (err error) { l.stream, err = gpu.NewStream(); return err }); err != nil {
		comm.Abort()
		return nil, fmt.Errorf("create the NCCL link's stream: %w", err)
	}
	l.stop = context.AfterFunc(ctx, func() { comm.Abort() })
	return l, nil
}

// close aborts the communicator, which frees it without waiting for the
// peer, then destroys the stream.
func (l *ncclLink) close() error {
	l.stop()
	err := l.comm.Abort()
	return errors.Join(err, l.dev.Do(l.stream.Destroy))
}

// ncclSender is a Sender over an NCCL link of its own. Close aborts the
// communicator first: that ends a transfer holding the device.
type ncclSender struct {
	*nccl.Sender
	link *ncclLink
}

func (s ncclSender) Close() error {
	err := s.link.close()
	return errors.Join(s.Sender.Close(), err)
}

// ncclReceiver is a Receiver over an NCCL link of its own.
type ncclReceiver struct {
	*nccl.Receiver
	link *ncclLink
}

func (r ncclReceiver) Close() error {
	err := r.link.close()
	return errors.Join(r.Receiver.Close(), err)
}

// newNCCLSender wraps a joined communicator (rank 0) as the sender of a
// link whose transfers are ordered on st's stream, aborted when ctx (the
// assignment's) ends; on failure it aborts the communicator.
func newNCCLSender(ctx context.Context, st gpuStage, comm *gpu.NCCLComm) (ncclSender, error) {
	l, err := newNCCLLink(ctx, st.Device(), comm)
	if err != nil {
		return ncclSender{}, err
	}
	s, err := nccl.NewSender(nccl.Config{Device: l.dev, Comm: comm, Peer: 1, Stream: st.Stream(), Ordered: true})
	if err != nil {
		l.close()
		return ncclSender{}, err
	}
	return ncclSender{s, l}, nil
}

// newNCCLReceiver wraps a joined communicator (rank 1) as the receiver of
// a link likewise.
func newNCCLReceiver(ctx context.Context, st gpuStage, comm *gpu.NCCLComm) (ncclReceiver, error) {
	l, err := newNCCLLink(ctx, st.Device(), comm)
	if err != nil {
		return ncclReceiver{}, err
	}
	r, err := nccl.NewReceiver(nccl.Config{Device: l.dev, Comm: comm, Peer: 0, Stream: st.Stream(), Ordered: true})
	if err != nil {
		l.close()
		return ncclReceiver{}, err
	}
	return ncclReceiver{r, l}, nil
}

// warmUp moves one small message over a new NCCL link, from its sender
// (send set) or into its receiver, on the link's own stream, and waits for
// it, so that NCCL connects the link now. NCCL connects point-to-point
// links at their first transfer, which needs both ends: otherwise the last
// stage's first hand-off send would wait for the first stage's first
// hand-off receive, which comes only steps later, while the first stage
// waits to send it activations. Connected, a link buffers small messages
// (hand-off rows) until they are received.
func warmUp(ctx context.Context, l *ncclLink, send bool) error {
	h := collective.Header{Rows: 1, Cols: 1, DType: collective.I32}
	var m gpu.Mem
	if err := l.dev.Do(func() (err error) { m, err = gpu.Alloc(h.Bytes()); return err }); err != nil {
		return fmt.Errorf("warm up the NCCL link: %w", err)
	}
	cfg := nccl.Config{Device: l.dev, Comm: l.comm, Stream: l.stream}
	var err error
	if send {
		cfg.Peer = 1
		var s *nccl.Sender
		if s, err = nccl.NewSender(cfg); err == nil {
			err = errors.Join(s.Send(ctx, h, m), s.Close())
		}
	} else {
		var r *nccl.Receiver
		if r, err = nccl.NewReceiver(cfg); err == nil {
			err = errors.Join(r.Recv(ctx, h, m), r.Close())
		}
	}
	if ferr := l.dev.Do(m.Free); err == nil && ferr != nil {
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
