package cpu

import (
	"math"

	"github.com/tandem-llm/tandem/model"
)

// ropeInvFreq returns the HeadDim/2 rotary inverse frequencies
// 1/theta^(2i/HeadDim), rescaled by the llama3 rule when the model asks for
// it: frequencies whose wavelength exceeds original/low_freq_factor are
// divided by the factor, those whose wavelength is below
// original/high_freq_factor are kept, and those in between are interpolated.
func ropeInvFreq(m *model.Config) []float64 {
	half := m.HeadDim / 2
	inv := make([]float64, half)
	for i := range inv {
		inv[i] = 1 / math.Pow(m.RopeTheta, float64(2*i)/float64(m.HeadDim))
	}
	rs := m.RopeScaling
	if rs == nil {
		return inv
	}
	orig := float64(rs.OriginalMaxPositions)
	lowWavelen := orig / rs.LowFreqFactor
	highWavelen := orig / rs.HighFreqFactor
	for i, f := range inv {
		wavelen := 2 * math.Pi / f
		switch {
		case wavelen > lowWavelen:
			inv[i] = f / rs.Factor
		case wavelen < highWavelen:
		default:
			smooth := (orig/wavelen - rs.LowFreqFactor) / (rs.HighFreqFactor - rs.LowFreqFactor)
			inv[i] = (1-smooth)*f/rs.Factor + smooth*f
		}
	}
	return inv
}

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
