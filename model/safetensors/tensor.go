package safetensors

import (
	"encoding/binary"
	"fmt"
	"math"
)

// DType is a safetensors element type name as it appears in the header.
type DType string

// Element types tandem reads.
const (
	F32  DType = "F32"
	F16  DType = "F16"
	BF16 DType = "BF16"
)

// Tensor is one tensor of a safetensors file. Data aliases the file's memory
// map: it is valid until the file is closed and must not be written.
type Tensor struct {
	Name  string
	DType DType
	Shape []int
	Data  []byte
}

// NumElements is the product of the dimensions (1 for a scalar).
func (t *Tensor) NumElements() int {
	n := 1
	for _, d := range t.Shape {
		n *= d
	}
	return n
}

// Float32 converts the tensor's little-endian F32, F16 or BF16 elements to a
// new float32 slice. F16 subnormals, infinities and NaN convert exactly.
func (t *Tensor) Float32() ([]float32, error) {
	n := t.NumElements()
	if size := t.DType.Size(); size == 0 || len(t.Data) != n*size {
		return nil, fmt.Errorf("tensor %q: %d data bytes do not hold %d elements of %s", t.Name, len(t.Data), n, t.DType)
	}
	out := make([]float32, n)
	d := t.Data
	switch t.DType {
	case F32:
		for i := range out {
			out[i] = math.Float32frombits(binary.LittleEndian.Uint32(d[4*i:]))
		}
	case BF16:
		d = d[:2*n]
		for i := range out {
			out[i] = math.Float32frombits(uint32(d[2*i])<<16 | uint32(d[2*i+1])<<24)
		}
	case F16:
		for i := range out {
			out[i] = F16ToFloat32(binary.LittleEndian.Uint16(d[2*i:]))
		}
	default:
		return nil, fmt.Errorf("tensor %q: cannot convert %s to float32 (tandem reads F32, F16 and BF16)", t.Name, t.DType)
	}
	return out, nil
}
