package pipeline

import (
	"bufio"
	"context"
	"encoding/gob"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"
)

// The control plane between separate processes: gob-encoded Steps from the
// leader, Results back, over one TCP connection per stage. The leader ends
// the pipeline by closing its write side; the stage sees io.EOF.

// ControlListener accepts the leader's control connection on a stage.
type ControlListener struct {
	ln net.Listener
}

// ListenControl listens for the leader on addr ("127.0.0.1:0" picks a port).
func ListenControl(addr string) (*ControlListener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen for control on %s: %w", addr, err)
	}
	return &ControlListener{ln: ln}, nil
}

// Addr is the address the listener is bound to.
func (l *ControlListener) Addr() string { return l.ln.Addr().String() }

// Close stops listening.
func (l *ControlListener) Close() error { return l.ln.Close() }

// Accept waits for the leader's connection.
func (l *ControlListener) Accept(ctx context.Context) (*NetControl, error) {
	stop := context.AfterFunc(ctx, func() { l.ln.Close() })
	defer stop()
	c, err := l.ln.Accept()
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, fmt.Errorf("accept control connection: %w", err)
	}
	bw := bufio.NewWriter(c)
	return &NetControl{conn: c, dec: gob.NewDecoder(bufio.NewReader(c)), bw: bw, enc: gob.NewEncoder(bw)}, nil
}

// NetControl is a stage's Control over TCP.
type NetControl struct {
	conn net.Conn
	dec  *gob.Decoder
	bw   *bufio.Writer
	enc  *gob.Encoder
}

// Next implements Control.
func (c *NetControl) Next(ctx context.Context) (*Step, error) {
	stop := context.AfterFunc(ctx, func() { c.conn.SetReadDeadline(time.Unix(1, 0)) })
	defer stop()
	var s Step
	if err := c.dec.Decode(&s); err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if errors.Is(err, io.EOF) {
			return nil, io.EOF
		}
		return nil, fmt.Errorf("read step from leader %s: %w", c.conn.RemoteAddr(), err)
	}
	return &s, nil
}

// Report implements Control.
func (c *NetControl) Report(ctx context.Context, r *Result) error {
	stop := context.AfterFunc(ctx, func() { c.conn.SetWriteDeadline(time.Unix(1, 0)) })
	defer stop()
	if err := c.enc.Encode(r); err != nil {
		return fmt.Errorf("send result to leader %s: %w", c.conn.RemoteAddr(), err)
	}
	if err := c.bw.Flush(); err != nil {
		return fmt.Errorf("send result to leader %s: %w", c.conn.RemoteAddr(), err)
	}
	return nil
}

// Close closes the connection.
func (c *NetControl) Close() error { return c.conn.Close() }

// netLink is the leader's Link to a stage in another process.
type netLink struct {
	conn    *net.TCPConn
	addr    string
	results chan *Result
	stop    chan struct{} // closed by Close: the reader drops results
	done    chan struct{} // closed when the reader has stopped

	wmu sync.Mutex
	bw  *bufio.Writer
	enc *gob.Encoder

	mu     sync.Mutex
	err    error
	closed bool
}

// DialLink connects the leader to the stage whose control listener is at
// addr. It starts one goroutine that reads the stage's reports; Close ends
// it.
func DialLink(ctx context.Context, addr string) (Link, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("dial stage control %s: %w", addr, err)
	}
	bw := bufio.NewWriter(c)
	l := &netLink{
		conn:    c.(*net.TCPConn),
		addr:    addr,
		results: make(chan *Result, 8),
		stop:    make(chan struct{}),
		done:    make(chan struct{}),
		bw:      bw,
		enc:     gob.NewEncoder(bw),
	}
	go l.read(gob.NewDecoder(bufio.NewReader(c)))
	return l, nil
}

func (l *netLink) read(dec *gob.Decoder) {
	defer close(l.done)
	defer close(l.results)
	for {
		var r Result
		if err := dec.Decode(&r); err != nil {
			l.mu.Lock()
			if !(l.closed && errors.Is(err, io.EOF)) {
				if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
					err = fmt.Errorf("stage at %s closed the control connection", l.addr)
				} else {
					err = fmt.Errorf("read from stage at %s: %w", l.addr, err)
				}
				l.err = err
			}
			l.mu.Unlock()
			return
		}
		select {
		case l.results <- &r:
		case <-l.stop:
		}
	}
}

// Send implements Link.
func (l *netLink) Send(ctx context.Context, s *Step) error {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	stop := context.AfterFunc(ctx, func() { l.conn.SetWriteDeadline(time.Unix(1, 0)) })
	defer stop()
	if err := l.enc.Encode(s); err != nil {
		return fmt.Errorf("send step to stage at %s: %w", l.addr, err)
	}
	if err := l.bw.Flush(); err != nil {
		return fmt.Errorf("send step to stage at %s: %w", l.addr, err)
	}
	return nil
}

// Results implements Link.
func (l *netLink) Results() <-chan *Result { return l.results }

// Err implements Link.
func (l *netLink) Err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.err
}

// Close implements Link: it closes the write side, so the stage's worker
// finishes the steps it has and returns; the read side closes when the
// stage hangs up. Results not yet read are dropped.
func (l *netLink) Close() error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	l.closed = true
	l.mu.Unlock()
	close(l.stop)
	l.wmu.Lock()
	err := l.conn.CloseWrite()
	l.wmu.Unlock()
	select {
	case <-l.done:
	case <-time.After(5 * time.Second):
		// The stage did not hang up: cut the connection.
	}
	cerr := l.conn.Close()
	<-l.done
	if err != nil {
		return fmt.Errorf("close control link to %s: %w", l.addr, err)
	}
	if cerr != nil && !errors.Is(cerr, net.ErrClosed) {
		return fmt.Errorf("close control link to %s: %w", l.addr, cerr)
	}
	return nil
}
