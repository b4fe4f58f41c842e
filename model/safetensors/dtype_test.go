package safetensors

import (
	"math"
	"math/rand/v2"
	"sort"
	"testing"
)

// refF16 is the value of half h computed from the IEEE 754 definition in
// float64 (NaN for NaNs).
func refF16(h uint16) float64 {
	sign := 1.0
	if h&0x8000 != 0 {
		sign = -1
	}
	e, m := int(h>>10)&0x1f, float64(h&0x3ff)
	switch {
	case e == 31 && m == 0:
		return math.Inf(int(sign))
	case e == 31:
		return math.NaN()
	case e == 0:
		return sign * math.Ldexp(m, -24)
	}
	return sign * math.Ldexp(1024+m, e-25)
}

func TestF16ToFloat32Exhaustive(t *testing.T) {
	for i := 0; i < 1<<16; i++ {
		h := uint16(i)
		got, want := F16ToFloat32(h), refF16(h)
		if math.IsNaN(want) {
			// Payload and sign are kept.
			wantBits := uint32(h&0x8000)<<16 | 0x7f800000 | uint32(h&0x3ff)<<13
			if math.Float32bits(got) != wantBits {
				t.Fatalf("F16ToFloat32(%#04x) = %#08x, want NaN %#08x", h, math.Float32bits(got), wantBits)
			}
			continue
		}
		if float64(got) != want || math.Signbit(float64(got)) != (h&0x8000 != 0) {
			t.Fatalf("F16ToFloat32(%#04x) = %g, want %g", h, got, want)
		}
	}
}

// nearest returns which of lo, hi (adjacent encodings, lo even or odd) a
// value x with loV ≤ x ≤ hiV rounds to, ties to even.
func nearest(x, loV, hiV float64, lo, hi uint16) uint16 {
	switch dl, dh := x-loV, hiV-x; {
	case dl < dh:
		return lo
	case dh < dl:
		return hi
	case lo&1 == 0:
		return lo
	}
	return hi
}

// refToF16 rounds x to half by searching the sorted finite halves.
func refToF16(x float32) uint16 {
	var sign uint16
	ax := math.Abs(float64(x))
	if math.Signbit(float64(x)) {
		sign = 0x8000
	}
	// Positive finite halves 0x0000..0x7bff are increasing in value; 0x7c00
	// stands for 2^16 when deciding whether to round up to infinity.
	lo := uint16(sort.Search(0x7c00, func(i int) bool { return refF16(uint16(i)) > ax }) - 1)
	hiV := 65536.0
	if lo < 0x7bff {
		hiV = refF16(lo + 1)
	}
	return sign | nearest(ax, refF16(lo), hiV, lo, lo+1)
}

// refToBF16 rounds x to bfloat16 by choosing between the truncation and the
// next encoding up.
func refToBF16(x float32) uint16 {
	b := math.Float32bits(x)
	lo := uint16(b >> 16)
	ax := math.Abs(float64(x))
	loV := math.Abs(float64(BF16ToFloat32(lo)))
	hiV := math.Ldexp(1, 128) // the step past the largest finite value
	if lo&0x7fff < 0x7f7f {
		hiV = math.Abs(float64(BF16ToFloat32(lo + 1)))
	}
	return nearest(ax, loV, hiV, lo, lo+1)
}

// testFloats are float32 values covering every binade halves and bfloat16
// care about, plus exact ties and edges.
func testFloats() []float32 {
	r := rand.New(rand.NewPCG(1, 2))
	var fs []float32
	for i := 0; i < 200000; i++ {
		exp := uint32(90 + r.IntN(60)) // 2^-37 .. 2^22: zero, subnormal, normal, overflow
		if i%10 == 0 {
			exp = uint32(r.IntN(255)) // anything finite
		}
		fs = append(fs, math.Float32frombits(uint32(r.IntN(2))<<31|exp<<23|r.Uint32()&0x7fffff))
	}
	// Ties between adjacent halves and bfloat16s, both parities.
	for h := uint16(0); h < 0x7bff; h += 37 {
		fs = append(fs, float32((refF16(h)+refF16(h+1))/2))
	}
	for b := uint32(0x0001); b < 0x7f7f; b += 41 {
		fs = append(fs, math.Float32frombits(b<<16|0x8000))
	}
	fs = append(fs, 0, float32(math.Copysign(0, -1)), 65504, 65519.99, 65520, -65520, 1e6,
		float32(math.Inf(1)), float32(math.Inf(-1)), math.MaxFloat32, math.SmallestNonzeroFloat32,
		math.Float32frombits(0x33000000), math.Float32frombits(0x33000001), math.Float32frombits(0x387fffff))
	return fs
}

func TestFloat32ToF16(t *testing.T) {
	for _, x := range testFloats() {
		if got, want := Float32ToF16(x), refToF16(x); got != want {
			t.Fatalf("Float32ToF16(%g [%#08x]) = %#04x, want %#04x", x, math.Float32bits(x), got, want)
		}
	}
	for i := 0; i < 1<<16; i++ {
		h := uint16(i)
		got := Float32ToF16(F16ToFloat32(h))
		if math.IsNaN(refF16(h)) {
			if got&0x7c00 != 0x7c00 || got&0x3ff == 0 || got&0x8000 != h&0x8000 {
				t.Fatalf("NaN %#04x round-trips to %#04x", h, got)
			}
			continue
		}
		if got != h {
			t.Fatalf("half %#04x round-trips to %#04x", h, got)
		}
	}
}

func TestFloat32ToBF16(t *testing.T) {
	for _, x := range testFloats() {
		if got, want := Float32ToBF16(x), refToBF16(x); got != want {
			t.Fatalf("Float32ToBF16(%g [%#08x]) = %#04x, want %#04x", x, math.Float32bits(x), got, want)
		}
	}
	nan := math.Float32frombits(0xffc00001)
	if got := Float32ToBF16(nan); got&0x7f80 != 0x7f80 || got&0x7f == 0 || got&0x8000 == 0 {
		t.Fatalf("Float32ToBF16(NaN) = %#04x, want a negative NaN", got)
	}
	// Every bfloat16 widens exactly and narrows back to itself.
	for i := 0; i < 1<<16; i++ {
		b := uint16(i)
		f := BF16ToFloat32(b)
		if math.Float32bits(f) != uint32(b)<<16 {
			t.Fatalf("BF16ToFloat32(%#04x) = %#08x", b, math.Float32bits(f))
		}
		if !math.IsNaN(float64(f)) && Float32ToBF16(f) != b {
			t.Fatalf("bfloat16 %#04x round-trips to %#04x", b, Float32ToBF16(f))
		}
	}
}
