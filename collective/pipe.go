package collective

import (
	"context"
	"fmt"
	"sync"
)

// Pipe returns the two ends of an in-memory link between stages of one
// process.
//
// Send copies the payload into a buffer the pipe owns, so the sender's
// buffer is free again when Send returns. Up to depth messages wait in the
// pipe; a further Send blocks until Recv takes one (depth 0: every Send
// waits for its Recv). Depth must not be negative.
//
// Closing the sending end lets the receiver take the messages already
// queued; after them Recv fails with ErrClosed. Closing the receiving end
// makes blocked and later Sends fail with ErrClosed and drops the queue.
// A Recv whose header does not match the message breaks the link: that
// call and every later one return the same error.
func Pipe(depth int) (Sender, Receiver) {
	if depth < 0 {
		panic(fmt.Sprintf("collective: Pipe depth %d is negative", depth))
	}
	p := &pipe{
		msgs:         make(chan pipeMsg, depth),
		free:         make(chan []byte, depth+2),
		senderGone:   make(chan struct{}),
		receiverGone: make(chan struct{}),
	}
	return &pipeSender{p: p}, &pipeReceiver{p: p}
}

// pipe is the state the two ends share.
type pipe struct {
	msgs chan pipeMsg
	// free recycles message buffers: at most depth are queued, one is
	// being filled by Send and one emptied by Recv.
	free         chan []byte
	senderGone   chan struct{}
	receiverGone chan struct{}
}

type pipeMsg struct {
	h    Header
	data []byte
}

// recycle offers a message buffer for reuse.
func (p *pipe) recycle(b []byte) {
	select {
	case p.free <- b:
	default:
	}
}

type pipeSender struct {
	p         *pipe
	closeOnce sync.Once
}

// Send implements Sender.
func (s *pipeSender) Send(ctx context.Context, h Header, b Buffer) error {
	p := s.p
	select {
	case <-p.senderGone:
		return fmt.Errorf("collective: pipe send %v: sender closed: %w", h, ErrClosed)
	case <-p.receiverGone:
		return fmt.Errorf("collective: pipe send %v: receiver closed: %w", h, ErrClosed)
	default:
	}
	src, err := hostPayload(h, b)
	if err != nil {
		return fmt.Errorf("collective: pipe send %v: %w", h, err)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("collective: pipe send %v: %w", h, err)
	}
	var data []byte
	select {
	case data = <-p.free:
	default:
	}
	if cap(data) < len(src) {
		data = make([]byte, len(src))
	}
	data = data[:len(src)]
	copy(data, src)
	select {
	case p.msgs <- pipeMsg{h: h, data: data}:
		return nil
	case <-p.receiverGone:
		err = fmt.Errorf("receiver closed: %w", ErrClosed)
	case <-p.senderGone:
		err = fmt.Errorf("sender closed: %w", ErrClosed)
	case <-ctx.Done():
		err = ctx.Err()
	}
	p.recycle(data)
	return fmt.Errorf("collective: pipe send %v: %w", h, err)
}

// Close implements Sender.
func (s *pipeSender) Close() error {
	s.closeOnce.Do(func() { close(s.p.senderGone) })
	return nil
}

type pipeReceiver struct {
	p         *pipe
	closeOnce sync.Once
	// err breaks the link after a header mismatch; only the receiving
	// goroutine touches it.
	err error
}

// Recv implements Receiver.
func (r *pipeReceiver) Recv(ctx context.Context, h Header, b Buffer) error {
	if r.err != nil {
		return r.err
	}
	p := r.p
	select {
	case <-p.receiverGone:
		return fmt.Errorf("collective: pipe recv %v: receiver closed: %w", h, ErrClosed)
	default:
	}
	dst, err := hostPayload(h, b)
	if err != nil {
		return fmt.Errorf("collective: pipe recv %v: %w", h, err)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("collective: pipe recv %v: %w", h, err)
	}
	var m pipeMsg
	select {
	case m = <-p.msgs:
	case <-p.senderGone:
		// Messages sent before Close are still delivered.
		select {
		case m = <-p.msgs:
		default:
			return fmt.Errorf("collective: pipe recv %v: sender closed: %w", h, ErrClosed)
		}
	case <-p.receiverGone:
		return fmt.Errorf("collective: pipe recv %v: receiver closed: %w", h, ErrClosed)
	case <-ctx.Done():
		return fmt.Errorf("collective: pipe recv %v: %w", h, ctx.Err())
	}
	defer p.recycle(m.data)
	if err := checkHeader(h, m.h); err != nil {
		r.err = fmt.Errorf("collective: pipe recv %v: %w (link broken)", h, err)
		return r.err
	}
	copy(dst, m.data)
	return nil
}

// Close implements Receiver.
func (r *pipeReceiver) Close() error {
	r.closeOnce.Do(func() { close(r.p.receiverGone) })
	return nil
}
