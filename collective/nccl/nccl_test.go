package nccl

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/gpu/mockcuda"
)

var (
	mock    *mockcuda.Lib
	mockErr error
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "nccl-mock")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	path, err := mockcuda.Build(dir)
	if err == nil {
		mock, err = mockcuda.Open(path)
	}
	if err == nil {
		err = gpu.Init(gpu.Config{LibCUDA: path, NVRTC: path, CUBLAS: path, NCCL: path})
	}
	mockErr = err
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// pair is two ranks of a mock communicator on one mock device, with a
// Sender on rank 0 and a Receiver on rank 1.
type pair struct {
	dev        *gpu.Device
	c0, c1     *gpu.NCCLComm
	send       *Sender
	recv       *Receiver
	src, dst   gpu.Mem
	stream     gpu.Stream
	maxMessage int
}

func newPair(t *testing.T, maxMessage int, nonBlocking bool) *pair {
	t.Helper()
	if errors.Is(mockErr, mockcuda.ErrNoCompiler) {
		t.Skip("skipping: no C compiler to build the mock CUDA library")
	}
	if mockErr != nil {
		t.Fatal(mockErr)
	}
	mock.Reset()
	dev, err := gpu.Open(0)
	if err != nil {
		t.Fatal(err)
	}
	p := &pair{dev: dev, maxMessage: maxMessage}
	id, err := NewUniqueID()
	if err != nil {
		t.Fatal(err)
	}
	if nonBlocking {
		ctx := context.Background()
		if p.c0, err = Connect(ctx, dev, 2, id, 0); err != nil {
			t.Fatal(err)
		}
		if p.c1, err = Connect(ctx, dev, 2, id, 1); err != nil {
			t.Fatal(err)
		}
		if got, want := mock.LastConfig(), [4]uint64{24, 0xcafebeef, 21400, 0}; got != want {
			t.Fatalf("ncclCommInitRankConfig got config %v, want %v", got, want)
		}
	}
	err = dev.Do(func() (err error) {
		if !nonBlocking {
			if p.c0, err = gpu.NCCLInitRank(2, id, 0); err != nil {
				return err
			}
			if p.c1, err = gpu.NCCLInitRank(2, id, 1); err != nil {
				return err
			}
		}
		if p.src, err = gpu.Alloc(maxMessage); err != nil {
			return err
		}
		if p.dst, err = gpu.Alloc(maxMessage); err != nil {
			return err
		}
		p.stream, err = gpu.NewStream()
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if p.send, err = NewSender(Config{Device: dev, Comm: p.c0, Peer: 1, Stream: p.stream}); err != nil {
		t.Fatal(err)
	}
	if p.recv, err = NewReceiver(Config{Device: dev, Comm: p.c1, Peer: 0, Stream: p.stream}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		mock.SetBusy(false)
		p.send.Close()
		p.recv.Close()
		dev.Do(func() error {
			p.c0.Destroy()
			p.c1.Destroy()
			p.src.Free()
			p.dst.Free()
			return p.stream.Destroy()
		})
		if err := dev.Close(); err != nil {
			t.Error(err)
		}
	})
	return p
}

func TestSendRecvMock(t *testing.T) {
	for _, nonBlocking := range []bool{false, true} {
		t.Run(fmt.Sprintf("nonblocking=%v", nonBlocking), func(t *testing.T) {
			testSendRecv(t, newPair(t, 1<<16, nonBlocking))
		})
	}
}

func testSendRecv(t *testing.T, p *pair) {
	ctx := context.Background()
	for batch, rows := range []int{1, 7, 32} {
		h := collective.Header{Batch: uint64(batch), Rows: rows, Cols: 512, DType: collective.BF16}
		data := make([]byte, h.Bytes())
		for i := range data {
			data[i] = byte(rand.Uint32())
		}
		if err := p.dev.Do(func() error { return gpu.CopyHtoD(p.src.Ptr(), data) }); err != nil {
			t.Fatal(err)
		}
		if err := p.send.Send(ctx, h, p.src); err != nil {
			t.Fatal(err)
		}
		if err := p.recv.Recv(ctx, h, p.dst); err != nil {
			t.Fatal(err)
		}
		// Read after the stream: an ordered link (Config.Ordered) has
		// waited for nothing.
		got := make([]byte, h.Bytes())
		if err := p.dev.Do(func() error {
			if err := p.stream.Synchronize(); err != nil {
				return err
			}
			return gpu.CopyDtoH(got, p.dst.Ptr())
		}); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, data) {
			t.Fatalf("batch %d: received data differs", batch)
		}
	}
}

func TestTransferChecks(t *testing.T) {
	p := newPair(t, 1024, false)
	ctx := context.Background()
	tests := []struct {
		name string
		h    collective.Header
		b    collective.Buffer
		want string
	}{
		{"host buffer", collective.Header{Rows: 1, Cols: 4, DType: collective.F32}, collective.Host(make([]byte, 16)), "collective.Host is not device memory"},
		{"too large", collective.Header{Rows: 2, Cols: 512, DType: collective.F32}, p.src, "4096 bytes do not fit the 1024-byte buffer"},
		{"bad dtype", collective.Header{Rows: 1, Cols: 4, DType: 0}, p.src, "invalid header"},
		{"negative rows", collective.Header{Rows: -1, Cols: 4, DType: collective.BF16}, p.src, "invalid header"},
	}
	for _, tc := range tests {
		err := p.send.Send(ctx, tc.h, tc.b)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want %q", tc.name, err, tc.want)
		}
	}
	if mock.Aborts() != 0 {
		t.Fatal("a rejected message aborted the communicator")
	}
	if err := p.send.Send(ctx, collective.Header{Rows: 0, Cols: 4, DType: collective.BF16}, p.src); err != nil {
		t.Fatalf("empty message: %v", err)
	}
	if _, err := NewSender(Config{Device: p.dev, Comm: p.c0, Peer: 0}); err == nil {
		t.Fatal("NewSender accepted itself as peer")
	}
	if _, err := NewReceiver(Config{Device: p.dev, Comm: p.c0, Peer: 2}); err == nil {
		t.Fatal("NewReceiver accepted a peer outside the communicator")
	}
	p.send.Close()
	if err := p.send.Send(ctx, collective.Header{Rows: 1, Cols: 4, DType: collective.BF16}, p.src); err == nil || !strings.Contains(err.Error(), "closed") {
		t.Fatalf("Send after Close: %v", err)
	}
}

func TestLostPeerTimesOut(t *testing.T) {
	// The transfer never completes (blocking communicator: the stream
	// stays busy; non-blocking: the group stays in progress).
	for _, nonBlocking := range []bool{false, true} {
		t.Run(fmt.Sprintf("nonblocking=%v", nonBlocking), func(t *testing.T) {
			p := newPair(t, 1024, nonBlocking)
			mock.SetBusy(true)
			ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
			defer cancel()
			h := collective.Header{Batch: 9, Rows: 4, Cols: 64, DType: collective.BF16}
			start := time.Now()
			err := p.recv.Recv(ctx, h, p.dst)
			if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "nccl recv batch 9") || !strings.Contains(err.Error(), "communicator aborted") {
				t.Fatalf("Recv = %v, want a deadline error that aborted the communicator", err)
			}
			if el := time.Since(start); el > 2*time.Second {
				t.Fatalf("Recv returned %v after its 50 ms deadline", el)
			}
			if mock.Aborts() != 1 {
				t.Fatalf("%d aborts, want 1", mock.Aborts())
			}
			if err := p.recv.Recv(context.Background(), h, p.dst); !errors.Is(err, gpu.ErrCommAborted) {
				t.Fatalf("Recv after abort = %v", err)
			}
		})
	}
}

func TestConnectTimesOut(t *testing.T) {
	p := newPair(t, 64, false)
	mock.SetBusy(true) // the other rank never joins
	id, err := NewUniqueID()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	_, err = Connect(ctx, p.dev, 2, id, 0)
	if !errors.Is(err, context.DeadlineExceeded) || mock.Aborts() != 1 {
		t.Fatalf("Connect = %v (%d aborts), want a deadline error and an abort", err, mock.Aborts())
	}
}

func TestAsyncErrorAborts(t *testing.T) {
	p := newPair(t, 1024, false)
	mock.SetBusy(true)
	mock.SetAsyncError(6) // ncclRemoteError
	defer mock.SetAsyncError(0)
	h := collective.Header{Rows: 4, Cols: 64, DType: collective.BF16}
	err := p.send.Send(context.Background(), h, p.src)
	var e *gpu.Error
	if !errors.As(err, &e) || e.Name != "ncclRemoteError" || mock.Aborts() != 1 {
		t.Fatalf("Send = %v (%d aborts), want ncclRemoteError and an abort", err, mock.Aborts())
	}
}

// setWait replaces the pair's Sender and Receiver with ones that spin and
// sleep as given.
func (p *pair) setWait(t *testing.T, spin, sleep time.Duration) {
	t.Helper()
	p.send.Close()
	p.recv.Close()
	var err error
	if p.send, err = NewSender(Config{Device: p.dev, Comm: p.c0, Peer: 1, Stream: p.stream, Spin: spin, Sleep: sleep}); err != nil {
		t.Fatal(err)
	}
	if p.recv, err = NewReceiver(Config{Device: p.dev, Comm: p.c1, Peer: 0, Stream: p.stream, Spin: spin, Sleep: sleep}); err != nil {
		t.Fatal(err)
	}
}

// TestWaitPhases checks that a send's wait ends on completion, on an
// asynchronous error and on its deadline, each arriving while it spins
// and while it sleeps between checks. A phase is made to last a minute
// and the call's context 10 s (or 30 ms for the deadline cases), so a wait
// that missed the event in that phase would end in a deadline error, or
// take a minute, instead.
func TestWaitPhases(t *testing.T) {
	const long = time.Minute
	tests := []struct {
		name        string
		spin, sleep time.Duration
		timeout     time.Duration
		later       func() // after 30 ms, while the send waits
		wantErr     string // "" for success
	}{
		{"completes while spinning", long, long, 10 * time.Second, func() { mock.SetBusy(false) }, ""},
		{"completes while sleeping", -1, 5 * time.Millisecond, 10 * time.Second, func() { mock.SetBusy(false) }, ""},
		{"async error while spinning", long, long, 10 * time.Second, func() { mock.SetAsyncError(6) }, "ncclRemoteError"},
		{"async error while sleeping", -1, 5 * time.Millisecond, 10 * time.Second, func() { mock.SetAsyncError(6) }, "ncclRemoteError"},
		{"deadline while spinning", long, long, 30 * time.Millisecond, nil, context.DeadlineExceeded.Error()},
		{"deadline while sleeping", -1, long, 30 * time.Millisecond, nil, context.DeadlineExceeded.Error()},
	}
	for _, nonBlocking := range []bool{false, true} {
		for _, tc := range tests {
			t.Run(fmt.Sprintf("%s/nonblocking=%v", tc.name, nonBlocking), func(t *testing.T) {
				p := newPair(t, 1024, nonBlocking)
				p.setWait(t, tc.spin, tc.sleep)
				defer mock.SetAsyncError(0)
				mock.SetBusy(true)
				ctx, cancel := context.WithTimeout(context.Background(), tc.timeout)
				defer cancel()
				done := make(chan struct{})
				if tc.later != nil {
					go func() {
						defer close(done)
						time.Sleep(30 * time.Millisecond)
						tc.later()
					}()
				} else {
					close(done)
				}
				h := collective.Header{Batch: 3, Rows: 4, Cols: 64, DType: collective.BF16}
				data := make([]byte, h.Bytes())
				for i := range data {
					data[i] = byte(i*13 + 5)
				}
				if err := p.dev.Do(func() error { return gpu.CopyHtoD(p.src.Ptr(), data) }); err != nil {
					t.Fatal(err)
				}
				start := time.Now()
				err := p.send.Send(ctx, h, p.src)
				elapsed := time.Since(start)
				<-done
				if elapsed > 20*time.Second {
					t.Fatalf("Send took %v", elapsed)
				}
				if tc.wantErr == "" {
					if err != nil || mock.Aborts() != 0 {
						t.Fatalf("Send = %v (%d aborts), want success", err, mock.Aborts())
					}
					if err := p.recv.Recv(context.Background(), h, p.dst); err != nil {
						t.Fatalf("Recv after the send: %v", err)
					}
					got := make([]byte, h.Bytes())
					if err := p.dev.Do(func() error { return gpu.CopyDtoH(got, p.dst.Ptr()) }); err != nil {
						t.Fatal(err)
					}
					if !bytes.Equal(got, data) {
						t.Fatal("received data differs from the data sent")
					}
					return
				}
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) || !strings.Contains(err.Error(), "nccl send batch 3") || mock.Aborts() != 1 {
					t.Fatalf("Send = %v (%d aborts), want %q naming the batch and one abort", err, mock.Aborts(), tc.wantErr)
				}
			})
		}
	}
}

func TestUniqueIDRoundTrip(t *testing.T) {
	var id gpu.NCCLUniqueID
	for i := range id.Internal {
		id.Internal[i] = byte(rand.Uint32())
	}
	b := EncodeUniqueID(id)
	got, err := DecodeUniqueID(b)
	if err != nil || got != id {
		t.Fatalf("round trip: %v", err)
	}
	b[0] ^= 1
	if got.Internal[0] != id.Internal[0] {
		t.Fatal("encoded bytes alias the id")
	}
	for _, n := range []int{0, 127, 129} {
		if _, err := DecodeUniqueID(make([]byte, n)); err == nil {
			t.Errorf("DecodeUniqueID accepted %d bytes", n)
		}
	}
}

func FuzzDecodeUniqueID(f *testing.F) {
	f.Add(make([]byte, 128))
	f.Add([]byte("short"))
	f.Add(bytes.Repeat([]byte{0xff}, 200))
	f.Fuzz(func(t *testing.T, b []byte) {
		id, err := DecodeUniqueID(b)
		if (err == nil) != (len(b) == 128) {
			t.Fatalf("len %d: err %v", len(b), err)
		}
		if err == nil && !bytes.Equal(EncodeUniqueID(id), b) {
			t.Fatal("decode/encode changed the bytes")
		}
	})
}

// TestOrdered checks a link ordered on its stream (Config.Ordered): the
// transfers are on the stream when Send and Recv return, work ordered
// after them sees the data, a transfer that has not completed does not
// hold the caller, and once the communicator is aborted (as its owner does
// when the pipeline ends) a transfer fails instead of being ordered.
func TestOrdered(t *testing.T) {
	for _, nonBlocking := range []bool{false, true} {
		t.Run(fmt.Sprintf("nonblocking=%v", nonBlocking), func(t *testing.T) {
			p := newPair(t, 1<<16, nonBlocking)
			p.send.Close()
			p.recv.Close()
			var err error
			if p.send, err = NewSender(Config{Device: p.dev, Comm: p.c0, Peer: 1, Stream: p.stream, Ordered: true}); err != nil {
				t.Fatal(err)
			}
			if p.recv, err = NewReceiver(Config{Device: p.dev, Comm: p.c1, Peer: 0, Stream: p.stream, Ordered: true}); err != nil {
				t.Fatal(err)
			}
			testSendRecv(t, p)
			ctx := context.Background()
			h := collective.Header{Batch: 9, Rows: 3, Cols: 512, DType: collective.BF16}
			if !nonBlocking {
				// A transfer that never completes (the stream stays busy):
				// ordered, it returns at once, where a waiting link would
				// run into the deadline.
				mock.SetBusy(true)
				tctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				err := p.recv.Recv(tctx, h, p.dst)
				cancel()
				if err != nil {
					t.Fatalf("ordered Recv on a busy stream = %v, want nil", err)
				}
				mock.SetBusy(false)
			}
			if err := p.c1.Abort(); err != nil {
				t.Fatal(err)
			}
			if err := p.recv.Recv(ctx, h, p.dst); !errors.Is(err, gpu.ErrCommAborted) {
				t.Fatalf("ordered Recv after abort = %v, want %v", err, gpu.ErrCommAborted)
			}
		})
	}
}
