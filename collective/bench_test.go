package collective

import (
	"context"
	"testing"
)

// benchSizes are message sizes: a decode step's activations for a few
// sequences, and a prefill chunk's.
var benchSizes = []struct {
	name string
	h    Header
}{
	{"16KiB", Header{Rows: 4, Cols: 1024, DType: F32}},
	{"1MiB", Header{Rows: 256, Cols: 1024, DType: F32}},
}

// benchLink streams b.N messages of h from s to r.
func benchLink(b *testing.B, s Sender, r Receiver, h Header) {
	ctx := context.Background()
	done := make(chan error, 1)
	go func(h Header) {
		buf := make(Host, h.Bytes())
		for i := range b.N {
			h.Batch = uint64(i)
			if err := r.Recv(ctx, h, buf); err != nil {
				// Unblock the sender.
				r.Close()
				done <- err
				return
			}
		}
		done <- nil
	}(h)
	buf := make(Host, h.Bytes())
	b.SetBytes(int64(h.Bytes()))
	b.ResetTimer()
	for i := range b.N {
		h.Batch = uint64(i)
		if err := s.Send(ctx, h, buf); err != nil {
			b.Fatalf("%v (receiver: %v)", err, <-done)
		}
	}
	if err := <-done; err != nil {
		b.Fatal(err)
	}
}

func BenchmarkTCPThroughput(b *testing.B) {
	for _, size := range benchSizes {
		b.Run(size.name, func(b *testing.B) {
			s, r := tcpPair(b, "bench")
			benchLink(b, s, r, size.h)
		})
	}
}

func BenchmarkPipe(b *testing.B) {
	for _, size := range benchSizes {
		b.Run(size.name, func(b *testing.B) {
			s, r := Pipe(4)
			defer s.Close()
			defer r.Close()
			benchLink(b, s, r, size.h)
		})
	}
}
