package cuda

import (
	"math"

	"github.com/tandem-llm/tandem/model"
)

// invFreq returns the rotary inverse frequencies of one head, head_dim/2 of
// them: theta^(-2i/head_dim), rescaled as "llama3" prescribes when
// cfg.RopeScaling is set. Computed in float64 and rounded once.
func invFreq(cfg *model.Config) []float32 {
	half := cfg.HeadDim / 2
	out := make([]float32, half)
	for i := range out {
		f := 1 / math.Pow(cfg.RopeTheta, float64(2*i)/float64(cfg.HeadDim))
		if s := cfg.RopeScaling; s != nil {
			f = llama3Scale(f, s)
		}
		out[i] = float32(f)
	}
	return out
}

// llama3Scale rescales one inverse frequency: long wavelengths are divided
// by the factor, short ones kept, and the band between interpolated.
func llama3Scale(f float64, s *model.RopeScaling) float64 {
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
