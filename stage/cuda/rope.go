package cuda

import "github.com/tandem-llm/tandem/model"

// invFreq returns the model's rotary inverse frequencies rounded once to
// float32, as the kernels read them.
func invFreq(cfg *model.Config) []float32 {
	inv := cfg.RopeInvFreq()
	out := make([]float32, len(inv))
	for i, f := range inv {
		out[i] = float32(f)
	}
	return out
}
