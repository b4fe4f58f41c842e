package collective

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"slices"
)

// ProtocolVersion is the version of the TCP wire protocol. Both ends of a
// link must speak the same one. Version 2 added the challenge-response of
// the cluster credential to the handshake.
const ProtocolVersion = 2

// Wire format of the TCP transport; all integers are little-endian.
//
// A data frame is a 32-byte header, the payload, and a CRC-32C
// (Castagnoli) of header and payload:
//
//	off size field
//	  0    4 magic "TNDF"
//	  4    2 protocol version
//	  6    2 dtype
//	  8    8 batch id
//	 16    4 rows
//	 20    4 cols
//	 24    8 payload length in bytes
//	 32    n payload
//	32+n   4 CRC-32C of bytes [0, 32+n)
//
// The handshake is four messages of one layout, a mutual challenge-response
// on the cluster credential (package linkauth):
//
//  1. the dialer's hello, whose text is its nonce (linkauth.NonceSize
//     bytes) then the link name;
//  2. the listener's challenge, whose text is its nonce then its proof
//     (empty without a credential), or, when it rejects the link at once
//     (another name), its answer saying why;
//  3. the dialer's proof (empty without a credential);
//  4. the listener's answer, whose text is empty when it accepts the link
//     and says why when it rejects it.
//
// Each message:
//
//	off size field
//	  0    4 magic "TNDH" (hello), "TNDC" (challenge), "TNDP" (proof) or
//	         "TNDA" (answer)
//	  4    2 protocol version
//	  6    2 text length n (at most maxHandshakeText)
//	  8    n text
//	 8+n   4 CRC-32C of bytes [0, 8+n)
const (
	frameHeaderSize = 32
	frameTrailer    = 4
	frameMagic      = 'T' | 'N'<<8 | 'D'<<16 | 'F'<<24
	helloMagic      = 'T' | 'N'<<8 | 'D'<<16 | 'H'<<24
	answerMagic     = 'T' | 'N'<<8 | 'D'<<16 | 'A'<<24
	challengeMagic  = 'T' | 'N'<<8 | 'D'<<16 | 'C'<<24
	proofMagic      = 'T' | 'N'<<8 | 'D'<<16 | 'P'<<24

	handshakeHeaderSize = 8
	// maxHandshakeText bounds a handshake message's text; a rejection
	// reason is cut to fit.
	maxHandshakeText = 1024
	// MaxLinkName is the longest link name in bytes.
	MaxLinkName = 256
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// frameSize is the size on the wire of a frame carrying h.
func frameSize(h Header) int { return frameHeaderSize + h.Bytes() + frameTrailer }

// putFrameHeader encodes the header of a frame carrying h, which must be
// valid.
func putFrameHeader(dst *[frameHeaderSize]byte, h Header) {
	le := binary.LittleEndian
	le.PutUint32(dst[0:], frameMagic)
	le.PutUint16(dst[4:], ProtocolVersion)
	le.PutUint16(dst[6:], uint16(h.DType))
	le.PutUint64(dst[8:], h.Batch)
	le.PutUint32(dst[16:], uint32(h.Rows))
	le.PutUint32(dst[20:], uint32(h.Cols))
	le.PutUint64(dst[24:], uint64(h.Bytes()))
}

// frameChecksum is the CRC-32C of a frame's header and payload.
func frameChecksum(hdr, payload []byte) uint32 {
	return crc32.Update(crc32.Checksum(hdr, castagnoli), castagnoli, payload)
}

// readFrame reads one frame that must carry want, and its payload into
// dst[:want.Bytes()]; dst must be at least that long. Nothing the frame
// claims is trusted before it matched want, and nothing is allocated: the
// payload goes straight into dst. scratch holds the header and then the
// checksum. It returns how many bytes of the frame it consumed. A stream
// that ends before the frame starts gives an error wrapping ErrClosed; one
// that ends inside it, an error saying how much of the frame arrived.
func readFrame(r io.Reader, scratch *[frameHeaderSize]byte, want Header, dst []byte) (int, error) {
	total := frameSize(want)
	n, err := io.ReadFull(r, scratch[:])
	if err != nil {
		return n, frameReadError("header", n, total, err)
	}
	if err := checkFrameHeader(scratch, want); err != nil {
		return n, err
	}
	payload := dst[:want.Bytes()]
	sum := frameChecksum(scratch[:], nil)
	m, err := io.ReadFull(r, payload)
	n += m
	if err != nil {
		return n, frameReadError("payload", n, total, err)
	}
	sum = crc32.Update(sum, castagnoli, payload)
	m, err = io.ReadFull(r, scratch[:frameTrailer])
	n += m
	if err != nil {
		return n, frameReadError("checksum", n, total, err)
	}
	if got := binary.LittleEndian.Uint32(scratch[:]); got != sum {
		return n, fmt.Errorf("frame checksum mismatch: got %#08x, computed %#08x over %d bytes", got, sum, n-frameTrailer)
	}
	return n, nil
}

// checkFrameHeader checks an encoded frame header against want.
func checkFrameHeader(hdr *[frameHeaderSize]byte, want Header) error {
	le := binary.LittleEndian
	if m := le.Uint32(hdr[0:]); m != frameMagic {
		return fmt.Errorf("bad frame magic: got %#08x, want %#08x (%q)", m, uint32(frameMagic), "TNDF")
	}
	if v := le.Uint16(hdr[4:]); v != ProtocolVersion {
		return fmt.Errorf("frame protocol version: got %d, want %d", v, ProtocolVersion)
	}
	if d := le.Uint16(hdr[6:]); d > 0xff {
		return fmt.Errorf("frame dtype field: got %d, want %d (%v)", d, want.DType, want.DType)
	}
	got := Header{
		Batch: le.Uint64(hdr[8:]),
		Rows:  int(le.Uint32(hdr[16:])),
		Cols:  int(le.Uint32(hdr[20:])),
		DType: DType(le.Uint16(hdr[6:])),
	}
	if err := checkHeader(want, got); err != nil {
		return fmt.Errorf("frame %w", err)
	}
	if l := le.Uint64(hdr[24:]); l != uint64(want.Bytes()) {
		return fmt.Errorf("frame payload length: got %d, want %d for %v", l, want.Bytes(), want)
	}
	return nil
}

// frameReadError describes a read that failed after n of the total bytes
// of a frame while reading the named part.
func frameReadError(part string, n, total int, err error) error {
	switch {
	case n == 0 && errors.Is(err, io.EOF):
		return fmt.Errorf("peer closed the link: %w", ErrClosed)
	case errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF):
		return fmt.Errorf("truncated frame: got %d of %d bytes (stream ended in the %s)", n, total, part)
	}
	return fmt.Errorf("read frame %s: got %d of %d bytes: %w", part, n, total, err)
}

// writeHandshake writes a handshake message with the given magic and text,
// which must be at most maxHandshakeText bytes.
func writeHandshake(w io.Writer, magic uint32, text string) error {
	msg := make([]byte, handshakeHeaderSize, handshakeHeaderSize+len(text)+frameTrailer)
	le := binary.LittleEndian
	le.PutUint32(msg[0:], magic)
	le.PutUint16(msg[4:], ProtocolVersion)
	le.PutUint16(msg[6:], uint16(len(text)))
	msg = append(msg, text...)
	msg = le.AppendUint32(msg, crc32.Checksum(msg, castagnoli))
	_, err := w.Write(msg)
	return err
}

// readHandshake reads a handshake message that must carry magic (named
// what in errors) and returns its text. A message of another protocol
// version is an error; its text is not read.
func readHandshake(r io.Reader, magic uint32, what string) (string, error) {
	_, text, err := readHandshakeOf(r, what, magic)
	return text, err
}

// readHandshakeOf reads a handshake message carrying one of magics and
// returns its magic and text.
func readHandshakeOf(r io.Reader, what string, magics ...uint32) (uint32, string, error) {
	var hdr [handshakeHeaderSize]byte
	if n, err := io.ReadFull(r, hdr[:]); err != nil {
		return 0, "", fmt.Errorf("read %s: got %d of %d header bytes: %w", what, n, len(hdr), err)
	}
	le := binary.LittleEndian
	m := le.Uint32(hdr[0:])
	if !slices.Contains(magics, m) {
		return 0, "", fmt.Errorf("bad %s magic: got %#08x, want %#08x (not a tandem peer?)", what, m, magics[0])
	}
	if v := le.Uint16(hdr[4:]); v != ProtocolVersion {
		return 0, "", fmt.Errorf("%s protocol version: got %d, want %d (the peer runs another tandem version)", what, v, ProtocolVersion)
	}
	n := int(le.Uint16(hdr[6:]))
	if n > maxHandshakeText {
		return 0, "", fmt.Errorf("%s text length: got %d, want at most %d", what, n, maxHandshakeText)
	}
	body := make([]byte, n+frameTrailer)
	if k, err := io.ReadFull(r, body); err != nil {
		return 0, "", fmt.Errorf("read %s: got %d of %d bytes after the header: %w", what, k, len(body), err)
	}
	text := body[:n]
	sum := crc32.Update(crc32.Checksum(hdr[:], castagnoli), castagnoli, text)
	if got := le.Uint32(body[n:]); got != sum {
		return 0, "", fmt.Errorf("%s checksum mismatch: got %#08x, computed %#08x", what, got, sum)
	}
	return m, string(text), nil
}
