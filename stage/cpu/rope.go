package cpu

import "math"

// ropeTables fills cos and sin (HeadDim/2 values per row) for the position of
// every row of the batch.
func (s *Stage) ropeTables() {
	half := s.m.HeadDim / 2
	r := 0
	for _, run := range s.runs {
		for i := range run.n {
			pos := float64(run.pos + i)
			cs := s.buf.cos[r*half : (r+1)*half]
			sn := s.buf.sin[r*half : (r+1)*half]
			for j, f := range s.invFreq {
				sv, cv := math.Sincos(pos * f)
				cs[j], sn[j] = float32(cv), float32(sv)
			}
			r++
		}
	}
}

// applyRope rotates each head of v (heads × HeadDim values) in the
// rotate_half layout: element j pairs with element j+HeadDim/2.
func applyRope(v []float32, headDim int, cos, sin []float32) {
	half := headDim / 2
	cos, sin = cos[:half], sin[:half]
	for h := 0; h+headDim <= len(v); h += headDim {
		a := v[h : h+half]
		b := v[h+half : h+headDim]
		for j := range half {
			x1, x2 := a[j], b[j]
			a[j] = x1*cos[j] - x2*sin[j]
			b[j] = x2*cos[j] + x1*sin[j]
		}
	}
}
