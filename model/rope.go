package model

import "math"

// RopeInvFreq returns the HeadDim/2 rotary inverse frequencies of one head,
// 1/theta^(2i/HeadDim) in float64, rescaled by the llama3 rule when
// RopeScaling is set: frequencies whose wavelength exceeds
// original/low_freq_factor are divided by the factor, those whose wavelength
// is below original/high_freq_factor are kept, and those in between are
// interpolated. Every backend derives its rotary angles from these.
func (c *Config) RopeInvFreq() []float64 {
	inv := make([]float64, c.HeadDim/2)
	for i := range inv {
		f := 1 / math.Pow(c.RopeTheta, float64(2*i)/float64(c.HeadDim))
		if s := c.RopeScaling; s != nil {
			f = s.scale(f)
		}
		inv[i] = f
	}
	return inv
}

// scale applies the llama3 rescaling to one inverse frequency.
func (s *RopeScaling) scale(f float64) float64 {
	orig := float64(s.OriginalMaxPositions)
	wavelen := 2 * math.Pi / f
	switch {
	case wavelen > orig/s.LowFreqFactor:
		return f / s.Factor
	case wavelen < orig/s.HighFreqFactor:
		return f
	}
	smooth := (orig/wavelen - s.LowFreqFactor) / (s.HighFreqFactor - s.LowFreqFactor)
	return (1-smooth)*f/s.Factor + smooth*f
}
