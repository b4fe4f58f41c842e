package stage

import (
	"errors"
	"fmt"

	"github.com/tandem-llm/tandem/model"
)

// DefaultBlockSize is the number of positions of a paged KV block when a
// backend's or the leader's configuration leaves it 0: the one default the
// scheduler and every backend share.
const DefaultBlockSize = 16

// CheckModel rejects a model configuration no backend can run, and a layer
// range [lo, hi) that is not a non-empty part of it: the one check of the
// model both backends make before they build a stage (a backend adds only
// the limits of its own kernels). NaN fails every bound.
func CheckModel(m *model.Config, lo, hi int) error {
	if m == nil {
		return errors.New("no model config")
	}
	switch {
	case m.NumLayers <= 0:
		return fmt.Errorf("model has %d layers", m.NumLayers)
	case lo < 0 || lo >= hi || hi > m.NumLayers:
		return fmt.Errorf("layer range [%d,%d) is not a non-empty part of the model's %d layers", lo, hi, m.NumLayers)
	case m.HiddenSize <= 0 || m.IntermediateSize <= 0 || m.VocabSize <= 0:
		return fmt.Errorf("hidden size %d, intermediate size %d, vocab size %d: all must be positive", m.HiddenSize, m.IntermediateSize, m.VocabSize)
	case m.NumHeads <= 0 || m.NumKVHeads <= 0 || m.NumHeads%m.NumKVHeads != 0:
		return fmt.Errorf("%d attention heads are not a positive multiple of %d key/value heads", m.NumHeads, m.NumKVHeads)
	case m.HeadDim <= 0 || m.HeadDim%2 != 0:
		return fmt.Errorf("head dim %d is not positive and even", m.HeadDim)
	case m.MaxPositions <= 0:
		return fmt.Errorf("max positions %d is not positive", m.MaxPositions)
	case !(m.RopeTheta > 0):
		return fmt.Errorf("rope theta %v is not positive", m.RopeTheta)
	case !(m.RMSNormEps >= 0):
		return fmt.Errorf("rms norm eps %v is negative", m.RMSNormEps)
	}
	if rs := m.RopeScaling; rs != nil {
		if rs.Type != "llama3" {
			return fmt.Errorf("rope scaling type %q is not supported (only llama3)", rs.Type)
		}
		if !(rs.Factor > 0) || !(rs.LowFreqFactor > 0) || !(rs.HighFreqFactor > rs.LowFreqFactor) || rs.OriginalMaxPositions <= 0 {
			return fmt.Errorf("llama3 rope scaling %+v: need factor > 0, 0 < low_freq_factor < high_freq_factor and original_max_position_embeddings > 0", *rs)
		}
	}
	return nil
}
