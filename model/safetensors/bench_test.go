package safetensors

import (
	"io"
	"math/rand/v2"
	"testing"
)

// BenchmarkOpenAndConvert maps a 50 MB BF16 file and converts its tensor to
// float32, the work a CPU stage does per weight at load.
func BenchmarkOpenAndConvert(b *testing.B) {
	const n = 25 << 20 // elements: 50 MiB of BF16
	r := rand.New(rand.NewPCG(1, 1))
	path := writeFile(b, b.TempDir(), "big.safetensors", []WriteTensor{{
		Name: "w", DType: BF16, Shape: []int{n / 1024, 1024},
		Stream: func(w io.Writer) error {
			buf := make([]byte, 2*1024)
			for range n / 1024 {
				for i := 0; i < len(buf); i += 2 {
					h := Float32ToBF16(float32(r.NormFloat64() * 0.02))
					buf[i], buf[i+1] = byte(h), byte(h>>8)
				}
				if _, err := w.Write(buf); err != nil {
					return err
				}
			}
			return nil
		},
	}})
	b.SetBytes(2 * n)
	for b.Loop() {
		f, err := Open(path)
		if err != nil {
			b.Fatal(err)
		}
		t, err := f.Tensor("w")
		if err != nil {
			b.Fatal(err)
		}
		if _, err := t.Float32(); err != nil {
			b.Fatal(err)
		}
		if err := f.Close(); err != nil {
			b.Fatal(err)
		}
	}
}
