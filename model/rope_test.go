package model_test

import (
	"math"
	"testing"

	"github.com/tandem-llm/tandem/model"
)

func TestRopeInvFreq(t *testing.T) {
	scaling := func(orig int) *model.RopeScaling {
		return &model.RopeScaling{Type: "llama3", Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositions: orig}
	}
	// With original 100 positions the band edges are wavelengths 25 and
	// 100: frequency 1 (wavelength 6.28) is kept, 0.1 (62.8) interpolated,
	// 0.01 and 0.001 divided by the factor.
	smooth := (100/(2*math.Pi/0.1) - 1) / (4 - 1)
	for _, tc := range []struct {
		name string
		c    model.Config
		want []float64
	}{
		{"theta 10000", model.Config{HeadDim: 8, RopeTheta: 10000}, []float64{1, 0.1, 0.01, 0.001}},
		{"theta 100", model.Config{HeadDim: 8, RopeTheta: 100}, []float64{1, 0.31622776601683794, 0.1, 0.031622776601683794}},
		{"llama3, band edges 25 and 100", model.Config{HeadDim: 8, RopeTheta: 10000, RopeScaling: scaling(100)},
			[]float64{1, (1-smooth)*0.1/8 + smooth*0.1, 0.01 / 8, 0.001 / 8}},
		// wavelengths 6.28, 19.9, 62.8, 199 against edges 8 and 32.
		{"llama3, band edges 8 and 32", model.Config{HeadDim: 8, RopeTheta: 100, RopeScaling: scaling(32)},
			[]float64{1, 0.09583998588296266, 0.0125, 0.003952847075210474}},
	} {
		got := tc.c.RopeInvFreq()
		if len(got) != len(tc.want) {
			t.Fatalf("%s: %d frequencies, want %d", tc.name, len(got), len(tc.want))
		}
		for i := range tc.want {
			if math.Abs(got[i]-tc.want[i]) > 1e-12*tc.want[i] {
				t.Errorf("%s: inv_freq %v, want %v", tc.name, got, tc.want)
				break
			}
		}
	}
}
