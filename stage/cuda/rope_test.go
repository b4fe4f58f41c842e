package cuda

import (
	"math"
	"testing"

	"github.com/tandem-llm/tandem/model"
)

func TestInvFreq(t *testing.T) {
	plain := &model.Config{HeadDim: 8, RopeTheta: 10000}
	// theta^(-2i/8) for i = 0..3: 1, 10^-1, 10^-2, 10^-3.
	want := []float64{1, 0.1, 0.01, 0.001}
	got := invFreq(plain)
	if len(got) != len(want) {
		t.Fatalf("len = %d; want %d", len(got), len(want))
	}
	for i := range want {
		if math.Abs(float64(got[i])-want[i]) > 1e-7*want[i] {
			t.Errorf("inv_freq[%d] = %g; want %g", i, got[i], want[i])
		}
	}

	// llama3 with original 100 positions, factor 8, low 1, high 4: the
	// band edges are wavelengths 25 and 100. Frequencies 1 (wavelength
	// 6.28, kept), 0.1 (62.8, interpolated), 0.01 (628, divided) and 0.001.
	scaled := &model.Config{HeadDim: 8, RopeTheta: 10000, RopeScaling: &model.RopeScaling{
		Type: "llama3", Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositions: 100,
	}}
	smooth := (100/(2*math.Pi/0.1) - 1) / (4 - 1)
	want = []float64{1, (1-smooth)*0.1/8 + smooth*0.1, 0.01 / 8, 0.001 / 8}
	got = invFreq(scaled)
	for i := range want {
		if math.Abs(float64(got[i])-want[i]) > 1e-7*want[i] {
			t.Errorf("llama3 inv_freq[%d] = %g; want %g", i, got[i], want[i])
		}
	}
}
