package safetensors

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"math"
	"strings"
	"testing"
)

func f32Bytes(vs ...float32) []byte {
	var b []byte
	for _, v := range vs {
		b = binary.LittleEndian.AppendUint32(b, math.Float32bits(v))
	}
	return b
}

// The exact bytes of a small file, spelled out by hand.
func TestWriteGolden(t *testing.T) {
	var buf bytes.Buffer
	err := Write(&buf, []WriteTensor{
		{Name: "x", DType: F32, Shape: []int{2}, Data: f32Bytes(1, 2)},
		{Name: "b", DType: BF16, Shape: []int{1}, Data: []byte{0x80, 0x3f}},
	}, map[string]string{"format": "pt"})
	if err != nil {
		t.Fatal(err)
	}
	hdr := `{"__metadata__":{"format":"pt"},"b":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]},"x":{"dtype":"F32","shape":[2],"data_offsets":[2,10]}}`
	for (8+len(hdr))%8 != 0 {
		hdr += " "
	}
	want := binary.LittleEndian.AppendUint64(nil, uint64(len(hdr)))
	want = append(want, hdr...)
	want = append(want, 0x80, 0x3f)
	want = append(want, f32Bytes(1, 2)...)
	if !bytes.Equal(buf.Bytes(), want) {
		t.Fatalf("got\n%q\nwant\n%q", buf.Bytes(), want)
	}
}

func TestWriteRoundTrip(t *testing.T) {
	tensors := []WriteTensor{
		{Name: "z.stream", DType: F16, Shape: []int{3}, Stream: func(w io.Writer) error {
			_, err := w.Write([]byte{0, 0x3c, 0, 0xc0, 0, 0x7c}) // 1, -2, +inf
			return err
		}},
		{Name: "a.scalar", DType: F32, Shape: nil, Data: f32Bytes(-0.5)},
		{Name: "m.empty", DType: BF16, Shape: []int{0, 4}, Data: []byte{}},
		{Name: "i.ints", DType: "I64", Shape: []int{1}, Data: make([]byte, 8)},
	}
	var buf bytes.Buffer
	if err := Write(&buf, tensors, nil); err != nil {
		t.Fatal(err)
	}
	h, err := ParseHeader(bytes.NewReader(buf.Bytes()), int64(buf.Len()))
	if err != nil {
		t.Fatal(err)
	}
	if h.DataOffset%8 != 0 || h.Metadata != nil {
		t.Errorf("data offset %d, metadata %v", h.DataOffset, h.Metadata)
	}
	if got := strings.Join(h.Names(), ","); got != "a.scalar,i.ints,m.empty,z.stream" {
		t.Fatalf("names %s", got)
	}
	data := buf.Bytes()[h.DataOffset:]
	// Laid out in name order, back to back.
	wantOff := map[string][2]int64{"a.scalar": {0, 4}, "i.ints": {4, 12}, "m.empty": {12, 12}, "z.stream": {12, 18}}
	for n, off := range wantOff {
		if ti := h.Tensors[n]; ti.Begin != off[0] || ti.End != off[1] {
			t.Errorf("%s at [%d, %d], want %v", n, ti.Begin, ti.End, off)
		}
	}
	if len(data) != 18 || !bytes.Equal(data[12:], []byte{0, 0x3c, 0, 0xc0, 0, 0x7c}) {
		t.Errorf("data %x", data)
	}
}

func TestWriteDeterministic(t *testing.T) {
	ts := []WriteTensor{
		{Name: "b", DType: F32, Shape: []int{1}, Data: f32Bytes(2)},
		{Name: "a", DType: F32, Shape: []int{1}, Data: f32Bytes(1)},
		{Name: "c<&>", DType: F32, Shape: []int{1}, Data: f32Bytes(3)},
	}
	md := map[string]string{"k2": "v", "k1": "v", "format": "pt"}
	var one, two bytes.Buffer
	if err := Write(&one, ts, md); err != nil {
		t.Fatal(err)
	}
	ts[0], ts[2] = ts[2], ts[0]
	if err := Write(&two, ts, md); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(one.Bytes(), two.Bytes()) {
		t.Fatal("input order changed the output")
	}
	if !bytes.Contains(one.Bytes(), []byte(`"c<&>"`)) {
		t.Error("names are HTML-escaped")
	}
}

func TestWriteErrors(t *testing.T) {
	one := f32Bytes(1)
	failing := errors.New("disk full")
	tests := []struct {
		name string
		ts   []WriteTensor
		want string
	}{
		{"duplicate", []WriteTensor{{Name: "a", DType: F32, Shape: []int{1}, Data: one}, {Name: "a", DType: F32, Shape: []int{1}, Data: one}}, `duplicate tensor "a"`},
		{"empty name", []WriteTensor{{DType: F32, Shape: []int{1}, Data: one}}, "empty name"},
		{"reserved", []WriteTensor{{Name: "__metadata__", DType: F32, Shape: []int{1}, Data: one}}, "reserved"},
		{"dtype", []WriteTensor{{Name: "a", DType: "F4", Shape: []int{1}, Data: one}}, `tensor "a": unknown dtype "F4"`},
		{"size", []WriteTensor{{Name: "a", DType: F32, Shape: []int{2}, Data: one}}, `tensor "a": 4 data bytes, shape [2] of F32 needs 8`},
		{"negative", []WriteTensor{{Name: "a", DType: F32, Shape: []int{-1}, Data: one}}, "negative"},
		{"neither", []WriteTensor{{Name: "a", DType: F32, Shape: []int{1}}}, "exactly one of Data and Stream"},
		{"short stream", []WriteTensor{{Name: "a", DType: F32, Shape: []int{2}, Stream: func(w io.Writer) error {
			_, err := w.Write(one)
			return err
		}}}, `tensor "a": stream wrote 4 bytes, want 8`},
		{"stream error", []WriteTensor{{Name: "a", DType: F32, Shape: []int{1}, Stream: func(io.Writer) error { return failing }}}, "disk full"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := Write(io.Discard, tt.ts, nil)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want one containing %q", err, tt.want)
			}
		})
	}
}
