package randinit

import (
	"errors"
	"fmt"

	"github.com/tandem-llm/tandem/model/safetensors"
)

// Options describe the checkpoint Write makes.
type Options struct {
	// Arch is "llama" (the default when empty) or "qwen2" (q, k and v
	// biases).
	Arch         string
	Layers       int
	Hidden       int
	Heads        int
	KVHeads      int
	HeadDim      int // 0: Hidden / Heads
	Intermediate int
	// Vocab is the vocabulary size, at least 258: the 256 byte tokens and
	// BOS and EOS.
	Vocab        int
	MaxPositions int
	// Tied shares the embedding with the LM head (no lm_head.weight).
	Tied bool
	// RopeScaling turns on llama3 rope scaling (factor 8, low 1, high 4,
	// original context MaxPositions/4).
	RopeScaling bool
	Seed        uint64
	// ShardBytes, when positive, splits the weights into shards of at most
	// that size (a larger tensor gets a shard of its own) behind an index,
	// as transformers does; the weights stay in model.safetensors when they
	// fit one shard.
	ShardBytes int64
	// DType is the weights' element type: "bf16" (the default when empty),
	// "f16" or "f32".
	DType string
}

// MinVocab is the smallest vocabulary: 256 byte tokens, BOS and EOS.
const MinVocab = 258

// DefaultOptions describe a tiny Llama for demos and tests: 4 layers,
// hidden 64, 4 heads over 2 KV heads, vocabulary 512.
func DefaultOptions() Options {
	return Options{
		Arch:         "llama",
		Layers:       4,
		Hidden:       64,
		Heads:        4,
		KVHeads:      2,
		Intermediate: 172,
		Vocab:        512,
		MaxPositions: 2048,
		Seed:         1,
	}
}

// resolve validates o and fills in its defaults.
func (o Options) resolve() (Options, error) {
	if o.Arch == "" {
		o.Arch = "llama"
	}
	if o.Arch != "llama" && o.Arch != "qwen2" {
		return o, fmt.Errorf("arch %q: want llama or qwen2", o.Arch)
	}
	if o.DType == "" {
		o.DType = "bf16"
	}
	if _, ok := dtypes[o.DType]; !ok {
		return o, fmt.Errorf("dtype %q: want bf16, f16 or f32", o.DType)
	}
	for _, f := range []struct {
		name string
		v    int
	}{
		{"layers", o.Layers}, {"hidden", o.Hidden}, {"heads", o.Heads}, {"kv heads", o.KVHeads},
		{"intermediate", o.Intermediate}, {"max positions", o.MaxPositions},
	} {
		if f.v <= 0 {
			return o, fmt.Errorf("%s: %d is not positive", f.name, f.v)
		}
	}
	if o.Heads%o.KVHeads != 0 {
		return o, fmt.Errorf("kv heads: %d does not divide heads %d", o.KVHeads, o.Heads)
	}
	if o.HeadDim == 0 {
		if o.Hidden%o.Heads != 0 {
			return o, fmt.Errorf("head dim: hidden %d is not a multiple of heads %d; set HeadDim", o.Hidden, o.Heads)
		}
		o.HeadDim = o.Hidden / o.Heads
	}
	if o.HeadDim <= 0 || o.HeadDim%2 != 0 {
		return o, fmt.Errorf("head dim: %d is not positive and even", o.HeadDim)
	}
	if o.Vocab < MinVocab {
		return o, fmt.Errorf("vocab: %d is below the minimum %d (256 bytes, BOS and EOS)", o.Vocab, MinVocab)
	}
	if o.ShardBytes < 0 {
		return o, errors.New("shard bytes: negative")
	}
	return o, nil
}

// dtypes maps Options.DType to the safetensors dtype and the config.json
// name.
var dtypes = map[string]struct {
	st     safetensors.DType
	config string
}{
	"bf16": {safetensors.BF16, "bfloat16"},
	"f16":  {safetensors.F16, "float16"},
	"f32":  {safetensors.F32, "float32"},
}
