package safetensors

import (
	"encoding/binary"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// writeFile writes tensors to dir/name and returns the path.
func writeFile(t testing.TB, dir, name string, ts []WriteTensor) string {
	t.Helper()
	path := filepath.Join(dir, name)
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := Write(f, ts, map[string]string{"format": "pt"}); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	return path
}

func u16Bytes(vs ...uint16) []byte {
	var b []byte
	for _, v := range vs {
		b = binary.LittleEndian.AppendUint16(b, v)
	}
	return b
}

func TestOpenAndFloat32(t *testing.T) {
	inf := float32(math.Inf(1))
	path := writeFile(t, t.TempDir(), "m.safetensors", []WriteTensor{
		{Name: "f32", DType: F32, Shape: []int{2, 2}, Data: f32Bytes(1, -2, 0.25, inf)},
		// 1, -2, smallest subnormal 2^-24, largest subnormal, -inf, 65504
		{Name: "f16", DType: F16, Shape: []int{6}, Data: u16Bytes(0x3c00, 0xc000, 0x0001, 0x03ff, 0xfc00, 0x7bff)},
		// 1, -2, 3.140625, 2^-133 (subnormal)
		{Name: "bf16", DType: BF16, Shape: []int{4}, Data: u16Bytes(0x3f80, 0xc000, 0x4049, 0x0001)},
		{Name: "ints", DType: "I32", Shape: []int{1}, Data: make([]byte, 4)},
	})
	f, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if got := f.Names(); !slices.Equal(got, []string{"bf16", "f16", "f32", "ints"}) {
		t.Fatalf("Names = %v", got)
	}
	if f.Header().Metadata["format"] != "pt" {
		t.Errorf("metadata %v", f.Header().Metadata)
	}
	want := map[string][]float32{
		"f32":  {1, -2, 0.25, inf},
		"f16":  {1, -2, float32(math.Ldexp(1, -24)), float32(math.Ldexp(1023, -24)), -inf, 65504},
		"bf16": {1, -2, 3.140625, float32(math.Ldexp(1, -133))},
	}
	for name, w := range want {
		tt, err := f.Tensor(name)
		if err != nil {
			t.Fatal(err)
		}
		if tt.Name != name || tt.NumElements() != len(w) {
			t.Errorf("%s: name %q, %d elements", name, tt.Name, tt.NumElements())
		}
		got, err := tt.Float32()
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got, w) {
			t.Errorf("%s = %v, want %v", name, got, w)
		}
	}
	if _, err := f.Tensor("ints"); err == nil || !strings.Contains(err.Error(), `tensor "ints" has dtype I32`) || !strings.Contains(err.Error(), path) {
		t.Errorf("I32 tensor: %v", err)
	}
	if _, err := f.Tensor("nope"); err == nil || !strings.Contains(err.Error(), `no tensor "nope"`) || !strings.Contains(err.Error(), path) {
		t.Errorf("missing tensor: %v", err)
	}
	if tt, _ := f.Tensor("f32"); cap(tt.Data) != len(tt.Data) {
		t.Error("tensor data can be appended into its neighbour")
	}
}

func TestFloat32Mismatch(t *testing.T) {
	tt := &Tensor{Name: "t", DType: BF16, Shape: []int{3}, Data: make([]byte, 4)}
	if _, err := tt.Float32(); err == nil || !strings.Contains(err.Error(), `tensor "t": 4 data bytes do not hold 3 elements of BF16`) {
		t.Errorf("short data: %v", err)
	}
	tt = &Tensor{Name: "t", DType: "I16", Shape: []int{2}, Data: make([]byte, 4)}
	if _, err := tt.Float32(); err == nil || !strings.Contains(err.Error(), "cannot convert I16") {
		t.Errorf("I16: %v", err)
	}
}

func TestOpenErrors(t *testing.T) {
	dir := t.TempDir()
	good := writeFile(t, dir, "good.safetensors", []WriteTensor{
		{Name: "w", DType: F32, Shape: []int{4}, Data: f32Bytes(1, 2, 3, 4)},
	})
	data, err := os.ReadFile(good)
	if err != nil {
		t.Fatal(err)
	}
	truncated := filepath.Join(dir, "truncated.safetensors")
	if err := os.WriteFile(truncated, data[:len(data)-4], 0o644); err != nil {
		t.Fatal(err)
	}
	tiny := filepath.Join(dir, "tiny.safetensors")
	if err := os.WriteFile(tiny, data[:5], 0o644); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		path string
		want []string
	}{
		{truncated, []string{truncated, `tensor "w"`, "beyond the 12 byte data section"}},
		{tiny, []string{tiny, "too short"}},
		{filepath.Join(dir, "missing.safetensors"), []string{"missing.safetensors", "no such file"}},
		{dir, []string{dir, "not a regular file"}},
	}
	for _, tt := range tests {
		_, err := Open(tt.path)
		for _, w := range tt.want {
			if err == nil || !strings.Contains(err.Error(), w) {
				t.Errorf("Open(%s) error %v, want one containing %q", filepath.Base(tt.path), err, w)
			}
		}
	}
	f, err := Open(good)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := f.Tensor("w"); err == nil || !strings.Contains(err.Error(), "closed") {
		t.Errorf("Tensor after Close: %v", err)
	}
	if err := f.Close(); err == nil {
		t.Error("second Close succeeded")
	}
}
