package safetensors

import (
	"bytes"
	"encoding/binary"
	"runtime"
	"strings"
	"testing"
)

// rawFile assembles a file from a JSON header and dataLen zero bytes of data.
func rawFile(header string, dataLen int) []byte {
	b := binary.LittleEndian.AppendUint64(nil, uint64(len(header)))
	b = append(b, header...)
	return append(b, make([]byte, dataLen)...)
}

// withLength is a file whose length field says n whatever follows.
func withLength(n uint64, rest string) []byte {
	return append(binary.LittleEndian.AppendUint64(nil, n), rest...)
}

func TestParseHeaderValid(t *testing.T) {
	hdr := `{"__metadata__":{"format":"pt"},` +
		`"b":{"dtype":"BF16","shape":[2,3],"data_offsets":[8,20]},` +
		`"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},` +
		`"empty":{"dtype":"F16","shape":[0,9223372036854775807],"data_offsets":[4,4]},` +
		`"scalar":{"dtype":"I64","shape":[],"data_offsets":[24,32]}}   `
	file := rawFile(hdr, 32)
	h, err := ParseHeader(bytes.NewReader(file), int64(len(file)))
	if err != nil {
		t.Fatal(err)
	}
	if h.DataOffset != int64(8+len(hdr)) || string(h.Raw) != hdr {
		t.Errorf("DataOffset %d, Raw %q", h.DataOffset, h.Raw)
	}
	if h.Metadata["format"] != "pt" || len(h.Metadata) != 1 {
		t.Errorf("Metadata = %v", h.Metadata)
	}
	if got := strings.Join(h.Names(), ","); got != "a,b,empty,scalar" {
		t.Errorf("Names = %s", got)
	}
	b := h.Tensors["b"]
	if b.DType != BF16 || len(b.Shape) != 2 || b.Shape[0] != 2 || b.Shape[1] != 3 || b.Begin != 8 || b.End != 20 {
		t.Errorf("b = %+v", b)
	}
	if s := h.Tensors["scalar"]; len(s.Shape) != 0 || s.End-s.Begin != 8 {
		t.Errorf("scalar = %+v", s)
	}
}

func TestParseHeaderErrors(t *testing.T) {
	const a = `"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}`
	tests := []struct {
		name string
		file []byte
		want string
	}{
		{"short", []byte{1, 2, 3}, "read header length"},
		{"cap", withLength(200<<20, "{}"), "exceeds the 104857600 byte cap"},
		{"beyond file", withLength(20, "{}"), "header length 20 exceeds the 10 byte file"},
		{"huge length", withLength(1<<63, "{}"), "cap"},
		{"not json", rawFile(`{"a":`, 0), "invalid JSON"},
		{"array", rawFile(`[]`, 0), "not a JSON object"},
		{"empty", rawFile(``, 0), "invalid JSON"},
		{"trailing", rawFile(`{}{}`, 0), "data after the object"},
		{"duplicate", rawFile(`{`+a+`,`+a+`}`, 8), `duplicate key "a"`},
		{"unknown dtype", rawFile(`{"a":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}}`, 8), `tensor "a": unknown dtype "F4"`},
		{"negative dim", rawFile(`{"a":{"dtype":"F32","shape":[-1,2],"data_offsets":[0,8]}}`, 8), `tensor "a": shape [-1 2]: dimension 0 is negative`},
		{"fractional dim", rawFile(`{"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,8]}}`, 8), `tensor "a": entry`},
		{"size mismatch", rawFile(`{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}`, 16), `tensor "a": shape [3] of F32 is 12 bytes but data_offsets [0, 8] span 8`},
		{"overflow", rawFile(`{"a":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,0]}}`, 8), `tensor "a": shape [4294967296 4294967296 16] of F32 is larger than`},
		{"beyond data", rawFile(`{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}`, 8), `tensor "a": data_offsets [0, 16] beyond the 8 byte data section`},
		{"reversed", rawFile(`{"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}}`, 8), `tensor "a": data_offsets [8, 0] end before begin`},
		{"three offsets", rawFile(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}}`, 8), `tensor "a": data_offsets has 3 values`},
		{"negative offset", rawFile(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}}`, 8), `tensor "a": entry`},
		{"no dtype", rawFile(`{"a":{"shape":[2],"data_offsets":[0,8]}}`, 8), `tensor "a": missing dtype`},
		{"no shape", rawFile(`{"a":{"dtype":"F32","data_offsets":[0,8]}}`, 8), `tensor "a": missing shape`},
		{"no offsets", rawFile(`{"a":{"dtype":"F32","shape":[2]}}`, 8), `tensor "a": missing data_offsets`},
		{"entry not object", rawFile(`{"a":7}`, 8), `tensor "a": entry`},
		{"overlap", rawFile(`{`+a+`,"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}`, 12), `tensor "b" [4, 12] overlaps tensor "a" [0, 8]`},
		{"same range", rawFile(`{`+a+`,"b":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]}}`, 8), `overlaps`},
		{"metadata value", rawFile(`{"__metadata__":{"x":1}}`, 0), `__metadata__: key "x": value is not a string`},
		{"metadata array", rawFile(`{"__metadata__":[]}`, 0), `__metadata__: not a JSON object`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseHeader(bytes.NewReader(tt.file), int64(len(tt.file)))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want one containing %q", err, tt.want)
			}
		})
	}
}

// A reader far shorter than the size it claims must fail without the parser
// allocating the claimed header length.
func TestParseHeaderShortReader(t *testing.T) {
	file := withLength(90<<20, "{}")
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, err := ParseHeader(bytes.NewReader(file), 1<<40)
	runtime.ReadMemStats(&after)
	if err == nil {
		t.Fatal("no error for a truncated header")
	}
	if grew := after.TotalAlloc - before.TotalAlloc; grew > 1<<20 {
		t.Errorf("parsing a 10 byte reader claiming a 90 MiB header allocated %d bytes", grew)
	}
}

func FuzzParseHeader(f *testing.F) {
	var valid bytes.Buffer
	if err := Write(&valid, []WriteTensor{
		{Name: "w", DType: BF16, Shape: []int{2, 2}, Data: make([]byte, 8)},
		{Name: "v", DType: F32, Shape: []int{1}, Data: make([]byte, 4)},
	}, map[string]string{"format": "pt"}); err != nil {
		f.Fatal(err)
	}
	f.Add(valid.Bytes())
	f.Add(valid.Bytes()[:valid.Len()-3])
	f.Add(valid.Bytes()[:12])
	f.Add(rawFile(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}`, 12))
	f.Add(rawFile(`{"a":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,0]}}`, 8))
	f.Add(rawFile(`{"a":{"dtype":"U8","shape":[0,99999999999],"data_offsets":[3,3]}}`, 8))
	f.Add(rawFile(`{"__metadata__":{"a":"b"},"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]}}`, 4))
	f.Add(withLength(1<<62, "{}"))
	f.Add(withLength(100<<20, "{}"))
	f.Fuzz(func(t *testing.T, data []byte) {
		h, err := ParseHeader(bytes.NewReader(data), int64(len(data)))
		if err != nil {
			return
		}
		dataLen := int64(len(data)) - h.DataOffset
		if dataLen < 0 {
			t.Fatalf("data offset %d beyond the %d byte file", h.DataOffset, len(data))
		}
		names := h.Names()
		for i, n := range names {
			ti := h.Tensors[n]
			elems := int64(1)
			for _, d := range ti.Shape {
				elems *= int64(d)
			}
			if ti.Begin < 0 || ti.End < ti.Begin || ti.End > dataLen || ti.End-ti.Begin != elems*int64(ti.DType.Size()) {
				t.Fatalf("tensor %q accepted with %+v in a %d byte data section", n, ti, dataLen)
			}
			for _, m := range names[i+1:] {
				tj := h.Tensors[m]
				if ti.Begin < tj.End && tj.Begin < ti.End {
					t.Fatalf("tensors %q %+v and %q %+v overlap", n, ti, m, tj)
				}
			}
		}
	})
}
