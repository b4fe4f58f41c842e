package stagetest

import (
	"encoding/binary"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"slices"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/safetensors"
)

// Weights is an in-memory checkpoint: tensors by Hugging Face name.
type Weights map[string]*safetensors.Tensor

// Tensor returns the named tensor.
func (w Weights) Tensor(name string) (*safetensors.Tensor, error) {
	t, ok := w[name]
	if !ok {
		return nil, fmt.Errorf("no tensor %s in the checkpoint", name)
	}
	return t, nil
}

// Shape is a model shape the suite covers, with the element type its random
// weights are stored in.
type Shape struct {
	Name  string
	Model model.Config
	DType safetensors.DType
}

// Shapes returns the small model shapes the suite runs every backend on.
// Every shape has two layers except "llama-4layers" (the last), which the
// split tests use. MaxPositions is 512 throughout.
func Shapes() []Shape {
	base := func(heads, kvHeads, headDim, hidden, inter, vocab int) model.Config {
		return model.Config{
			Arch: model.ArchLlama, HiddenSize: hidden, NumLayers: 2,
			NumHeads: heads, NumKVHeads: kvHeads, HeadDim: headDim,
			IntermediateSize: inter, VocabSize: vocab,
			RMSNormEps: 1e-5, RopeTheta: 10000, MaxPositions: 512,
			BOS: 1, EOS: []int{2}, DType: "float32",
		}
	}
	mha := base(4, 4, 16, 64, 96, 101)

	gqa2 := base(4, 2, 16, 64, 128, 97)
	gqa2.TieEmbedding = true
	gqa2.RMSNormEps = 1e-6
	gqa2.DType = "bfloat16"

	// With head dim 16 and theta 10000 the wavelengths are 6.3, 19.9, 62.8,
	// ...: one below original/high_freq_factor = 8 (kept), one between 8 and
	// original/low_freq_factor = 32 (interpolated), the rest above (divided).
	scaled := base(4, 1, 16, 64, 128, 103)
	scaled.RopeScaling = &model.RopeScaling{Type: "llama3", Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositions: 32}
	scaled.DType = "float16"

	// Hidden size differs from heads × head dim (56).
	gqa7 := base(7, 1, 8, 48, 80, 89)

	qwen := base(14, 2, 8, 112, 160, 151)
	qwen.Arch = model.ArchQwen2
	qwen.AttentionBias = true
	qwen.TieEmbedding = true
	qwen.RopeTheta = 1e6
	qwen.RMSNormEps = 1e-6
	qwen.DType = "bfloat16"

	four := base(4, 2, 16, 64, 128, 113)
	four.NumLayers = 4

	// Head dim 64: the CUDA backend's tensor-core attention (and, in
	// decode steps on its GEMM path, the rotary embedding and cache write
	// folded into it), with a bias and remainder rows.
	d64 := base(4, 2, 64, 96, 160, 109)
	d64.Arch = model.ArchQwen2
	d64.AttentionBias = true
	d64.DType = "bfloat16"

	return []Shape{
		{"llama-mha-f32", mha, safetensors.F32},
		{"llama-gqa2-tied-bf16", gqa2, safetensors.BF16},
		{"llama3-rope-scaled-gqa4-f16", scaled, safetensors.F16},
		{"llama-gqa7-f32", gqa7, safetensors.F32},
		{"qwen2-bias-gqa7-tied-bf16", qwen, safetensors.BF16},
		{"qwen2-bias-gqa2-d64-bf16", d64, safetensors.BF16},
		{"llama-4layers", four, safetensors.F32},
	}
}

// TensorShapes returns the name and shape of every tensor of a checkpoint of
// cfg.
func TensorShapes(cfg *model.Config) map[string][]int {
	h, inter := cfg.HiddenSize, cfg.IntermediateSize
	q, kv := cfg.NumHeads*cfg.HeadDim, cfg.NumKVHeads*cfg.HeadDim
	s := map[string][]int{
		model.EmbedName: {cfg.VocabSize, h},
		model.NormName:  {h},
	}
	if !cfg.TieEmbedding {
		s[model.LMHeadName] = []int{cfg.VocabSize, h}
	}
	for i := range cfg.NumLayers {
		s[model.LayerTensor(i, model.InputNorm)] = []int{h}
		s[model.LayerTensor(i, model.PostNorm)] = []int{h}
		s[model.LayerTensor(i, model.QProj)] = []int{q, h}
		s[model.LayerTensor(i, model.KProj)] = []int{kv, h}
		s[model.LayerTensor(i, model.VProj)] = []int{kv, h}
		s[model.LayerTensor(i, model.OProj)] = []int{h, q}
		s[model.LayerTensor(i, model.GateProj)] = []int{inter, h}
		s[model.LayerTensor(i, model.UpProj)] = []int{inter, h}
		s[model.LayerTensor(i, model.DownProj)] = []int{h, inter}
		if cfg.AttentionBias {
			s[model.LayerTensor(i, model.QBias)] = []int{q}
			s[model.LayerTensor(i, model.KBias)] = []int{kv}
			s[model.LayerTensor(i, model.VBias)] = []int{kv}
		}
	}
	return s
}

// RandomWeights returns a checkpoint of cfg's shape filled with uniform
// random values stored as dtype (F32, BF16 or F16), reproducibly from seed.
// Matrices have standard deviation 1/sqrt(fan-in), so every projection keeps
// its input's scale and attention scores and logits are of order one; norm
// weights lie in [0.5, 1.5] and biases have standard deviation 0.2. Values
// are rounded to BF16 by truncation; to F16 by truncation, with values outside
// the F16 normal range stored as zero. It is fast enough for ~100M-parameter
// benchmark models (a few ns per value).
func RandomWeights(cfg *model.Config, dtype safetensors.DType, seed uint64) Weights {
	rng := rand.NewPCG(seed, 0x7a6e64656d)
	w := Weights{}
	shapes := TensorShapes(cfg)
	for _, name := range slices.Sorted(maps.Keys(shapes)) {
		shape := shapes[name]
		n := 1
		for _, d := range shape {
			n *= d
		}
		var lo, hi float32
		switch {
		case len(shape) == 1 && isBias(name):
			a := float32(0.2 * math.Sqrt(3))
			lo, hi = -a, a
		case len(shape) == 1:
			lo, hi = 0.5, 1.5
		default:
			a := float32(math.Sqrt(3 / float64(shape[1])))
			lo, hi = -a, a
		}
		w[name] = &safetensors.Tensor{Name: name, DType: dtype, Shape: shape, Data: randomData(rng, n, lo, hi, dtype)}
	}
	return w
}

func isBias(name string) bool {
	const suffix = ".bias"
	return len(name) > len(suffix) && name[len(name)-len(suffix):] == suffix
}

// randomData encodes n uniform values in [lo, hi) as dtype.
func randomData(rng *rand.PCG, n int, lo, hi float32, dtype safetensors.DType) []byte {
	size := 4
	if dtype != safetensors.F32 {
		size = 2
	}
	data := make([]byte, n*size)
	scale := (hi - lo) * 0x1p-32
	for i := 0; i < n; i += 2 {
		r := rng.Uint64()
		for j, bits := range [2]uint32{uint32(r), uint32(r >> 32)} {
			if i+j == n {
				break
			}
			v := lo + float32(bits)*scale
			put(data[(i+j)*size:], v, dtype)
		}
	}
	return data
}

func put(b []byte, v float32, dtype safetensors.DType) {
	bits := math.Float32bits(v)
	switch dtype {
	case safetensors.F32:
		binary.LittleEndian.PutUint32(b, bits)
	case safetensors.BF16:
		binary.LittleEndian.PutUint16(b, uint16(bits>>16))
	case safetensors.F16:
		sign := uint16(bits>>16) & 0x8000
		exp := int(bits>>23&0xff) - 127 + 15
		var h uint16
		if exp > 0 && exp < 31 {
			h = uint16(exp)<<10 | uint16(bits>>13&0x3ff)
		}
		binary.LittleEndian.PutUint16(b, sign|h)
	default:
		panic(fmt.Sprintf("stagetest: dtype %s is not supported", dtype))
	}
}
