package accept

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// hello is a handshake over real TCP: the dialer writes a line, "hello"
// is accepted and answered "ok", anything else refused, and silence lasts
// until ctx is done (the handshake timeout of a real listener: long).
func hello(ctx context.Context, c net.Conn) (string, error) {
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return "", err
	}
	if line != "hello\n" {
		return "", errors.New("not a hello: " + strings.TrimSpace(line))
	}
	if _, err := io.WriteString(c, "ok\n"); err != nil {
		return "", err
	}
	return c.RemoteAddr().String(), nil
}

func listen(t *testing.T) *net.TCPListener {
	t.Helper()
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln
}

func dial(t *testing.T, ln net.Listener, say string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if say != "" {
		if _, err := io.WriteString(c, say); err != nil {
			t.Fatal(err)
		}
	}
	return c
}

// closedByPeer waits for the listener's side to close c.
func closedByPeer(t *testing.T, c net.Conn, what string) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadAll(c); err != nil {
		t.Errorf("%s: not closed by the listener: %v", what, err)
	}
}

// refusals records Refused's calls.
type refusals struct {
	mu   sync.Mutex
	errs []error
}

func (r *refusals) add(_ net.Conn, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.errs = append(r.errs, err)
}

func (r *refusals) list() []error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]error(nil), r.errs...)
}

func checkNoLeak(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Cleanup(func() {
		deadline := time.Now().Add(5 * time.Second)
		for runtime.NumGoroutine() > before && time.Now().Before(deadline) {
			runtime.Gosched()
			time.Sleep(10 * time.Millisecond)
		}
		if n := runtime.NumGoroutine(); n > before {
			t.Errorf("%d goroutines after, %d before", n, before)
		}
	})
}

// TestSilentConnectionsDoNotHoldThePeer: connections that say nothing,
// made first and more than MaxPending, do not delay the peer's: its
// handshake completes at once (served one at a time, it waited for theirs
// to time out; refused beyond MaxPending, it would not get in), and the
// silent ones are closed when First returns.
func TestSilentConnectionsDoNotHoldThePeer(t *testing.T) {
	checkNoLeak(t)
	ln := listen(t)
	var silent []net.Conn
	for range DefaultMaxPending + 4 {
		silent = append(silent, dial(t, ln, ""))
	}
	peer := dial(t, ln, "hello\n")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	start := time.Now()
	got, err := First(ctx, ln, Config[string]{Handshake: hello})
	if err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("the peer's handshake took %v behind %d silent connections", took, len(silent))
	}
	if got != peer.LocalAddr().String() {
		t.Errorf("answer %s, want the peer %s", got, peer.LocalAddr())
	}
	if line, err := bufio.NewReader(peer).ReadString('\n'); err != nil || line != "ok\n" {
		t.Errorf("peer read %q, %v", line, err)
	}
	for i, c := range silent {
		closedByPeer(t, c, "silent connection "+string(rune('0'+i)))
	}
}

// TestRefusedAndTooMany: a handshake that fails is refused and reported;
// a connection beyond MaxPending running handshakes drops the oldest
// (ErrTooMany); the peer still gets in.
func TestRefusedAndTooMany(t *testing.T) {
	checkNoLeak(t)
	ln := listen(t)
	var refused refusals
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	type answer struct {
		v   string
		err error
	}
	done := make(chan answer, 1)
	go func() {
		v, err := First(ctx, ln, Config[string]{Handshake: hello, Refused: refused.add, MaxPending: 2})
		done <- answer{v, err}
	}()
	garbage := dial(t, ln, "GET / HTTP/1.1\n")
	closedByPeer(t, garbage, "garbage")
	oldest := dial(t, ln, "")
	silent := []net.Conn{dial(t, ln, ""), dial(t, ln, "")}
	closedByPeer(t, oldest, "the oldest of 2 silent connections when a third came")
	deadline := time.Now().Add(5 * time.Second)
	for len(refused.list()) < 2 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	errs := refused.list()
	if len(errs) != 2 || !strings.Contains(errs[0].Error(), "not a hello: GET / HTTP/1.1") || !errors.Is(errs[1], ErrTooMany) {
		t.Fatalf("refusals %v, want the garbage's reason then %v", errs, ErrTooMany)
	}
	// The silent two hang up: their slots are free and the peer gets in.
	for _, c := range silent {
		c.Close()
	}
	deadline = time.Now().Add(5 * time.Second)
	for len(refused.list()) < 4 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if n := len(refused.list()); n != 4 {
		t.Fatalf("%d refusals after the silent two hung up, want 4: %v", n, refused.list())
	}
	select {
	case a := <-done:
		t.Fatalf("First returned %q, %v before the peer connected", a.v, a.err)
	default:
	}
	peer := dial(t, ln, "hello\n")
	if a := <-done; a.err != nil || a.v != peer.LocalAddr().String() {
		t.Errorf("First: %q, %v; want the peer %s", a.v, a.err, peer.LocalAddr())
	}
}

// TestCancel: First returns ctx's error once ctx is done, ends the
// handshakes running, and leaves the listener able to accept again.
func TestCancel(t *testing.T) {
	checkNoLeak(t)
	ln := listen(t)
	silent := dial(t, ln, "")
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(100*time.Millisecond, cancel)
	if _, err := First(ctx, ln, Config[string]{Handshake: hello}); !errors.Is(err, context.Canceled) {
		t.Fatalf("First after cancel: %v, want %v", err, context.Canceled)
	}
	closedByPeer(t, silent, "the silent connection after cancel")
	peer := dial(t, ln, "hello\n")
	ctx2, cancel2 := context.WithTimeout(context.Background(), time.Minute)
	defer cancel2()
	got, err := First(ctx2, ln, Config[string]{Handshake: hello})
	if err != nil || got != peer.LocalAddr().String() {
		t.Errorf("First again on the same listener: %q, %v", got, err)
	}
}

// TestListenerClosed: a listener closed under First ends it with the
// accept error.
func TestListenerClosed(t *testing.T) {
	checkNoLeak(t)
	ln := listen(t)
	time.AfterFunc(50*time.Millisecond, func() { ln.Close() })
	if _, err := First(context.Background(), ln, Config[string]{Handshake: hello}); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("First on a closed listener: %v, want %v", err, net.ErrClosed)
	}
}

// flaky fails its first accepts as a process out of file descriptors
// does, then accepts for real.
type flaky struct {
	*net.TCPListener
	fails int
}

func (f *flaky) Accept() (net.Conn, error) {
	if f.fails > 0 {
		f.fails--
		return nil, &net.OpError{Op: "accept", Net: "tcp", Err: os.NewSyscallError("accept4", syscall.EMFILE)}
	}
	return f.TCPListener.Accept()
}

// TestOutOfFilesRetried: accepts that fail for want of file descriptors
// (which a flood of connections can cause) are retried, not fatal.
func TestOutOfFilesRetried(t *testing.T) {
	checkNoLeak(t)
	ln := &flaky{TCPListener: listen(t), fails: 3}
	peer := dial(t, ln, "hello\n")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	got, err := First(ctx, ln, Config[string]{Handshake: hello})
	if err != nil || got != peer.LocalAddr().String() {
		t.Fatalf("First after 3 accepts out of files: %q, %v", got, err)
	}
}

// TestLateRefusalReported: a handshake that failed on its own but was
// slow to say so (its goroutine descheduled on a busy machine) is reported
// even when the peer's success came first; one cut short by First's
// return is not.
func TestLateRefusalReported(t *testing.T) {
	checkNoLeak(t)
	ln := listen(t)
	var refused refusals
	readBad := make(chan struct{})
	late := func(ctx context.Context, c net.Conn) (string, error) {
		stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
		defer stop()
		line, err := bufio.NewReader(c).ReadString('\n')
		switch {
		case err != nil:
			return "", err
		case line == "bad\n":
			close(readBad)
			<-ctx.Done() // reports after the peer got in
			return "", errors.New("not a hello: bad")
		}
		return c.RemoteAddr().String(), nil
	}
	bad := dial(t, ln, "bad\n")
	silent := dial(t, ln, "")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	peer := make(chan net.Conn, 1)
	go func() {
		<-readBad
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Error(err)
		} else {
			io.WriteString(c, "hello\n")
		}
		peer <- c
	}()
	defer func() {
		if c := <-peer; c != nil {
			c.Close()
		}
	}()
	if _, err := First(ctx, ln, Config[string]{Handshake: late, Refused: refused.add}); err != nil {
		t.Fatal(err)
	}
	errs := refused.list()
	if len(errs) != 1 || errs[0].Error() != "not a hello: bad" {
		t.Errorf("refusals %v, want only the late one's", errs)
	}
	closedByPeer(t, bad, "the late one")
	closedByPeer(t, silent, "the silent one")
}
