package collective

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tandem-llm/tandem/internal/lograte"
	"github.com/tandem-llm/tandem/linkauth"
)

// acceptOne runs Accept on ln in the background; the returned function
// waits for its result.
func acceptOne(t *testing.T, ln *Listener, ctx context.Context) func() (Receiver, error) {
	type res struct {
		r   Receiver
		err error
	}
	ch := make(chan res, 1)
	go func() {
		r, err := ln.Accept(ctx)
		ch <- res{r, err}
	}()
	return func() (Receiver, error) {
		res := <-ch
		if res.r != nil {
			t.Cleanup(func() { res.r.Close() })
		}
		return res.r, res.err
	}
}

// listen listens on loopback for link, logging rejections to log.
func listen(t *testing.T, link string, log io.Writer) *Listener {
	t.Helper()
	ln, err := ListenConfig{
		Link:             link,
		HandshakeTimeout: 300 * time.Millisecond,
		Logger:           slog.New(slog.NewTextHandler(log, nil)),
	}.Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln
}

// rawPeer dials ln and completes the handshake by hand, returning the
// connection a test then writes frames on.
func rawPeer(t *testing.T, ln *Listener, link string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	// Without a credential: a nonce before the link name, then the
	// listener's challenge (its nonce, no proof), an empty proof, and the
	// empty answer.
	if _, err := c.Write(handshakeMsg("TNDH", ProtocolVersion, strings.Repeat("n", linkauth.NonceSize)+link)); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if ch, err := readHandshake(c, challengeMagic, "challenge"); err != nil || len(ch) != linkauth.NonceSize {
		t.Fatalf("handshake challenge %x, %v; want a nonce and no proof", ch, err)
	}
	if _, err := c.Write(handshakeMsg("TNDP", ProtocolVersion, "")); err != nil {
		t.Fatal(err)
	}
	want := handshakeMsg("TNDA", ProtocolVersion, "")
	got := make([]byte, len(want))
	if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("handshake answer %x, %v; want %x", got, err, want)
	}
	return c
}

// syncBuffer is a log destination safe for concurrent use.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestPeerCutMidFrame(t *testing.T) {
	h := Header{Batch: 42, Rows: 16, Cols: 64, DType: F32}
	frame := encodeFrame(h, pattern(h.Bytes(), 3))
	tests := []struct {
		name  string
		close bool // the peer closes (dies) after half a frame, or just stops
		ctx   time.Duration
		err   error
		msg   string
	}{
		{"peer closes", true, 5 * time.Second, nil, fmt.Sprintf("truncated frame: got %d of %d bytes", len(frame)/2, len(frame))},
		{"peer stalls", false, 200 * time.Millisecond, context.DeadlineExceeded, fmt.Sprintf("after %d of %d bytes (link broken)", len(frame)/2, len(frame))},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ln := listen(t, "cut", io.Discard)
			wait := acceptOne(t, ln, within(t, 5*time.Second))
			c := rawPeer(t, ln, "cut")
			r, err := wait()
			if err != nil {
				t.Fatal(err)
			}
			if _, err := c.Write(frame[:len(frame)/2]); err != nil {
				t.Fatal(err)
			}
			if tt.close {
				c.Close()
			}
			start := time.Now()
			err = r.Recv(within(t, tt.ctx), h, make(Host, h.Bytes()))
			wantErr(t, err, tt.err, tt.msg)
			wantErr(t, err, nil, "from "+c.LocalAddr().String())
			if d := time.Since(start); d > tt.ctx+time.Second {
				t.Fatalf("Recv failed after %v", d)
			}
			// The rest of the frame arriving now must not resynchronise.
			if !tt.close {
				c.Write(frame[len(frame)/2:])
			}
			if again := r.Recv(within(t, time.Second), h, make(Host, h.Bytes())); again != err {
				t.Fatalf("Recv after the failure: %v, want the same error", again)
			}
		})
	}
}

func TestGarbageAfterHandshake(t *testing.T) {
	ln := listen(t, "g", io.Discard)
	wait := acceptOne(t, ln, within(t, 5*time.Second))
	c := rawPeer(t, ln, "g")
	r, err := wait()
	if err != nil {
		t.Fatal(err)
	}
	c.Write([]byte("HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"))
	err = r.Recv(within(t, 5*time.Second), Header{Rows: 1, Cols: 1, DType: F32}, make(Host, 4))
	wantErr(t, err, nil, "bad frame magic: got 0x50545448")
}

func TestWrongLinkRejected(t *testing.T) {
	var log syncBuffer
	ln := listen(t, "s1->s2", &log)
	ctx := within(t, 5*time.Second)
	wait := acceptOne(t, ln, ctx)

	_, err := DialConfig{Link: "s0->s1"}.Dial(ctx, ln.Addr().String())
	wantErr(t, err, nil, `rejected: link name: dialer presented "s0->s1", listener expects "s1->s2"`)
	// A reason longer than a handshake message holds arrives cut short.
	_, err = DialConfig{Link: strings.Repeat("\x01", MaxLinkName)}.Dial(ctx, ln.Addr().String())
	wantErr(t, err, nil, `rejected: link name: dialer presented "\x01\x01`)

	s, err := DialConfig{Link: "s1->s2"}.Dial(ctx, ln.Addr().String())
	if err != nil {
		t.Fatalf("dial after a rejected peer: %v", err)
	}
	defer s.Close()
	r, err := wait()
	if err != nil {
		t.Fatal(err)
	}
	h := Header{Batch: 1, Rows: 1, Cols: 3, DType: I32}
	if err := s.Send(ctx, h, Host("abcdefghijkl")); err != nil {
		t.Fatal(err)
	}
	got := make(Host, 12)
	if err := r.Recv(ctx, h, got); err != nil || string(got) != "abcdefghijkl" {
		t.Fatalf("Recv = %q, %v", got, err)
	}
	if !strings.Contains(log.String(), `dialer presented \"s0->s1\"`) {
		t.Fatalf("rejection not logged; log:\n%s", log.String())
	}
}

// Connections that are not tandem peers, or silent, or of another
// protocol version, are rejected; the listener goes on to accept the right
// peer.
func TestStrayConnections(t *testing.T) {
	var log syncBuffer
	ln := listen(t, "l", &log)
	ctx := within(t, 10*time.Second)
	wait := acceptOne(t, ln, ctx)
	addr := ln.Addr().String()

	strays := []struct {
		name   string
		send   []byte
		answer string // in the rejection the stray reads back, "" for none
	}{
		{"http", []byte("GET / HTTP/1.1\r\nHost: x\r\n\r\n"), "bad hello magic: got 0x20544547"},
		{"version", handshakeMsg("TNDH", 1, "l"), "hello protocol version: got 1, want 2"},
		{"silent", nil, ""},
		{"gone", nil, ""},
	}
	for _, st := range strays {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		if st.name == "gone" {
			c.Close()
			continue
		}
		defer c.Close()
		c.Write(st.send)
		if st.answer == "" {
			continue
		}
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		reason, err := readHandshake(bufio.NewReader(c), answerMagic, "answer")
		if err != nil || !strings.Contains(reason, st.answer) {
			t.Fatalf("%s: answer %q, %v; want one containing %q", st.name, reason, err, st.answer)
		}
	}
	// The silent one times out on its own (the peer need not wait for it:
	// TestSilentConnectionsDoNotHoldThePeer).
	for deadline := time.Now().Add(5 * time.Second); !strings.Contains(log.String(), "handshake not done within 300ms"); {
		if time.Now().After(deadline) {
			t.Fatalf("the silent connection's timeout not logged:\n%s", log.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	s, err := DialConfig{Link: "l"}.Dial(ctx, addr)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := wait(); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"bad hello magic", "protocol version", "handshake not done within 300ms"} {
		if !strings.Contains(log.String(), want) {
			t.Errorf("log lacks %q:\n%s", want, log.String())
		}
	}
}

// TestSilentConnectionsDoNotHoldThePeer: connections that say nothing,
// made before the peer's, do not hold it up: the peer's handshake is done
// while theirs still wait, a minute's handshake timeout (served one at a
// time, the peer's waited for each in turn and failed its own timeout).
// Whoever reaches the port could otherwise keep a pipeline from wiring.
func TestSilentConnectionsDoNotHoldThePeer(t *testing.T) {
	var log syncBuffer
	ln, err := ListenConfig{Link: "l", HandshakeTimeout: time.Minute, Logger: slog.New(slog.NewTextHandler(&log, nil))}.Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ctx := within(t, 30*time.Second)
	wait := acceptOne(t, ln, ctx)
	var silent []net.Conn
	for range 20 { // more than the handshakes served at once
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		silent = append(silent, c)
	}
	dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	s, err := DialConfig{Link: "l", HandshakeTimeout: 10 * time.Second}.Dial(dctx, ln.Addr().String())
	if err != nil {
		t.Fatalf("the peer behind 20 silent connections: %v", err)
	}
	defer s.Close()
	if _, err := wait(); err != nil {
		t.Fatal(err)
	}
	for i, c := range silent {
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.ReadAll(c); err != nil {
			t.Errorf("silent connection %d not closed once the peer was accepted: %v", i, err)
		}
	}
	// 4 dropped for the silent ones beyond 16, one for the peer's; the
	// last may be reported or not, as the peer's success comes first.
	if n := strings.Count(log.String(), "too many handshakes at once"); n < 4 || n > 5 {
		t.Errorf("%d connections dropped as too many, want 4 or 5:\n%s", n, log.String())
	}
}

func TestAcceptCancelAndClose(t *testing.T) {
	ln := listen(t, "x", io.Discard)
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(50*time.Millisecond, cancel)
	_, err := ln.Accept(ctx)
	wantErr(t, err, context.Canceled, `accept link "x" on `+ln.Addr().String())

	wait := acceptOne(t, ln, within(t, 10*time.Second))
	time.Sleep(50 * time.Millisecond)
	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
	_, err = wait()
	wantErr(t, err, ErrClosed, "listener closed")
	_, err = ln.Accept(context.Background())
	wantErr(t, err, ErrClosed, "listener closed")
	if err := ln.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

func TestDialFailures(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var conns sync.WaitGroup
	conns.Go(func() {
		// A server that accepts and never answers.
		c, err := ln.Accept()
		if err == nil {
			io.Copy(io.Discard, c)
			c.Close()
		}
	})
	start := time.Now()
	_, err = DialConfig{Link: "x", HandshakeTimeout: 200 * time.Millisecond}.Dial(context.Background(), ln.Addr().String())
	wantErr(t, err, context.DeadlineExceeded, "dial "+ln.Addr().String())
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("Dial gave up after %v", d)
	}
	conns.Wait()

	addr := ln.Addr().String()
	ln.Close()
	_, err = Dial(within(t, 5*time.Second), addr)
	wantErr(t, err, nil, "dial "+addr)

	_, err = DialConfig{Link: strings.Repeat("x", MaxLinkName+1)}.Dial(context.Background(), addr)
	wantErr(t, err, nil, "link name is 257 bytes, at most 256")
}

// A receiver that disappears (reset or closed) fails the sender promptly,
// naming it.
func TestReceiverGone(t *testing.T) {
	for _, reset := range []bool{false, true} {
		t.Run(fmt.Sprintf("reset=%v", reset), func(t *testing.T) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer ln.Close()
			var peer sync.WaitGroup
			peer.Go(func() {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				// Play a listener: read the hello, accept, then vanish.
				if _, err := readHandshake(c, helloMagic, "hello"); err == nil {
					writeHandshake(c, answerMagic, "")
				}
				if reset {
					c.(*net.TCPConn).SetLinger(0)
				}
				c.Close()
			})
			ctx := within(t, 5*time.Second)
			s, err := Dial(ctx, ln.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			peer.Wait()
			h := Header{Rows: 256, Cols: 256, DType: F32}
			buf := make(Host, h.Bytes())
			start := time.Now()
			for err == nil {
				err = s.Send(ctx, h, buf)
			}
			wantErr(t, err, ErrClosed, "to "+ln.Addr().String())
			if d := time.Since(start); d > 2*time.Second {
				t.Fatalf("Send noticed after %v", d)
			}
			if again := s.Send(ctx, h, buf); again != err {
				t.Fatalf("Send after the failure: %v, want the same error", again)
			}
		})
	}
}

// A receiver that stops reading holds up the sender until its deadline.
func TestSendDeadline(t *testing.T) {
	s, _ := tcpPair(t, "slow")
	h := Header{Rows: 1024, Cols: 1024, DType: F32}
	buf := make(Host, h.Bytes())
	ctx := within(t, 300*time.Millisecond)
	start := time.Now()
	var err error
	for err == nil {
		err = s.Send(ctx, h, buf)
	}
	wantErr(t, err, context.DeadlineExceeded, "send batch 0")
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("Send gave up after %v", d)
	}
	if strings.Contains(err.Error(), "link broken") {
		if again := s.Send(context.Background(), h, buf); again != err {
			t.Fatalf("Send after the failure: %v, want the same error", again)
		}
	}
}

// Cancelling a Send blocked in the middle of a frame unblocks it and breaks
// the link.
func TestSendCancel(t *testing.T) {
	s, _ := tcpPair(t, "slow")
	h := Header{Rows: 16 << 10, Cols: 1024, DType: F32} // 64 MiB: more than the socket buffers
	buf := make(Host, h.Bytes())
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(100*time.Millisecond, cancel)
	start := time.Now()
	err := s.Send(ctx, h, buf)
	wantErr(t, err, context.Canceled, "(link broken)")
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("Send unblocked after %v", d)
	}
	if again := s.Send(context.Background(), Header{DType: F32}, nil); again != err {
		t.Fatalf("Send after the failure: %v, want the same error", again)
	}
}

func TestCloseUnblocksSend(t *testing.T) {
	s, _ := tcpPair(t, "slow")
	h := Header{Rows: 16 << 10, Cols: 1024, DType: F32}
	time.AfterFunc(100*time.Millisecond, func() { s.Close() })
	err := s.Send(within(t, 10*time.Second), h, make(Host, h.Bytes()))
	wantErr(t, err, ErrClosed, "sender closed")
}

const killedPeerEnv = "TANDEM_COLLECTIVE_KILLED_PEER"

// killedPeerMain is the subprocess of TestKilledPeerProcess: it sends three
// frames to the listener at addr, writes half of a fourth, says so on
// stdout and waits to be killed.
func killedPeerMain(addr string) int {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := DialConfig{Link: "killed"}.Dial(ctx, addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	for i := range 3 {
		h := killedPeerHeader(i)
		if err := s.Send(ctx, h, Host(pattern(h.Bytes(), uint64(i)))); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	}
	h := killedPeerHeader(3)
	frame := encodeFrame(h, pattern(h.Bytes(), 3))
	if _, err := s.(*tcpSender).conn.Write(frame[:len(frame)/2]); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println("half sent")
	<-ctx.Done()
	return 1
}

func killedPeerHeader(i int) Header {
	return Header{Batch: uint64(i), Rows: 100, Cols: 100, DType: BF16}
}

// A sending process killed in the middle of a frame: the frames before it
// arrive, then Recv reports the cut frame.
func TestKilledPeerProcess(t *testing.T) {
	ln := listen(t, "killed", io.Discard)
	ctx := within(t, 10*time.Second)
	wait := acceptOne(t, ln, ctx)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), killedPeerEnv+"="+ln.Addr().String())
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || line != "half sent\n" {
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatalf("peer said %q, %v", line, err)
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	r, err := wait()
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		h := killedPeerHeader(i)
		buf := make(Host, h.Bytes())
		if err := r.Recv(ctx, h, buf); err != nil {
			t.Fatalf("frame %d: %v", i, err)
		}
		if !bytes.Equal(buf, pattern(h.Bytes(), uint64(i))) {
			t.Fatalf("frame %d: payload differs", i)
		}
	}
	h := killedPeerHeader(3)
	err = r.Recv(ctx, h, make(Host, h.Bytes()))
	total := frameSize(h)
	wantErr(t, err, nil, fmt.Sprintf("truncated frame: got %d of %d bytes", total/2, total))
	if errors.Is(err, ErrClosed) {
		t.Fatalf("a cut frame reported as a clean close: %v", err)
	}
}

func credential(t *testing.T, secret string) *linkauth.Credential {
	t.Helper()
	c, err := linkauth.NewCredential([]byte(secret))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestAuthenticatedLink: with a cluster credential the listener accepts
// only a dialer proving the same credential for the same link and epoch.
// A hello naming the guessable link without a proof (as a forged peer
// would send), another secret, another epoch, or a credential on one end
// only are rejected with a reason, and the right dialer is accepted after
// them.
func TestAuthenticatedLink(t *testing.T) {
	secret := "0123456789abcdef0123456789abcdef"
	const link = "activations->layer3"
	var log syncBuffer
	ln, err := ListenConfig{Link: link, Epoch: 4, Credential: credential(t, secret), HandshakeTimeout: 2 * time.Second,
		Logger: slog.New(slog.NewTextHandler(&log, nil))}.Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ctx := within(t, 20*time.Second)
	wait := acceptOne(t, ln, ctx)
	addr := ln.Addr().String()

	// A forged peer: the right link name, no proof.
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	c.Write(handshakeMsg("TNDH", ProtocolVersion, strings.Repeat("n", linkauth.NonceSize)+link))
	if ch, err := readHandshake(c, challengeMagic, "challenge"); err != nil || len(ch) != linkauth.NonceSize+linkauth.ProofSize {
		t.Fatalf("challenge %x, %v: want a nonce and a proof", ch, err)
	}
	c.Write(handshakeMsg("TNDP", ProtocolVersion, ""))
	if reason, err := readHandshake(c, answerMagic, "answer"); err != nil || !strings.Contains(reason, "rejected: dialer authentication: the peer sent no proof") {
		t.Errorf("forged peer: answer %q, %v", reason, err)
	}

	good := DialConfig{Link: link, Epoch: 4, Credential: credential(t, secret), HandshakeTimeout: 2 * time.Second}
	for _, tc := range []struct {
		name string
		mod  func(*DialConfig)
		want error
	}{
		{"another secret", func(d *DialConfig) { d.Credential = credential(t, "fedcba9876543210fedcba9876543210") }, linkauth.ErrBadProof},
		{"another epoch", func(d *DialConfig) { d.Epoch = 5 }, linkauth.ErrBadProof},
		{"no credential", func(d *DialConfig) { d.Credential = nil }, linkauth.ErrUnexpectedProof},
	} {
		d := good
		tc.mod(&d)
		if _, err := d.Dial(ctx, addr); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
	s, err := good.Dial(ctx, addr)
	if err != nil {
		t.Fatalf("the right dialer: %v", err)
	}
	defer s.Close()
	r, err := wait()
	if err != nil {
		t.Fatal(err)
	}
	h := Header{Batch: 1, Rows: 1, Cols: 2, DType: I32}
	if err := s.Send(ctx, h, Host("abcdefgh")); err != nil {
		t.Fatal(err)
	}
	got := make(Host, 8)
	if err := r.Recv(ctx, h, got); err != nil || string(got) != "abcdefgh" {
		t.Fatalf("Recv = %q, %v", got, err)
	}
	if !strings.Contains(log.String(), "dialer authentication") {
		t.Errorf("rejections not logged:\n%s", log.String())
	}

	// A credential on the dialer only.
	plain := listen(t, link, io.Discard)
	acceptOne(t, plain, within(t, 5*time.Second))
	if _, err := good.Dial(ctx, plain.Addr().String()); !errors.Is(err, linkauth.ErrNoProof) {
		t.Errorf("dialer with a credential, listener without: %v, want %v", err, linkauth.ErrNoProof)
	}
}

// TestRefusedFloodLogBounded: a flood of garbage connections logs at most
// the burst plus a line a second (it logged a line each), and the peer
// still gets in after it.
func TestRefusedFloodLogBounded(t *testing.T) {
	var log syncBuffer
	ln := listen(t, "l", &log)
	ctx := within(t, 30*time.Second)
	wait := acceptOne(t, ln, ctx)
	start := time.Now()
	const flood = 200
	for range flood {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		c.Write([]byte("GET / HTTP/1.1\r\n\r\n"))
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		io.ReadAll(c) // refused and closed
		c.Close()
	}
	s, err := DialConfig{Link: "l"}.Dial(ctx, ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := wait(); err != nil {
		t.Fatal(err)
	}
	bound := lograte.PeerBurst + int(time.Since(start).Seconds()*lograte.PeerRate) + 1
	n := strings.Count(log.String(), `msg="collective: rejected connection"`)
	t.Logf("%d refused connections in %v: %d log lines, %d counts of suppressed ones", flood, time.Since(start), n, strings.Count(log.String(), "suppressed="))
	if n > bound || n < lograte.PeerBurst {
		t.Errorf("%d lines for %d refused connections in %v, want %d to %d", n, flood, time.Since(start), lograte.PeerBurst, bound)
	}
}
