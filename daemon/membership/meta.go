package membership

import (
	"encoding/binary"
	"errors"
	"fmt"
	"unicode/utf8"

	"github.com/hashicorp/memberlist"
)

// Meta is the metadata a daemon gossips about itself. It travels in
// memberlist's node metadata, so its encoding must stay under
// memberlist.MetaMaxSize (512 bytes); New and UpdateMeta refuse a Meta that
// does not fit.
type Meta struct {
	// Name is the node name; empty means Config.NodeName.
	Name string
	// Backend is the stage backend: "cpu" or "cuda".
	Backend string
	// Device names the device (a GPU model, or the CPU).
	Device string
	// MemTotal and MemFree are the device memory in bytes.
	MemTotal, MemFree uint64
	// GRPCAddr and DataAddr are the host:port of the daemon's gRPC server
	// and of its data plane (activations).
	GRPCAddr, DataAddr string
	// Version is the daemon's software version.
	Version string
	// ModelID identifies the model the daemon serves (a hash of its
	// config and weights' headers); stages must match the leader's.
	ModelID string
	// LeaderEligible is true when the node may be chosen leader.
	LeaderEligible bool
	// Protocol names the internal protocol versions the daemon speaks
	// (nodewire.Protocol); the leader places only stage nodes that speak
	// its own. Empty from a daemon older than meta version 2.
	Protocol string
}

// The metadata wire format, version 2 (all integers unsigned varints,
// strings a varint length then UTF-8 bytes):
//
//	version byte (2)
//	flags byte (bit 0 LeaderEligible, bit 1 leaving)
//	Name, Backend, Device (strings)
//	MemTotal, MemFree (varints)
//	GRPCAddr, DataAddr, Version, ModelID (strings)
//	Protocol (string; version 2 on)
//
// A later version only appends fields and flag bits, so a decoder reads the
// fields it knows and ignores what follows; a version below 1 is invalid.
const metaVersion = 2

const (
	flagLeaderEligible = 1 << 0
	// flagLeaving is set by Leave before the node departs, so peers can
	// tell a graceful leave from a failure (memberlist reports both through
	// the same callback).
	flagLeaving = 1 << 1
)

// Backends a Meta may name.
const (
	BackendCPU  = "cpu"
	BackendCUDA = "cuda"
)

// validate checks the fields a daemon announces about itself.
func (m Meta) validate() error {
	if m.Backend != BackendCPU && m.Backend != BackendCUDA {
		return fmt.Errorf("meta backend %q: want %q or %q", m.Backend, BackendCPU, BackendCUDA)
	}
	for _, f := range m.strings() {
		if !utf8.ValidString(*f.v) {
			return fmt.Errorf("meta %s: not valid UTF-8", f.name)
		}
	}
	if m.MemFree > m.MemTotal {
		return fmt.Errorf("meta memory: free %d bytes exceeds total %d", m.MemFree, m.MemTotal)
	}
	return nil
}

type namedString struct {
	name string
	v    *string
}

// strings lists the string fields in wire order.
func (m *Meta) strings() []namedString {
	return []namedString{
		{"name", &m.Name}, {"backend", &m.Backend}, {"device", &m.Device},
		{"grpc address", &m.GRPCAddr}, {"data address", &m.DataAddr},
		{"version", &m.Version}, {"model id", &m.ModelID}, {"protocol", &m.Protocol},
	}
}

// encodeMeta encodes m with the given leaving flag. It fails when the
// result exceeds memberlist.MetaMaxSize.
func encodeMeta(m Meta, leaving bool) ([]byte, error) {
	var flags byte
	if m.LeaderEligible {
		flags |= flagLeaderEligible
	}
	if leaving {
		flags |= flagLeaving
	}
	b := []byte{metaVersion, flags}
	s := m.strings()
	for _, f := range s[:3] {
		b = appendString(b, *f.v)
	}
	b = binary.AppendUvarint(b, m.MemTotal)
	b = binary.AppendUvarint(b, m.MemFree)
	for _, f := range s[3:] {
		b = appendString(b, *f.v)
	}
	if len(b) > memberlist.MetaMaxSize {
		return nil, fmt.Errorf("encode meta: %d bytes, limit %d", len(b), memberlist.MetaMaxSize)
	}
	return b, nil
}

func appendString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

// errShortMeta reports metadata cut in the middle of a field.
var errShortMeta = errors.New("truncated")

// decodeMeta decodes metadata gossiped by a peer (untrusted bytes).
func decodeMeta(b []byte) (m Meta, leaving bool, err error) {
	if len(b) > memberlist.MetaMaxSize {
		return Meta{}, false, fmt.Errorf("decode meta: %d bytes, limit %d", len(b), memberlist.MetaMaxSize)
	}
	if len(b) < 2 {
		return Meta{}, false, fmt.Errorf("decode meta header: %w", errShortMeta)
	}
	if b[0] < 1 {
		return Meta{}, false, fmt.Errorf("decode meta: version %d", b[0])
	}
	flags := b[1]
	d := metaDecoder{b: b[2:]}
	s := m.strings()
	for _, f := range s[:3] {
		*f.v = d.string(f.name)
	}
	m.MemTotal = d.uvarint("memory total")
	m.MemFree = d.uvarint("memory free")
	for _, f := range s[3:] {
		if f.v == &m.Protocol && b[0] < 2 {
			break // appended in version 2
		}
		*f.v = d.string(f.name)
	}
	if d.err != nil {
		return Meta{}, false, d.err
	}
	m.LeaderEligible = flags&flagLeaderEligible != 0
	return m, flags&flagLeaving != 0, nil
}

// metaDecoder reads fields in order and keeps the first error.
type metaDecoder struct {
	b   []byte
	err error
}

func (d *metaDecoder) uvarint(field string) uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.err = fmt.Errorf("decode meta %s: bad varint", field)
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *metaDecoder) string(field string) string {
	n := d.uvarint(field + " length")
	if d.err != nil {
		return ""
	}
	if n > uint64(len(d.b)) {
		d.err = fmt.Errorf("decode meta %s: length %d, %d bytes left: %w", field, n, len(d.b), errShortMeta)
		return ""
	}
	s := string(d.b[:n])
	d.b = d.b[n:]
	if !utf8.ValidString(s) {
		d.err = fmt.Errorf("decode meta %s: not valid UTF-8", field)
		return ""
	}
	return s
}
