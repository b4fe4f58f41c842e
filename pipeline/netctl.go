package pipeline

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/tandem-llm/tandem/internal/accept"
	"github.com/tandem-llm/tandem/internal/lograte"
	"github.com/tandem-llm/tandem/linkauth"
)

// The control plane between separate processes: one TCP connection per
// stage, opened by the leader with a handshake (protocol version, link
// name, leader epoch, and a challenge-response on the cluster credential
// when one is configured; see linkauth), then Steps from the leader and
// Results back, each a length-prefixed protobuf message
// (proto/tandem/control/v1/control.proto, wire.go). The leader ends the
// pipeline by closing its write side; the stage sees io.EOF.

// ControlConfig configures both ends of a control link: the leader's Dial
// and the stage's Listen. The two ends must agree on all of it.
type ControlConfig struct {
	// Link names the link (for example "control->stage2"); it is bound
	// into the handshake's proofs. Epoch is the leader epoch the link
	// serves; the stage refuses a leader of another epoch.
	Link  string
	Epoch uint64
	// Credential is the cluster credential (nil: none). With one, each end
	// proves it holds it and checks the other's proof; with none on one end
	// only, the handshake fails saying so.
	Credential *linkauth.Credential
	// HandshakeTimeout bounds the handshake (default 10s), so that a
	// connection that sends nothing is dropped after this long.
	HandshakeTimeout time.Duration
	// Logger receives a warning for each connection a stage's Accept
	// refuses (default slog.Default()).
	Logger *slog.Logger
}

const defaultControlHandshakeTimeout = 10 * time.Second

func (c ControlConfig) withDefaults() ControlConfig {
	if c.HandshakeTimeout <= 0 {
		c.HandshakeTimeout = defaultControlHandshakeTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// ControlListener accepts the leader's control connection on a stage.
type ControlListener struct {
	ln  *net.TCPListener
	cfg ControlConfig
	// refused bounds the log lines about refused connections, which
	// whoever reaches the port can provoke.
	refused lograte.Limiter
}

// ListenControl listens for the leader on addr ("127.0.0.1:0" picks a
// port) with the zero ControlConfig: no credential, the empty link name,
// epoch 0.
func ListenControl(addr string) (*ControlListener, error) {
	return ControlConfig{}.Listen(addr)
}

// Listen listens for the leader's control connection on addr.
func (c ControlConfig) Listen(addr string) (*ControlListener, error) {
	if len(c.Link) > maxLinkName {
		return nil, fmt.Errorf("listen for control on %s: link name of %d bytes, at most %d", addr, len(c.Link), maxLinkName)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen for control on %s: %w", addr, err)
	}
	return &ControlListener{ln: ln.(*net.TCPListener), cfg: c.withDefaults(),
		refused: lograte.Limiter{Rate: lograte.PeerRate, Burst: lograte.PeerBurst}}, nil
}

// Addr is the address the listener is bound to.
func (l *ControlListener) Addr() string { return l.ln.Addr().String() }

// Close stops listening.
func (l *ControlListener) Close() error { return l.ln.Close() }

// Accept waits for the leader's connection: the first that completes the
// handshake. Connections are served side by side, so one that says nothing
// cannot hold the leader's up. A connection that fails the handshake
// (another protocol version, link or epoch, a wrong or missing proof,
// garbage, silence past the handshake timeout) is told why where possible,
// closed and logged (at lograte.PeerRate lines a second), and
// Accept waits for the next.
func (l *ControlListener) Accept(ctx context.Context) (*NetControl, error) {
	nc, err := accept.First(ctx, l.ln, accept.Config[*NetControl]{
		Handshake: l.handshake,
		Discard:   func(nc *NetControl) { nc.Close() },
		Refused: func(c net.Conn, err error) {
			l.refused.Log(l.cfg.Logger, slog.LevelWarn, "control: refused connection", "link", l.cfg.Link,
				"listener", l.Addr(), "peer", c.RemoteAddr().String(), "err", err)
		},
	})
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, fmt.Errorf("accept control connection: %w", err)
	}
	return nc, nil
}

// handshake runs the stage's side of the handshake on c.
func (l *ControlListener) handshake(ctx context.Context, c net.Conn) (*NetControl, error) {
	cfg := l.cfg
	ctx, cancel := context.WithTimeout(ctx, cfg.HandshakeTimeout)
	defer cancel()
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	br, bw := bufio.NewReader(c), bufio.NewWriter(c)
	fail := func(err error) (*NetControl, error) {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("control handshake not done within %v: %w", cfg.HandshakeTimeout, err)
		}
		return nil, err
	}
	hello, err := readHello(br)
	if err != nil {
		return fail(err)
	}
	refuse := func(reason string) (*NetControl, error) {
		_ = writeMsg(bw, challengeMsg(nil, nil, reason)) // best effort
		return nil, errors.New(reason)
	}
	switch {
	case hello.version != ControlVersion:
		return refuse(fmt.Sprintf("the leader speaks control protocol version %d, this stage version %d", hello.version, ControlVersion))
	case hello.link != cfg.Link:
		return refuse(fmt.Sprintf("the leader asks for control link %q, this stage serves %q", hello.link, cfg.Link))
	case hello.epoch != cfg.Epoch:
		return refuse(fmt.Sprintf("the leader is of epoch %d, this stage was assigned in epoch %d", hello.epoch, cfg.Epoch))
	case len(hello.nonce) != linkauth.NonceSize:
		return refuse(fmt.Sprintf("the leader's nonce is %d bytes, want %d", len(hello.nonce), linkauth.NonceSize))
	}
	nonce := linkauth.NewNonce()
	if err := writeMsg(bw, challengeMsg(nonce, cfg.Credential.ProveIf(linkauth.Listener, cfg.Link, cfg.Epoch, hello.nonce, nonce), "")); err != nil {
		return fail(fmt.Errorf("send control challenge: %w", err))
	}
	proof, err := readProof(br)
	if err != nil {
		return fail(err)
	}
	if err := cfg.Credential.Check(linkauth.Dialer, cfg.Link, cfg.Epoch, hello.nonce, nonce, proof); err != nil {
		_ = writeMsg(bw, acceptMsg(err.Error()))
		return nil, fmt.Errorf("leader authentication: %w", err)
	}
	if err := writeMsg(bw, acceptMsg("")); err != nil {
		return fail(fmt.Errorf("send control accept: %w", err))
	}
	stop()
	if err := c.SetDeadline(time.Time{}); err != nil {
		return nil, fmt.Errorf("clear handshake deadline: %w", err)
	}
	return &NetControl{conn: c, br: br, bw: bw}, nil
}

// NetControl is a stage's Control over TCP.
type NetControl struct {
	conn net.Conn
	br   *bufio.Reader
	bw   *bufio.Writer
	buf  []byte // the last step's encoding, reused
}

// Next implements Control. A step larger than MaxStepBytes, or one that
// does not decode, is an error.
func (c *NetControl) Next(ctx context.Context) (*Step, error) {
	stop := context.AfterFunc(ctx, func() { c.conn.SetReadDeadline(time.Unix(1, 0)) })
	defer stop()
	b, err := readFrame(c.br, MaxStepBytes, c.buf)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if errors.Is(err, io.EOF) {
			return nil, io.EOF
		}
		return nil, fmt.Errorf("read step from leader %s: %w", c.conn.RemoteAddr(), err)
	}
	c.buf = b
	s, err := decodeStep(b)
	if err != nil {
		return nil, fmt.Errorf("step from leader %s: %w", c.conn.RemoteAddr(), err)
	}
	return s, nil
}

// Report implements Control.
func (c *NetControl) Report(ctx context.Context, r *Result) error {
	stop := context.AfterFunc(ctx, func() { c.conn.SetWriteDeadline(time.Unix(1, 0)) })
	defer stop()
	if err := writeMsg(c.bw, resultMsg(r)); err != nil {
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

	mu     sync.Mutex
	err    error
	closed bool
}

// DialLink connects the leader to the stage whose control listener is at
// addr with the zero ControlConfig.
func DialLink(ctx context.Context, addr string) (Link, error) {
	return ControlConfig{}.Dial(ctx, addr)
}

// Dial connects the leader to the stage whose control listener is at addr
// and runs the handshake. It starts one goroutine that reads the stage's
// reports; Close ends it.
func (c ControlConfig) Dial(ctx context.Context, addr string) (Link, error) {
	c = c.withDefaults()
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("dial stage control %s: %w", addr, err)
	}
	br, bw := bufio.NewReader(conn), bufio.NewWriter(conn)
	if err := c.handshake(ctx, conn, br, bw); err != nil {
		conn.Close()
		return nil, fmt.Errorf("stage control %s: %w", addr, err)
	}
	l := &netLink{
		conn:    conn.(*net.TCPConn),
		addr:    addr,
		results: make(chan *Result, 8),
		stop:    make(chan struct{}),
		done:    make(chan struct{}),
		bw:      bw,
	}
	go l.read(br)
	return l, nil
}

// handshake runs the leader's side of the handshake on conn.
func (c ControlConfig) handshake(ctx context.Context, conn net.Conn, br *bufio.Reader, bw *bufio.Writer) error {
	ctx, cancel := context.WithTimeout(ctx, c.HandshakeTimeout)
	defer cancel()
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	fail := func(err error) error {
		if ctx.Err() != nil {
			return fmt.Errorf("handshake not done within %v: %w", c.HandshakeTimeout, err)
		}
		return err
	}
	nonce := linkauth.NewNonce()
	if err := writeHello(bw, c.Link, c.Epoch, nonce); err != nil {
		return fail(fmt.Errorf("send control hello: %w", err))
	}
	ch, err := readChallenge(br)
	if err != nil {
		return fail(err)
	}
	switch {
	case ch.refused != "":
		return fmt.Errorf("the stage refused the control link: %s", ch.refused)
	case ch.version != ControlVersion:
		return fmt.Errorf("the stage speaks control protocol version %d, this leader version %d", ch.version, ControlVersion)
	}
	if err := c.Credential.Check(linkauth.Listener, c.Link, c.Epoch, nonce, ch.nonce, ch.proof); err != nil {
		_ = writeMsg(bw, proofMsg(nil, err.Error()))
		return fmt.Errorf("stage authentication: %w", err)
	}
	if err := writeMsg(bw, proofMsg(c.Credential.ProveIf(linkauth.Dialer, c.Link, c.Epoch, nonce, ch.nonce), "")); err != nil {
		return fail(fmt.Errorf("send control proof: %w", err))
	}
	refused, err := readAccept(br)
	if err != nil {
		return fail(err)
	}
	if refused != "" {
		return fmt.Errorf("the stage refused the control link: %s", refused)
	}
	stop()
	if err := conn.SetDeadline(time.Time{}); err != nil {
		return fmt.Errorf("clear handshake deadline: %w", err)
	}
	return nil
}

func (l *netLink) read(br *bufio.Reader) {
	defer close(l.done)
	defer close(l.results)
	var buf []byte
	for {
		b, err := readFrame(br, MaxResultBytes, buf)
		var r *Result
		if err == nil {
			buf = b
			r, err = decodeResult(b)
			if err != nil {
				err = fmt.Errorf("result: %w", err)
			}
		}
		if err != nil {
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
		case l.results <- r:
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
	if err := writeMsg(l.bw, stepMsg(s)); err != nil {
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
