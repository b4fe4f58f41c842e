package model

// Arch is a supported model family.
type Arch string

// The supported architectures (the "architectures" entry of config.json).
const (
	ArchLlama   Arch = "LlamaForCausalLM"
	ArchMistral Arch = "MistralForCausalLM"
	ArchQwen2   Arch = "Qwen2ForCausalLM"
)

// Config is the architecture of a Llama-family checkpoint, read from
// config.json. Every field is resolved: derived values (HeadDim) are filled in
// and defaults applied, so consumers never look at config.json themselves.
type Config struct {
	Arch             Arch
	HiddenSize       int
	NumLayers        int
	NumHeads         int
	NumKVHeads       int
	HeadDim          int
	IntermediateSize int
	VocabSize        int
	RMSNormEps       float64
	RopeTheta        float64
	// RopeScaling is nil when positions are not rescaled.
	RopeScaling  *RopeScaling
	MaxPositions int
	TieEmbedding bool
	// AttentionBias is true when q, k and v projections carry a bias (Qwen2).
	AttentionBias bool
	BOS           int   // -1 when absent
	EOS           []int // may be empty
	// DType is the checkpoint's declared dtype ("bfloat16", "float16", "float32").
	DType string
}

// RopeScaling is the "llama3" frequency rescaling of rotary embeddings.
type RopeScaling struct {
	Type                 string // "llama3"
	Factor               float64
	LowFreqFactor        float64
	HighFreqFactor       float64
	OriginalMaxPositions int
}

// QDim is the width of the query projection, NumHeads × HeadDim.
func (c *Config) QDim() int { return c.NumHeads * c.HeadDim }

// KVDim is the width of the key and value projections, NumKVHeads × HeadDim.
func (c *Config) KVDim() int { return c.NumKVHeads * c.HeadDim }
