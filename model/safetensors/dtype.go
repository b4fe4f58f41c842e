package safetensors

import (
	"math"
	"math/bits"
)

// dtypeSizes holds the element size in bytes of every dtype a header may
// declare. Files holding other dtypes (for example the sub-byte F4/F6 types)
// are rejected at parse.
var dtypeSizes = map[DType]int{
	"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
	"I16": 2, "U16": 2, F16: 2, BF16: 2,
	"I32": 4, "U32": 4, F32: 4,
	"I64": 8, "U64": 8, "F64": 8,
}

// Size is the size of one element in bytes, or 0 for a dtype safetensors does
// not define.
func (d DType) Size() int { return dtypeSizes[d] }

// Float reports whether tandem converts elements of d to float32 (F32, F16
// and BF16).
func (d DType) Float() bool { return d == F32 || d == F16 || d == BF16 }

// BF16ToFloat32 widens a bfloat16 value; it is exact.
func BF16ToFloat32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// Float32ToBF16 rounds f to the nearest bfloat16, ties to even. NaN stays NaN
// (quietened, sign kept) and overflow gives infinity.
func Float32ToBF16(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 {
		return uint16(b>>16) | 0x0040
	}
	b += 0x7fff + (b>>16)&1
	return uint16(b >> 16)
}

// F16ToFloat32 widens an IEEE 754 half-precision value, subnormals, infinities
// and NaN payloads included; it is exact.
func F16ToFloat32(h uint16) float32 {
	sign := uint32(h&0x8000) << 16
	exp := uint32(h>>10) & 0x1f
	mant := uint32(h & 0x3ff)
	switch {
	case exp == 0x1f:
		return math.Float32frombits(sign | 0x7f800000 | mant<<13)
	case exp != 0:
		return math.Float32frombits(sign | (exp+127-15)<<23 | mant<<13)
	case mant == 0:
		return math.Float32frombits(sign)
	}
	// Subnormal: mant × 2^-24. Normalise so the leading one becomes the
	// implicit bit of a float32.
	shift := uint32(bits.LeadingZeros32(mant)) - 21 // brings bit 9.. up to bit 10
	mant = (mant << shift) & 0x3ff
	return math.Float32frombits(sign | (127-15+1-shift)<<23 | mant<<13)
}

// Float32ToF16 rounds f to the nearest IEEE 754 half-precision value, ties to
// even, producing subnormals below 2^-14 and infinity on overflow. NaN stays
// NaN (quietened, sign kept).
func Float32ToF16(f float32) uint16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	abs := b & 0x7fffffff
	switch {
	case abs > 0x7f800000:
		return sign | 0x7e00 | uint16(abs>>13)&0x3ff
	case abs >= 0x477ff000: // rounds to ≥ 65520: infinity
		return sign | 0x7c00
	case abs >= 0x38800000: // normal half (≥ 2^-14)
		r := abs - (127-15)<<23
		r += 0xfff + (r>>13)&1
		return sign | uint16(r>>13)
	case abs < 0x33000000: // below half the smallest subnormal: zero
		return sign
	}
	// Subnormal half: value = m × 2^-24 with m in [0, 1024].
	exp := abs >> 23
	mant := abs&0x7fffff | 0x800000 // 24-bit significand, value = mant × 2^(exp-150)
	shift := 126 - exp              // value in units of 2^-24 is mant >> shift
	half := uint32(1) << (shift - 1)
	rem := mant & (1<<shift - 1)
	m := mant >> shift
	if rem > half || rem == half && m&1 == 1 {
		m++
	}
	return sign | uint16(m)
}
