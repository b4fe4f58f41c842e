package collective

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"
)

// transports opens a linked Sender and Receiver of each transport; the test
// closes both ends when it ends.
var transports = []struct {
	name string
	open func(t *testing.T) (Sender, Receiver)
}{
	{"pipe", func(t *testing.T) (Sender, Receiver) {
		s, r := Pipe(4)
		t.Cleanup(func() { s.Close(); r.Close() })
		return s, r
	}},
	{"tcp", func(t *testing.T) (Sender, Receiver) { return tcpPair(t, "s0->s1") }},
}

// tcpPair links a Sender and a Receiver over loopback TCP.
func tcpPair(t testing.TB, link string) (Sender, Receiver) {
	t.Helper()
	ln, err := ListenConfig{Link: link, Logger: discardLogger}.Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	type accepted struct {
		r   Receiver
		err error
	}
	ch := make(chan accepted, 1)
	go func() {
		r, err := ln.Accept(ctx)
		ch <- accepted{r, err}
	}()
	s, err := DialConfig{Link: link}.Dial(ctx, ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	a := <-ch
	if a.err != nil {
		s.Close()
		t.Fatal(a.err)
	}
	t.Cleanup(func() { s.Close(); a.r.Close() })
	return s, a.r
}

var discardLogger = slog.New(slog.NewTextHandler(io.Discard, nil))

func within(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// wantErr fails the test unless err wraps target and says want.
func wantErr(t *testing.T, err, target error, want string) {
	t.Helper()
	if err == nil {
		t.Fatalf("got no error, want %q", want)
	}
	if target != nil && !errors.Is(err, target) {
		t.Fatalf("error %q does not wrap %v", err, target)
	}
	if !strings.Contains(err.Error(), want) {
		t.Fatalf("error %q does not say %q", err, want)
	}
}

// msgHeader is the header of the i-th message of the ordering test: sizes
// and dtypes vary, some messages are empty.
func msgHeader(i int) Header {
	return Header{Batch: uint64(1000 + i), Rows: i % 9, Cols: 1 + i%300, DType: DType(1 + i%4)}
}

func TestOrderAndCopy(t *testing.T) {
	const n = 300
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			s, r := tr.open(t)
			ctx := within(t, 20*time.Second)
			sent := make(chan error, 1)
			go func() {
				buf := make(Host, 64<<10)
				for i := range n {
					h := msgHeader(i)
					copy(buf, pattern(h.Bytes(), uint64(i)))
					if err := s.Send(ctx, h, buf); err != nil {
						sent <- err
						return
					}
					// The transport must be done with buf.
					clear(buf)
				}
				sent <- nil
			}()
			buf := make(Host, 64<<10)
			for i := range n {
				h := msgHeader(i)
				for j := range buf {
					buf[j] = 0xee
				}
				if err := r.Recv(ctx, h, buf); err != nil {
					t.Fatalf("message %d: %v", i, err)
				}
				if want := pattern(h.Bytes(), uint64(i)); !bytes.Equal(buf[:h.Bytes()], want) {
					t.Fatalf("message %d (%v): payload differs", i, h)
				}
				if buf[h.Bytes()] != 0xee {
					t.Fatalf("message %d (%v): byte past the payload overwritten", i, h)
				}
			}
			if err := <-sent; err != nil {
				t.Fatal(err)
			}
		})
	}
}

// notHost is a Buffer the host transports cannot use.
type notHost struct{}

func (notHost) Len() int { return 1 << 20 }

func TestBadArguments(t *testing.T) {
	ok := Header{Batch: 1, Rows: 2, Cols: 4, DType: F32}
	tests := []struct {
		name string
		h    Header
		b    Buffer
		err  string
	}{
		{"unknown dtype", Header{Batch: 1, Rows: 1, Cols: 1, DType: 9}, make(Host, 8), "unknown dtype"},
		{"negative rows", Header{Rows: -1, Cols: 1, DType: F32}, make(Host, 8), "rows -1 out of range"},
		{"too many cols", Header{Rows: 1, Cols: MaxDim + 1, DType: F32}, make(Host, 8), "cols 2147483648 out of range"},
		{"too large", Header{Rows: MaxDim, Cols: MaxDim, DType: F32}, make(Host, 8), "payload larger than 1099511627776 bytes"},
		{"buffer too small", ok, make(Host, 31), "batch 1 [2x4 f32] needs 32 bytes, buffer holds 31"},
		{"device buffer", ok, notHost{}, "buffer is collective.notHost, want collective.Host"},
		{"nil buffer", ok, nil, "buffer is <nil>"},
	}
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			s, r := tr.open(t)
			ctx := within(t, 5*time.Second)
			for _, tt := range tests {
				wantErr(t, s.Send(ctx, tt.h, tt.b), nil, tt.err)
				wantErr(t, r.Recv(ctx, tt.h, tt.b), nil, tt.err)
			}
			// A bad call moves no byte: the link still works.
			if err := s.Send(ctx, ok, make(Host, 32)); err != nil {
				t.Fatal(err)
			}
			if err := r.Recv(ctx, ok, make(Host, 32)); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestHeaderMismatchBreaksLink(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			s, r := tr.open(t)
			ctx := within(t, 5*time.Second)
			buf := make(Host, 64)
			for _, b := range []uint64{1, 2} {
				if err := s.Send(ctx, Header{Batch: b, Rows: 2, Cols: 8, DType: F32}, buf); err != nil {
					t.Fatal(err)
				}
			}
			err := r.Recv(ctx, Header{Batch: 9, Rows: 2, Cols: 8, DType: BF16}, buf)
			wantErr(t, err, nil, "header mismatch: got batch 1, want 9; dtype f32, want bf16")
			again := r.Recv(ctx, Header{Batch: 2, Rows: 2, Cols: 8, DType: F32}, buf)
			if again != err {
				t.Fatalf("second Recv: %v, want the first error again", again)
			}
		})
	}
}

func TestRecvCancel(t *testing.T) {
	h := Header{Batch: 5, Rows: 1, Cols: 4, DType: F32}
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			s, r := tr.open(t)
			buf := make(Host, 16)

			ctx, cancel := context.WithCancel(context.Background())
			time.AfterFunc(50*time.Millisecond, cancel)
			start := time.Now()
			wantErr(t, r.Recv(ctx, h, buf), context.Canceled, "recv batch 5")
			if d := time.Since(start); d > 2*time.Second {
				t.Fatalf("cancelled Recv returned after %v", d)
			}

			ctx, cancel = context.WithTimeout(context.Background(), 50*time.Millisecond)
			defer cancel()
			wantErr(t, r.Recv(ctx, h, buf), context.DeadlineExceeded, "deadline exceeded")

			// Cancelled while idle: the link still works.
			ctx = within(t, 5*time.Second)
			copy(buf, "0123456789abcdef")
			if err := s.Send(ctx, h, buf); err != nil {
				t.Fatal(err)
			}
			clear(buf)
			if err := r.Recv(ctx, h, buf); err != nil {
				t.Fatal(err)
			}
			if string(buf) != "0123456789abcdef" {
				t.Fatalf("payload %q", buf)
			}
		})
	}
}

func TestCloseSenderDrains(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			s, r := tr.open(t)
			ctx := within(t, 5*time.Second)
			buf := make(Host, 8)
			for i := range 3 {
				if err := s.Send(ctx, Header{Batch: uint64(i), Rows: 1, Cols: 2, DType: F32}, buf); err != nil {
					t.Fatal(err)
				}
			}
			if err := s.Close(); err != nil {
				t.Fatal(err)
			}
			if err := s.Close(); err != nil {
				t.Fatalf("second Close: %v", err)
			}
			wantErr(t, s.Send(ctx, Header{Rows: 1, Cols: 2, DType: F32}, buf), ErrClosed, "sender closed")
			for i := range 3 {
				if err := r.Recv(ctx, Header{Batch: uint64(i), Rows: 1, Cols: 2, DType: F32}, buf); err != nil {
					t.Fatalf("message %d sent before Close: %v", i, err)
				}
			}
			wantErr(t, r.Recv(ctx, Header{Batch: 3, Rows: 1, Cols: 2, DType: F32}, buf), ErrClosed, "closed")
		})
	}
}

func TestCloseUnblocksRecv(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			_, r := tr.open(t)
			time.AfterFunc(50*time.Millisecond, func() { r.Close() })
			start := time.Now()
			err := r.Recv(within(t, 10*time.Second), Header{Rows: 1, Cols: 1, DType: F32}, make(Host, 4))
			wantErr(t, err, ErrClosed, "receiver closed")
			if d := time.Since(start); d > 2*time.Second {
				t.Fatalf("Close unblocked Recv after %v", d)
			}
		})
	}
}

// Once the receiver closed, the sender fails promptly, however much the
// transport buffers.
func TestCloseReceiverFailsSend(t *testing.T) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) {
			s, r := tr.open(t)
			if err := r.Close(); err != nil {
				t.Fatal(err)
			}
			ctx := within(t, 5*time.Second)
			h := Header{Rows: 64, Cols: 64, DType: F32}
			buf := make(Host, h.Bytes())
			var err error
			for i := 0; err == nil; i++ {
				if i == 100 {
					t.Fatal("100 Sends after the receiver closed succeeded")
				}
				err = s.Send(ctx, h, buf)
				time.Sleep(time.Millisecond)
			}
			wantErr(t, err, ErrClosed, "receiver closed")
		})
	}
}
