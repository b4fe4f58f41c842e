package stage

import (
	"math"
	"strings"
	"testing"

	"github.com/tandem-llm/tandem/model"
)

func TestCheckModel(t *testing.T) {
	good := func() *model.Config {
		return &model.Config{NumLayers: 4, HiddenSize: 64, IntermediateSize: 128, VocabSize: 100, NumHeads: 4, NumKVHeads: 2,
			HeadDim: 16, MaxPositions: 512, RopeTheta: 10000, RMSNormEps: 1e-5}
	}
	if err := CheckModel(good(), 1, 3); err != nil {
		t.Fatalf("a sound config: %v", err)
	}
	for _, tc := range []struct {
		name   string
		change func(m *model.Config)
		lo, hi int
		want   string
	}{
		{"no layers", func(m *model.Config) { m.NumLayers = 0 }, 0, 1, "layers"},
		{"empty range", nil, 2, 2, "layer range"},
		{"range past the end", nil, 3, 5, "layer range"},
		{"vocab", func(m *model.Config) { m.VocabSize = 0 }, 0, 4, "vocab size"},
		{"heads", func(m *model.Config) { m.NumHeads = 3 }, 0, 4, "key/value heads"},
		{"odd head dim", func(m *model.Config) { m.HeadDim = 15 }, 0, 4, "head dim"},
		{"positions", func(m *model.Config) { m.MaxPositions = 0 }, 0, 4, "max positions"},
		{"theta NaN", func(m *model.Config) { m.RopeTheta = math.NaN() }, 0, 4, "rope theta"},
		{"eps NaN", func(m *model.Config) { m.RMSNormEps = math.NaN() }, 0, 4, "rms norm eps"},
		{"scaling type", func(m *model.Config) { m.RopeScaling = &model.RopeScaling{Type: "yarn"} }, 0, 4, "yarn"},
		{"scaling NaN", func(m *model.Config) {
			m.RopeScaling = &model.RopeScaling{Type: "llama3", Factor: math.NaN(), LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositions: 8}
		}, 0, 4, "llama3 rope scaling"},
	} {
		m := good()
		if tc.change != nil {
			tc.change(m)
		}
		if err := CheckModel(m, tc.lo, tc.hi); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v; want an error naming %q", tc.name, err, tc.want)
		}
	}
	if err := CheckModel(nil, 0, 1); err == nil {
		t.Error("a nil config passed")
	}
}
