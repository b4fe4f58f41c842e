package membership

import (
	"bytes"
	"encoding/binary"
	"errors"
	"strings"
	"testing"

	"github.com/hashicorp/memberlist"
)

func TestMetaRoundTrip(t *testing.T) {
	tests := []struct {
		name    string
		meta    Meta
		leaving bool
	}{
		{"zero", Meta{}, false},
		{"full", Meta{Name: "gpu-07", Backend: BackendCUDA, Device: "NVIDIA H100 80GB HBM3", MemTotal: 85 << 30, MemFree: 84 << 30,
			GRPCAddr: "10.0.0.7:7070", DataAddr: "10.0.0.7:7071", Version: "v0.3.0", ModelID: strings.Repeat("ab", 32), LeaderEligible: true, Protocol: "node/1 control/1 data/2"}, false},
		{"leaving", Meta{Name: "cpu", Backend: BackendCPU, MemTotal: 1<<64 - 1, MemFree: 1}, true},
		{"unicode", Meta{Name: "nœud", Device: "日本"}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, err := encodeMeta(tt.meta, tt.leaving)
			if err != nil {
				t.Fatal(err)
			}
			got, leaving, err := decodeMeta(b)
			if err != nil {
				t.Fatal(err)
			}
			if got != tt.meta || leaving != tt.leaving {
				t.Errorf("round trip: %+v leaving %t, want %+v leaving %t", got, leaving, tt.meta, tt.leaving)
			}
		})
	}
}

// TestMetaWireFormat pins the encoding against a hand-built message, so a
// change of the format cannot go unnoticed.
func TestMetaWireFormat(t *testing.T) {
	m := Meta{Name: "n", Backend: "cpu", Device: "", MemTotal: 300, MemFree: 1, GRPCAddr: "g", DataAddr: "d", Version: "v", ModelID: "id", LeaderEligible: true, Protocol: "p"}
	want := []byte{2, flagLeaderEligible | flagLeaving,
		1, 'n', 3, 'c', 'p', 'u', 0,
		0xac, 0x02, 1, // 300 as a varint, then 1
		1, 'g', 1, 'd', 1, 'v', 2, 'i', 'd', 1, 'p'}
	got, err := encodeMeta(m, true)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("encoded % x, want % x", got, want)
	}
	// Version 1, without the protocol, decodes with none.
	v1 := append([]byte{1}, want[1:len(want)-2]...)
	old := m
	old.Protocol = ""
	if dm, _, err := decodeMeta(v1); err != nil || dm != old {
		t.Fatalf("version 1: %+v %v, want %+v", dm, err, old)
	}
	// A newer version with an extra trailing field still decodes.
	newer := append([]byte{3}, want[1:]...)
	newer = binary.AppendUvarint(newer, 99)
	dm, leaving, err := decodeMeta(newer)
	if err != nil || dm != m || !leaving {
		t.Fatalf("newer version: %+v %t %v, want %+v", dm, leaving, err, m)
	}
}

func TestMetaDecodeErrors(t *testing.T) {
	valid, err := encodeMeta(Meta{Name: "n", Backend: "cpu", ModelID: "id", Protocol: "p"}, false)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		b    []byte
		want string
	}{
		{"empty", nil, "header: truncated"},
		{"one byte", []byte{1}, "header: truncated"},
		{"version 0", []byte{0, 0}, "version 0"},
		{"no fields", []byte{1, 0}, "name length: bad varint"},
		{"cut string", valid[:len(valid)-3], "model id: length 2, 1 bytes left"},
		{"cut varint", []byte{1, 0, 0, 0, 0, 0x80}, "memory total: bad varint"},
		{"long varint", append([]byte{1, 0, 0, 0, 0}, bytes.Repeat([]byte{0xff}, 11)...), "memory total: bad varint"},
		{"bad utf8", []byte{1, 0, 1, 0xff}, "name: not valid UTF-8"},
		{"too long", make([]byte, memberlist.MetaMaxSize+1), "limit 512"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, _, err := decodeMeta(tt.b)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("decode % x: %v, want an error containing %q", tt.b, err, tt.want)
			}
		})
	}
	if _, _, err := decodeMeta(valid[:len(valid)-1]); !errors.Is(err, errShortMeta) {
		t.Errorf("cut meta: %v, want errShortMeta", err)
	}
}

// FuzzDecodeMeta feeds untrusted gossip metadata to the decoder: it must
// never panic, and what it accepts must re-encode to an equivalent
// message.
func FuzzDecodeMeta(f *testing.F) {
	for _, m := range []Meta{{}, {Name: "a", Backend: "cuda", MemTotal: 1 << 40, ModelID: "x"}} {
		b, err := encodeMeta(m, false)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{1, 3, 0x80})
	f.Add([]byte{9, 0, 1, 'a'})
	f.Fuzz(func(t *testing.T, b []byte) {
		m, leaving, err := decodeMeta(b)
		if err != nil {
			return
		}
		re, err := encodeMeta(m, leaving)
		if err != nil {
			t.Fatalf("decoded meta does not re-encode: %v", err)
		}
		m2, leaving2, err := decodeMeta(re)
		if err != nil || m2 != m || leaving2 != leaving {
			t.Fatalf("re-decode: %+v %t %v, want %+v %t", m2, leaving2, err, m, leaving)
		}
	})
}
