package collective

import (
	"bytes"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"io"
	"runtime"
	"strings"
	"testing"
)

// encodeFrame returns the frame carrying payload under h.
func encodeFrame(h Header, payload []byte) []byte {
	var hdr [frameHeaderSize]byte
	putFrameHeader(&hdr, h)
	f := append(hdr[:], payload...)
	return binary.LittleEndian.AppendUint32(f, frameChecksum(hdr[:], payload))
}

// pattern returns n bytes that depend on seed.
func pattern(n int, seed uint64) []byte {
	b := make([]byte, n)
	x := seed*0x9e3779b97f4a7c15 + 1
	for i := range b {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		b[i] = byte(x)
	}
	return b
}

func TestChecksumIsCastagnoli(t *testing.T) {
	// The CRC-32C check value (RFC 3720, appendix B.4).
	if got := frameChecksum([]byte("1234"), []byte("56789")); got != 0xe3069283 {
		t.Fatalf("checksum of 123456789 = %#08x, want 0xe3069283", got)
	}
}

func TestFrameGolden(t *testing.T) {
	h := Header{Batch: 0x0102030405060708, Rows: 2, Cols: 3, DType: BF16}
	payload := []byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}
	want := []byte{
		'T', 'N', 'D', 'F',
		ProtocolVersion, 0, // version
		2, 0, // dtype bf16
		8, 7, 6, 5, 4, 3, 2, 1, // batch
		2, 0, 0, 0, // rows
		3, 0, 0, 0, // cols
		12, 0, 0, 0, 0, 0, 0, 0, // payload length
	}
	want = append(want, payload...)
	want = binary.LittleEndian.AppendUint32(want, crc32.Checksum(want, crc32.MakeTable(crc32.Castagnoli)))
	if got := encodeFrame(h, payload); !bytes.Equal(got, want) {
		t.Fatalf("frame\n got %x\nwant %x", got, want)
	}
}

func TestReadFrame(t *testing.T) {
	want := Header{Batch: 7, Rows: 3, Cols: 4, DType: BF16}
	payload := pattern(want.Bytes(), 1)
	good := encodeFrame(want, payload)
	total := len(good) // 32 + 24 + 4
	put32 := func(off int, v uint32) func([]byte) []byte {
		return func(f []byte) []byte { binary.LittleEndian.PutUint32(f[off:], v); return f }
	}
	tests := []struct {
		name    string
		corrupt func([]byte) []byte
		n       int    // bytes consumed
		err     string // "" for success
		closed  bool   // error wraps ErrClosed
	}{
		{"ok", func(f []byte) []byte { return f }, total, "", false},
		{"next frame follows", func(f []byte) []byte { return append(f, good...) }, total, "", false},
		{"bad magic", func(f []byte) []byte { f[0] = 'X'; return f }, 32, "bad frame magic: got 0x46444e58, want 0x46444e54", false},
		{"bad version", func(f []byte) []byte { f[4] = 1; return f }, 32, "frame protocol version: got 1, want 2", false},
		{"dtype field out of range", func(f []byte) []byte { f[7] = 1; return f }, 32, "frame dtype field: got 258, want 2", false},
		{"other batch", func(f []byte) []byte { f[8] = 8; return f }, 32, "frame header mismatch: got batch 8, want 7", false},
		{"other rows and cols", func(f []byte) []byte { return put32(20, 3)(put32(16, 4)(f)) }, 32, "got rows 4, want 3; cols 3, want 4", false},
		{"other dtype", func(f []byte) []byte { f[6] = byte(F16); return f }, 32, "got dtype f16, want bf16", false},
		{"payload length", func(f []byte) []byte { f[24] = 25; return f }, 32, "frame payload length: got 25, want 24", false},
		{"huge payload length", func(f []byte) []byte { return put32(28, 1<<31)(f) }, 32, "frame payload length: got 9223372036854775832, want 24", false},
		{"payload bit flip", func(f []byte) []byte { f[40] ^= 0x10; return f }, total, "frame checksum mismatch", false},
		{"checksum bit flip", func(f []byte) []byte { f[total-1] ^= 0x80; return f }, total, "frame checksum mismatch", false},
		{"empty", func(f []byte) []byte { return f[:0] }, 0, "peer closed the link", true},
		{"cut in header", func(f []byte) []byte { return f[:10] }, 10, "truncated frame: got 10 of 60 bytes (stream ended in the header)", false},
		{"cut in payload", func(f []byte) []byte { return f[:45] }, 45, "truncated frame: got 45 of 60 bytes (stream ended in the payload)", false},
		{"cut in checksum", func(f []byte) []byte { return f[:58] }, 58, "truncated frame: got 58 of 60 bytes (stream ended in the checksum)", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			data := tt.corrupt(bytes.Clone(good))
			dst := bytes.Repeat([]byte{0xaa}, want.Bytes()+8)
			var scratch [frameHeaderSize]byte
			n, err := readFrame(bytes.NewReader(data), &scratch, want, dst)
			if n != tt.n {
				t.Errorf("consumed %d bytes, want %d", n, tt.n)
			}
			if tt.err == "" {
				if err != nil {
					t.Fatalf("readFrame: %v", err)
				}
				if !bytes.Equal(dst[:want.Bytes()], payload) {
					t.Fatalf("payload\n got %x\nwant %x", dst[:want.Bytes()], payload)
				}
			} else if err == nil || !strings.Contains(err.Error(), tt.err) {
				t.Fatalf("readFrame error %v, want one containing %q", err, tt.err)
			}
			if errors.Is(err, ErrClosed) != tt.closed {
				t.Errorf("errors.Is(%v, ErrClosed) = %v, want %v", err, !tt.closed, tt.closed)
			}
			if tail := dst[want.Bytes():]; !bytes.Equal(tail, bytes.Repeat([]byte{0xaa}, len(tail))) {
				t.Errorf("bytes past the payload were written: %x", tail)
			}
		})
	}
}

// endless is a reader of infinitely many bytes that counts what was read.
type endless struct {
	prefix []byte
	read   int
}

func (e *endless) Read(p []byte) (int, error) {
	for i := range p {
		if e.read+i < len(e.prefix) {
			p[i] = e.prefix[e.read+i]
		} else {
			p[i] = 0x55
		}
	}
	e.read += len(p)
	return len(p), nil
}

// A frame that claims a huge payload is rejected after its header: nothing
// more is read and nothing sized by the claim is allocated.
func TestReadFrameHugeClaim(t *testing.T) {
	want := Header{Batch: 1, Rows: 8, Cols: 8, DType: F32}
	bad := Header{Batch: 1, Rows: MaxDim, Cols: MaxDim, DType: F32}
	var hdr [frameHeaderSize]byte
	putFrameHeader(&hdr, bad)
	dst := make([]byte, want.Bytes())
	var scratch [frameHeaderSize]byte

	r := &endless{prefix: hdr[:]}
	if _, err := readFrame(r, &scratch, want, dst); err == nil || !strings.Contains(err.Error(), "rows 2147483647, want 8") {
		t.Fatalf("readFrame error %v, want a rows mismatch", err)
	}
	if r.read != frameHeaderSize {
		t.Fatalf("read %d bytes, want only the %d-byte header", r.read, frameHeaderSize)
	}

	const runs = 100
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range runs {
		_, _ = readFrame(&endless{prefix: hdr[:]}, &scratch, want, dst)
	}
	runtime.ReadMemStats(&after)
	if perRun := (after.TotalAlloc - before.TotalAlloc) / runs; perRun > 4096 {
		t.Fatalf("readFrame allocated %d bytes per rejected frame, want at most 4096", perRun)
	}
}

func FuzzDecodeFrame(f *testing.F) {
	h := Header{Batch: 3, Rows: 2, Cols: 3, DType: F32}
	good := encodeFrame(h, pattern(h.Bytes(), 2))
	f.Add(good, uint64(3), uint8(2), uint8(3), uint8(F32))
	f.Add(good[:40], uint64(3), uint8(2), uint8(3), uint8(F32))
	f.Add(good, uint64(4), uint8(2), uint8(3), uint8(F32))
	f.Add(encodeFrame(Header{DType: I32}, nil), uint64(0), uint8(0), uint8(0), uint8(I32))
	f.Add([]byte("GET / HTTP/1.1\r\n\r\n"), uint64(0), uint8(1), uint8(1), uint8(BF16))
	f.Fuzz(func(t *testing.T, data []byte, batch uint64, rows, cols, dtype uint8) {
		want := Header{Batch: batch, Rows: int(rows % 16), Cols: int(cols % 16), DType: DType(dtype%4 + 1)}
		dst := bytes.Repeat([]byte{0xaa}, want.Bytes()+4)
		r := bytes.NewReader(data)
		var scratch [frameHeaderSize]byte
		n, err := readFrame(r, &scratch, want, dst)
		if consumed := len(data) - r.Len(); consumed != n {
			t.Fatalf("reported %d bytes consumed, read %d", n, consumed)
		}
		if n > frameSize(want) {
			t.Fatalf("consumed %d bytes of a %d-byte frame", n, frameSize(want))
		}
		if !bytes.Equal(dst[want.Bytes():], []byte{0xaa, 0xaa, 0xaa, 0xaa}) {
			t.Fatalf("wrote past the payload: %x", dst[want.Bytes():])
		}
		if err != nil {
			if errors.Is(err, ErrClosed) != (len(data) == 0) {
				t.Fatalf("error %v on %d bytes of input", err, len(data))
			}
			return
		}
		if enc := encodeFrame(want, dst[:want.Bytes()]); !bytes.Equal(data[:n], enc) {
			t.Fatalf("accepted frame %x, but %v with its payload encodes to %x", data[:n], want, enc)
		}
	})
}

// handshakeMsg builds a handshake message by hand from the documented
// layout.
func handshakeMsg(magic string, version uint16, text string) []byte {
	m := []byte(magic)
	m = binary.LittleEndian.AppendUint16(m, version)
	m = binary.LittleEndian.AppendUint16(m, uint16(len(text)))
	m = append(m, text...)
	return binary.LittleEndian.AppendUint32(m, crc32.Checksum(m, crc32.MakeTable(crc32.Castagnoli)))
}

func TestWriteHandshake(t *testing.T) {
	var buf bytes.Buffer
	if err := writeHandshake(&buf, helloMagic, "s0->s1"); err != nil {
		t.Fatal(err)
	}
	if want := handshakeMsg("TNDH", ProtocolVersion, "s0->s1"); !bytes.Equal(buf.Bytes(), want) {
		t.Fatalf("hello\n got %x\nwant %x", buf.Bytes(), want)
	}
}

func TestReadHandshake(t *testing.T) {
	good := handshakeMsg("TNDH", ProtocolVersion, "s0->s1")
	long := strings.Repeat("x", maxHandshakeText+1)
	tests := []struct {
		name string
		data []byte
		text string
		err  string
	}{
		{"ok", good, "s0->s1", ""},
		{"empty text", handshakeMsg("TNDH", ProtocolVersion, ""), "", ""},
		{"answer magic", handshakeMsg("TNDA", ProtocolVersion, "s0->s1"), "", "bad hello magic: got 0x41444e54, want 0x48444e54"},
		{"http", []byte("GET / HTTP/1.1\r\n\r\n"), "", "bad hello magic"},
		{"version", handshakeMsg("TNDH", 9, "s0->s1"), "", "hello protocol version: got 9, want 2"},
		{"text too long", handshakeMsg("TNDH", ProtocolVersion, long), "", "hello text length: got 1025, want at most 1024"},
		{"short header", good[:5], "", "read hello: got 5 of 8 header bytes"},
		{"short text", good[:10], "", "read hello: got 2 of 10 bytes after the header"},
		{"checksum", append(bytes.Clone(good[:len(good)-1]), good[len(good)-1]^1), "", "hello checksum mismatch"},
		{"text flip", append(append(bytes.Clone(good[:8]), "s0->s2"...), good[14:]...), "", "hello checksum mismatch"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			text, err := readHandshake(bytes.NewReader(tt.data), helloMagic, "hello")
			if tt.err == "" {
				if err != nil || text != tt.text {
					t.Fatalf("readHandshake = %q, %v; want %q", text, err, tt.text)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.err) {
				t.Fatalf("readHandshake error %v, want one containing %q", err, tt.err)
			}
		})
	}
}

func FuzzReadHandshake(f *testing.F) {
	f.Add(handshakeMsg("TNDH", ProtocolVersion, "s0->s1"))
	f.Add(handshakeMsg("TNDH", ProtocolVersion, ""))
	f.Add(handshakeMsg("TNDH", 1, "x"))
	f.Add([]byte("TNDH\x02\x00\xff\xff"))
	f.Fuzz(func(t *testing.T, data []byte) {
		r := bytes.NewReader(data)
		text, err := readHandshake(r, helloMagic, "hello")
		if err != nil {
			return
		}
		n := len(data) - r.Len()
		if want := handshakeMsg("TNDH", ProtocolVersion, text); !bytes.Equal(data[:n], want) {
			t.Fatalf("accepted %x as %q, which encodes to %x", data[:n], text, want)
		}
	})
}

// Reading from a reader that fails mid-frame reports the progress and the
// cause.
func TestReadFrameIOError(t *testing.T) {
	h := Header{Batch: 1, Rows: 1, Cols: 4, DType: F32}
	boom := errors.New("boom")
	r := io.MultiReader(bytes.NewReader(encodeFrame(h, make([]byte, 16))[:20]), errReader{boom})
	var scratch [frameHeaderSize]byte
	n, err := readFrame(r, &scratch, h, make([]byte, 16))
	if n != 20 || !errors.Is(err, boom) || !strings.Contains(err.Error(), "read frame header: got 20 of 52 bytes") {
		t.Fatalf("readFrame = %d, %v; want 20 bytes and boom with progress", n, err)
	}
}

type errReader struct{ err error }

func (e errReader) Read([]byte) (int, error) { return 0, e.err }
