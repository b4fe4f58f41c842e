package collective

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/tandem-llm/tandem/internal/accept"
	"github.com/tandem-llm/tandem/internal/lograte"
	"github.com/tandem-llm/tandem/linkauth"
)

const (
	defaultHandshakeTimeout = 10 * time.Second
	// recvBufferSize is the receiver's read buffer: small frames arrive in
	// one read, large payloads bypass it and land in the caller's buffer.
	recvBufferSize = 64 << 10
)

// aLongTimeAgo is a deadline in the past: setting it makes pending I/O on a
// connection return at once.
var aLongTimeAgo = time.Unix(1, 0)

// ListenConfig configures a Listener.
type ListenConfig struct {
	// Link names the one link the listener accepts (for example
	// "stage1->stage2"); a dialer must present the same name. At most
	// MaxLinkName bytes; the empty name is a name like any other.
	Link string
	// HandshakeTimeout bounds the hello exchange with one connecting peer:
	// a stray connection that sends nothing is dropped after this long
	// (default 10s).
	HandshakeTimeout time.Duration
	// Logger receives a warning for each connection Accept rejects, at
	// lograte.PeerRate lines a second (default slog.Default()).
	Logger *slog.Logger
	// Epoch and Credential authenticate the dialer: with a credential (the
	// cluster's, see package linkauth), each end proves it holds it for
	// this link name and epoch and checks the other's proof; without one
	// no proof is exchanged. The dialer must be configured alike.
	Epoch      uint64
	Credential *linkauth.Credential
}

// DialConfig configures Dial.
type DialConfig struct {
	// Link names the link; the listener must expect the same name. At
	// most MaxLinkName bytes.
	Link string
	// HandshakeTimeout bounds the hello exchange with the listener
	// (default 10s); the context passed to Dial bounds it too.
	HandshakeTimeout time.Duration
	// Epoch and Credential authenticate the link as ListenConfig's do.
	Epoch      uint64
	Credential *linkauth.Credential
}

// Listen listens on addr for the link with the empty name.
func Listen(addr string) (*Listener, error) { return ListenConfig{}.Listen(addr) }

// Dial connects to the listener at addr for the link with the empty name.
func Dial(ctx context.Context, addr string) (Sender, error) {
	return DialConfig{}.Dial(ctx, addr)
}

// Listener accepts the receiving end of one named TCP link.
type Listener struct {
	ln  *net.TCPListener
	cfg ListenConfig
	// accepting admits one Accept at a time.
	accepting chan struct{}
	// done is cancelled by Close; it aborts a running Accept.
	done   context.Context
	cancel context.CancelFunc
	once   sync.Once
	// refused bounds the log lines about refused connections, which
	// whoever reaches the port can provoke.
	refused lograte.Limiter
}

// Listen listens on addr (host:port; port 0 picks a free one).
func (c ListenConfig) Listen(addr string) (*Listener, error) {
	if len(c.Link) > MaxLinkName {
		return nil, fmt.Errorf("collective: listen on %s: link name is %d bytes, at most %d", addr, len(c.Link), MaxLinkName)
	}
	if c.HandshakeTimeout <= 0 {
		c.HandshakeTimeout = defaultHandshakeTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("collective: listen on %s for link %q: %w", addr, c.Link, err)
	}
	done, cancel := context.WithCancel(context.Background())
	return &Listener{
		ln:        ln.(*net.TCPListener),
		cfg:       c,
		accepting: make(chan struct{}, 1),
		done:      done,
		cancel:    cancel,
		refused:   lograte.Limiter{Rate: lograte.PeerRate, Burst: lograte.PeerBurst},
	}, nil
}

// Addr is the address the listener listens on.
func (l *Listener) Addr() net.Addr { return l.ln.Addr() }

// Close stops listening and makes a running and every later Accept fail
// with ErrClosed. Links already accepted stay open.
func (l *Listener) Close() error {
	var err error
	l.once.Do(func() {
		l.cancel()
		if cerr := l.ln.Close(); cerr != nil {
			err = fmt.Errorf("collective: close listener %s: %w", l.Addr(), cerr)
		}
	})
	return err
}

// Accept waits for a dialer presenting the listener's link name and returns
// the receiving end of its link. Connections are served side by side, so
// one that says nothing cannot hold the dialer's up; one that fails the
// handshake (another link name, another protocol version, not a tandem
// peer at all, silent for longer than the handshake timeout) is told why
// where possible, closed and logged (at lograte.PeerRate lines a second),
// and Accept waits for the next one. Calls are served one at a time.
func (l *Listener) Accept(ctx context.Context) (Receiver, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(l.done, cancel)()
	fail := func(err error) (Receiver, error) {
		if l.done.Err() != nil {
			err = fmt.Errorf("listener closed: %w", ErrClosed)
		} else if cerr := ctx.Err(); cerr != nil {
			err = cerr
		}
		return nil, fmt.Errorf("collective: accept link %q on %s: %w", l.cfg.Link, l.Addr(), err)
	}
	select {
	case l.accepting <- struct{}{}:
		defer func() { <-l.accepting }()
	case <-ctx.Done():
		return fail(ctx.Err())
	}
	r, err := accept.First(ctx, l.ln, accept.Config[Receiver]{
		Handshake: func(ctx context.Context, c net.Conn) (Receiver, error) { return l.handshake(ctx, c.(*net.TCPConn)) },
		Discard:   func(r Receiver) { r.Close() },
		Refused: func(c net.Conn, err error) {
			l.refused.Log(l.cfg.Logger, slog.LevelWarn, "collective: rejected connection", "link", l.cfg.Link,
				"listener", l.Addr().String(), "peer", c.RemoteAddr().String(), "err", err)
		},
	})
	if err != nil {
		return fail(err)
	}
	return r, nil
}

// handshake reads a dialer's hello from conn and answers it.
func (l *Listener) handshake(ctx context.Context, conn *net.TCPConn) (Receiver, error) {
	if err := conn.SetNoDelay(true); err != nil {
		return nil, fmt.Errorf("set TCP_NODELAY: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, l.cfg.HandshakeTimeout)
	defer cancel()
	disarm, err := armDeadline(ctx, conn.SetDeadline)
	if err != nil {
		return nil, err
	}
	defer disarm()
	br := bufio.NewReaderSize(conn, recvBufferSize)
	text, err := readHandshake(br, helloMagic, "hello")
	var dialerNonce []byte
	if err == nil {
		if len(text) < linkauth.NonceSize {
			err = fmt.Errorf("hello of %d bytes: shorter than the dialer's nonce (%d bytes)", len(text), linkauth.NonceSize)
		} else if dialerNonce, text = []byte(text[:linkauth.NonceSize]), text[linkauth.NonceSize:]; text != l.cfg.Link {
			err = fmt.Errorf("link name: dialer presented %q, listener expects %q", text, l.cfg.Link)
		}
	}
	if err == nil {
		err = l.challenge(br, conn, dialerNonce)
	}
	if err != nil {
		if ctxCause(ctx, err) != nil {
			return nil, fmt.Errorf("handshake not done within %v: %w", l.cfg.HandshakeTimeout, err)
		}
		reason := "rejected: " + err.Error()
		if len(reason) > maxHandshakeText {
			reason = reason[:maxHandshakeText]
		}
		// Best effort: the peer may be gone or not a tandem peer.
		_ = writeHandshake(conn, answerMagic, reason)
		return nil, err
	}
	if err := writeHandshake(conn, answerMagic, ""); err != nil {
		return nil, fmt.Errorf("write handshake answer: %w", err)
	}
	disarm()
	if err := conn.SetDeadline(time.Time{}); err != nil {
		return nil, fmt.Errorf("clear handshake deadline: %w", err)
	}
	return &tcpReceiver{
		conn: conn,
		br:   br,
		peer: conn.RemoteAddr().String(),
		link: l.cfg.Link,
	}, nil
}

// challenge sends the listener's nonce and proof and checks the dialer's
// proof (the handshake's messages 2 and 3).
func (l *Listener) challenge(br *bufio.Reader, conn net.Conn, dialerNonce []byte) error {
	c := &l.cfg
	nonce := linkauth.NewNonce()
	proof := c.Credential.ProveIf(linkauth.Listener, c.Link, c.Epoch, dialerNonce, nonce)
	if err := writeHandshake(conn, challengeMagic, string(nonce)+string(proof)); err != nil {
		return fmt.Errorf("write challenge: %w", err)
	}
	theirs, err := readHandshake(br, proofMagic, "proof")
	if err != nil {
		return err
	}
	if err := c.Credential.Check(linkauth.Dialer, c.Link, c.Epoch, dialerNonce, nonce, []byte(theirs)); err != nil {
		return fmt.Errorf("dialer authentication: %w", err)
	}
	return nil
}

// Dial connects to the listener at addr, presents the link name and returns
// the sending end of the link. It fails if nothing listens at addr (it does
// not retry) or if the listener rejects the link, with the listener's
// reason.
func (c DialConfig) Dial(ctx context.Context, addr string) (Sender, error) {
	if len(c.Link) > MaxLinkName {
		return nil, fmt.Errorf("collective: dial %s: link name is %d bytes, at most %d", addr, len(c.Link), MaxLinkName)
	}
	if c.HandshakeTimeout <= 0 {
		c.HandshakeTimeout = defaultHandshakeTimeout
	}
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("collective: dial %s for link %q: %w", addr, c.Link, err)
	}
	s, err := c.handshake(ctx, conn.(*net.TCPConn))
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("collective: dial %s for link %q: %w", addr, c.Link, err)
	}
	return s, nil
}

// handshake presents the link name on conn and reads the listener's answer.
func (c DialConfig) handshake(ctx context.Context, conn *net.TCPConn) (Sender, error) {
	if err := conn.SetNoDelay(true); err != nil {
		return nil, fmt.Errorf("set TCP_NODELAY: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, c.HandshakeTimeout)
	defer cancel()
	disarm, err := armDeadline(ctx, conn.SetDeadline)
	if err != nil {
		return nil, err
	}
	defer disarm()
	wait := func(err error) error {
		if cerr := ctxCause(ctx, err); cerr != nil {
			return fmt.Errorf("wait for the listener (handshake timeout %v): %w", c.HandshakeTimeout, cerr)
		}
		return err
	}
	nonce := linkauth.NewNonce()
	if err := writeHandshake(conn, helloMagic, string(nonce)+c.Link); err != nil {
		if cerr := ctxCause(ctx, err); cerr != nil {
			err = cerr
		}
		return nil, fmt.Errorf("write hello: %w", err)
	}
	br := bufio.NewReader(conn)
	magic, text, err := readHandshakeOf(br, "handshake challenge", challengeMagic, answerMagic)
	if err != nil {
		return nil, wait(err)
	}
	reason := text
	if magic == challengeMagic {
		if len(text) < linkauth.NonceSize {
			return nil, fmt.Errorf("challenge of %d bytes: shorter than the listener's nonce (%d bytes)", len(text), linkauth.NonceSize)
		}
		theirs, proof := []byte(text[:linkauth.NonceSize]), []byte(text[linkauth.NonceSize:])
		if err := c.Credential.Check(linkauth.Listener, c.Link, c.Epoch, nonce, theirs, proof); err != nil {
			return nil, fmt.Errorf("listener %s: authentication: %w", conn.RemoteAddr(), err)
		}
		if err := writeHandshake(conn, proofMagic, string(c.Credential.ProveIf(linkauth.Dialer, c.Link, c.Epoch, nonce, theirs))); err != nil {
			return nil, wait(fmt.Errorf("write proof: %w", err))
		}
		if reason, err = readHandshake(br, answerMagic, "handshake answer"); err != nil {
			return nil, wait(err)
		}
	}
	if reason != "" {
		return nil, fmt.Errorf("listener %s: %s", conn.RemoteAddr(), reason)
	}
	disarm()
	if err := conn.SetDeadline(time.Time{}); err != nil {
		return nil, fmt.Errorf("clear handshake deadline: %w", err)
	}
	s := &tcpSender{
		conn:    conn,
		peer:    conn.RemoteAddr().String(),
		link:    c.Link,
		watcher: make(chan struct{}),
	}
	go s.watchPeer(br)
	return s, nil
}

// tcpSender is the sending end of a TCP link.
type tcpSender struct {
	conn       *net.TCPConn
	peer, link string

	// Frame pieces, reused by every Send; only the sending goroutine
	// touches them and err.
	hdr     [frameHeaderSize]byte
	trailer [frameTrailer]byte
	vec     [3][]byte
	bufs    net.Buffers
	// err breaks the link after a failed Send.
	err error

	closed atomic.Bool
	// watcher is closed when watchPeer returns, after it set peerErr.
	watcher chan struct{}
	peerErr error
}

// watchPeer reads from the connection, on which the receiver never sends
// after the handshake, to learn promptly that it closed the link or failed.
func (s *tcpSender) watchPeer(r io.Reader) {
	defer close(s.watcher)
	var b [1]byte
	_, err := io.ReadFull(r, b[:])
	switch {
	case err == nil:
		s.peerErr = errors.New("receiver sent data after the handshake")
	case errors.Is(err, io.EOF):
		s.peerErr = fmt.Errorf("receiver closed the link: %w", ErrClosed)
	default:
		s.peerErr = receiverGone(err)
	}
}

// receiverGone explains a failure of the connection to the receiver; a
// reset or broken pipe means the receiver closed its end or its process
// died.
func receiverGone(err error) error {
	if errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) {
		return fmt.Errorf("receiver closed the link: %w: %w", ErrClosed, err)
	}
	return fmt.Errorf("receiver connection failed: %w", err)
}

// Send implements Sender: it writes one frame, with the header, payload and
// checksum gathered in one writev call. A failure after the first byte went
// out, or any failure of the connection, breaks the link: that call and
// every later one return the same error.
func (s *tcpSender) Send(ctx context.Context, h Header, b Buffer) error {
	if s.err != nil {
		return s.err
	}
	if s.closed.Load() {
		return s.errorf(h, "sender closed: %w", ErrClosed)
	}
	payload, err := hostPayload(h, b)
	if err != nil {
		return s.errorf(h, "%w", err)
	}
	select {
	case <-s.watcher:
		s.err = s.errorf(h, "%w (link broken)", s.peerErr)
		return s.err
	default:
	}
	if err := ctx.Err(); err != nil {
		return s.errorf(h, "%w", err)
	}
	putFrameHeader(&s.hdr, h)
	binary.LittleEndian.PutUint32(s.trailer[:], frameChecksum(s.hdr[:], payload))
	s.vec = [3][]byte{s.hdr[:], payload, s.trailer[:]}
	s.bufs = s.vec[:]
	disarm, err := armDeadline(ctx, s.conn.SetWriteDeadline)
	if err != nil {
		return s.fail(ctx, h, 0, err)
	}
	n, err := s.bufs.WriteTo(s.conn)
	disarm()
	s.vec = [3][]byte{}
	s.bufs = nil
	if err != nil {
		return s.fail(ctx, h, int(n), err)
	}
	return nil
}

// fail explains a write of h's frame that failed after n bytes.
func (s *tcpSender) fail(ctx context.Context, h Header, n int, err error) error {
	if s.closed.Load() {
		return s.errorf(h, "sender closed: %w", ErrClosed)
	}
	cause := ctxCause(ctx, err)
	if cause == nil {
		select {
		case <-s.watcher:
			cause = s.peerErr
		default:
			cause = receiverGone(err)
		}
	} else if n == 0 {
		// Cancelled before a byte went out: the stream is intact.
		return s.errorf(h, "%w", cause)
	}
	s.err = s.errorf(h, "%w after %d of %d bytes (link broken)", cause, n, frameSize(h))
	return s.err
}

func (s *tcpSender) errorf(h Header, format string, args ...any) error {
	return fmt.Errorf("collective: send %v to %s (link %q): %w", h, s.peer, s.link, fmt.Errorf(format, args...))
}

// Close implements Sender. Frames Send has written are still delivered.
func (s *tcpSender) Close() error {
	if !s.closed.CompareAndSwap(false, true) {
		return nil
	}
	err := s.conn.Close()
	<-s.watcher
	if err != nil {
		return fmt.Errorf("collective: close link %q to %s: %w", s.link, s.peer, err)
	}
	return nil
}

// tcpReceiver is the receiving end of a TCP link.
type tcpReceiver struct {
	conn       *net.TCPConn
	br         *bufio.Reader
	peer, link string

	// Only the receiving goroutine touches scratch and err.
	scratch [frameHeaderSize]byte
	// err breaks the link after a failed Recv.
	err error

	closed atomic.Bool
}

// Recv implements Receiver. A failure after the first byte of the frame
// arrived, or any failure of the connection or of the frame's checks,
// breaks the link: that call and every later one return the same error.
func (r *tcpReceiver) Recv(ctx context.Context, h Header, b Buffer) error {
	if r.err != nil {
		return r.err
	}
	if r.closed.Load() {
		return r.errorf(h, "receiver closed: %w", ErrClosed)
	}
	dst, err := hostPayload(h, b)
	if err != nil {
		return r.errorf(h, "%w", err)
	}
	if err := ctx.Err(); err != nil {
		return r.errorf(h, "%w", err)
	}
	disarm, err := armDeadline(ctx, r.conn.SetReadDeadline)
	if err != nil {
		return r.fail(ctx, h, 0, err)
	}
	n, err := readFrame(r.br, &r.scratch, h, dst)
	disarm()
	if err != nil {
		return r.fail(ctx, h, n, err)
	}
	return nil
}

// fail explains a read of h's frame that failed after n bytes.
func (r *tcpReceiver) fail(ctx context.Context, h Header, n int, err error) error {
	if r.closed.Load() {
		return r.errorf(h, "receiver closed: %w", ErrClosed)
	}
	cause := ctxCause(ctx, err)
	if cause == nil {
		r.err = r.errorf(h, "%w (link broken)", err)
		return r.err
	}
	if n == 0 {
		// Cancelled before a byte arrived: the stream is intact.
		return r.errorf(h, "%w", cause)
	}
	r.err = r.errorf(h, "%w after %d of %d bytes (link broken)", cause, n, frameSize(h))
	return r.err
}

func (r *tcpReceiver) errorf(h Header, format string, args ...any) error {
	return fmt.Errorf("collective: recv %v from %s (link %q): %w", h, r.peer, r.link, fmt.Errorf(format, args...))
}

// Close implements Receiver.
func (r *tcpReceiver) Close() error {
	if !r.closed.CompareAndSwap(false, true) {
		return nil
	}
	if err := r.conn.Close(); err != nil {
		return fmt.Errorf("collective: close link %q from %s: %w", r.link, r.peer, err)
	}
	return nil
}

// armDeadline makes I/O on one direction of a connection (set is its
// SetReadDeadline, SetWriteDeadline or SetDeadline) end at ctx's deadline
// or when ctx is cancelled. disarm must be called once the I/O returned
// (calling it again does nothing); after it, nothing touches the deadline.
func armDeadline(ctx context.Context, set func(time.Time) error) (disarm func(), err error) {
	dl, _ := ctx.Deadline()
	if err := set(dl); err != nil {
		return nil, err
	}
	if ctx.Done() == nil {
		return func() {}, nil
	}
	fired := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		defer close(fired)
		// An error means the connection is closed: nothing to unblock.
		_ = set(aLongTimeAgo)
	})
	disarmed := false
	return func() {
		if disarmed {
			return
		}
		disarmed = true
		if !stop() {
			<-fired
		}
	}, nil
}

// ctxCause returns ctx's error when err is a timeout that ctx's deadline or
// cancellation caused, and nil otherwise.
func ctxCause(ctx context.Context, err error) error {
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		return nil
	}
	if cerr := ctx.Err(); cerr != nil {
		return cerr
	}
	if _, ok := ctx.Deadline(); ok {
		// The connection's timer fired a moment before the context's.
		return context.DeadlineExceeded
	}
	return nil
}
