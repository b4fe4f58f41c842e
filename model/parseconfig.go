package model

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// ConfigName is the file name of a checkpoint's configuration.
const ConfigName = "config.json"

// LoadConfig reads and parses dir/config.json.
func LoadConfig(dir string) (*Config, error) {
	path := filepath.Join(dir, ConfigName)
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("load config: %w", err)
	}
	c, err := ParseConfig(data)
	if err != nil {
		return nil, fmt.Errorf("load config %s: %w", path, err)
	}
	return c, nil
}

// rawConfig mirrors the config.json fields tandem reads. Pointers and raw
// messages tell absent and null apart from zero.
type rawConfig struct {
	Architectures    []string        `json:"architectures"`
	ModelType        string          `json:"model_type"`
	HiddenSize       *int            `json:"hidden_size"`
	NumLayers        *int            `json:"num_hidden_layers"`
	NumHeads         *int            `json:"num_attention_heads"`
	NumKVHeads       *int            `json:"num_key_value_heads"`
	HeadDim          *int            `json:"head_dim"`
	Intermediate     *int            `json:"intermediate_size"`
	RMSNormEps       *float64        `json:"rms_norm_eps"`
	VocabSize        *int            `json:"vocab_size"`
	MaxPositions     *int            `json:"max_position_embeddings"`
	TieEmbeddings    *bool           `json:"tie_word_embeddings"`
	BOS              json.RawMessage `json:"bos_token_id"`
	EOS              json.RawMessage `json:"eos_token_id"`
	DType            *string         `json:"dtype"`
	TorchDType       *string         `json:"torch_dtype"`
	HiddenAct        *string         `json:"hidden_act"`
	AttentionBias    *bool           `json:"attention_bias"`
	MLPBias          *bool           `json:"mlp_bias"`
	RopeTheta        *float64        `json:"rope_theta"`
	RopeScaling      json.RawMessage `json:"rope_scaling"`
	RopeParameters   json.RawMessage `json:"rope_parameters"`
	SlidingWindow    json.RawMessage `json:"sliding_window"`
	UseSlidingWindow *bool           `json:"use_sliding_window"`
	LayerTypes       []string        `json:"layer_types"`
	Quantization     json.RawMessage `json:"quantization_config"`
}

// rawRope is a rope_scaling (transformers 4) or rope_parameters
// (transformers 5) object.
type rawRope struct {
	RopeType       *string  `json:"rope_type"`
	Type           *string  `json:"type"` // older spelling of rope_type
	RopeTheta      *float64 `json:"rope_theta"`
	Factor         *float64 `json:"factor"`
	LowFreqFactor  *float64 `json:"low_freq_factor"`
	HighFreqFactor *float64 `json:"high_freq_factor"`
	OriginalMax    *int     `json:"original_max_position_embeddings"`
}

// archByModelType resolves a config without "architectures".
var archByModelType = map[string]Arch{"llama": ArchLlama, "mistral": ArchMistral, "qwen2": ArchQwen2}

// defaultMaxPositions are the transformers defaults of
// max_position_embeddings.
var defaultMaxPositions = map[Arch]int{ArchLlama: 2048, ArchMistral: 4096 * 32, ArchQwen2: 32768}

// ParseConfig parses a Hugging Face config.json of a LlamaForCausalLM,
// MistralForCausalLM or Qwen2ForCausalLM checkpoint, in the layout of
// transformers 4 (rope_theta, rope_scaling, torch_dtype) or 5
// (rope_parameters, dtype). It applies the transformers defaults, derives
// head_dim when absent, and rejects what tandem does not implement —
// other architectures, activations, rope types, sliding windows, MLP biases,
// quantization — with an error naming the field.
func ParseConfig(data []byte) (*Config, error) {
	var r rawConfig
	if err := json.Unmarshal(data, &r); err != nil {
		return nil, fmt.Errorf("parse config: %w", err)
	}
	c, err := r.resolve()
	if err != nil {
		return nil, fmt.Errorf("parse config: %w", err)
	}
	return c, nil
}

func isNull(m json.RawMessage) bool {
	return len(m) == 0 || string(bytes.TrimSpace(m)) == "null"
}

func (r *rawConfig) resolve() (*Config, error) {
	c := &Config{}
	switch {
	case len(r.Architectures) > 0:
		c.Arch = Arch(r.Architectures[0])
	case archByModelType[r.ModelType] != "":
		c.Arch = archByModelType[r.ModelType]
	default:
		return nil, fmt.Errorf("architectures: missing, and model_type %q is not llama, mistral or qwen2", r.ModelType)
	}
	if _, ok := defaultMaxPositions[c.Arch]; !ok {
		return nil, fmt.Errorf("architectures: unsupported architecture %q (tandem runs %s, %s and %s)", c.Arch, ArchLlama, ArchMistral, ArchQwen2)
	}
	if !isNull(r.Quantization) {
		return nil, errors.New("quantization_config: quantized checkpoints are not supported")
	}
	if r.HiddenAct != nil && *r.HiddenAct != "silu" {
		return nil, fmt.Errorf("hidden_act: unsupported activation %q (want silu)", *r.HiddenAct)
	}
	if r.MLPBias != nil && *r.MLPBias {
		return nil, errors.New("mlp_bias: MLP biases are not supported")
	}

	required := []struct {
		name string
		v    *int
		dst  *int
	}{
		{"hidden_size", r.HiddenSize, &c.HiddenSize},
		{"num_hidden_layers", r.NumLayers, &c.NumLayers},
		{"num_attention_heads", r.NumHeads, &c.NumHeads},
		{"intermediate_size", r.Intermediate, &c.IntermediateSize},
		{"vocab_size", r.VocabSize, &c.VocabSize},
	}
	for _, f := range required {
		if f.v == nil {
			return nil, fmt.Errorf("%s: missing", f.name)
		}
		if *f.v <= 0 {
			return nil, fmt.Errorf("%s: %d is not positive", f.name, *f.v)
		}
		*f.dst = *f.v
	}

	c.NumKVHeads = c.NumHeads
	if r.NumKVHeads != nil {
		c.NumKVHeads = *r.NumKVHeads
	}
	if c.NumKVHeads <= 0 || c.NumHeads%c.NumKVHeads != 0 {
		return nil, fmt.Errorf("num_key_value_heads: %d does not divide num_attention_heads %d", c.NumKVHeads, c.NumHeads)
	}
	if r.HeadDim != nil {
		c.HeadDim = *r.HeadDim
		if c.HeadDim <= 0 {
			return nil, fmt.Errorf("head_dim: %d is not positive", c.HeadDim)
		}
	} else {
		if c.HiddenSize%c.NumHeads != 0 {
			return nil, fmt.Errorf("head_dim: absent, and hidden_size %d is not a multiple of num_attention_heads %d", c.HiddenSize, c.NumHeads)
		}
		c.HeadDim = c.HiddenSize / c.NumHeads
	}
	if c.HeadDim%2 != 0 {
		return nil, fmt.Errorf("head_dim: %d is odd; rotary embeddings need pairs", c.HeadDim)
	}

	c.RMSNormEps = 1e-6
	if r.RMSNormEps != nil {
		c.RMSNormEps = *r.RMSNormEps
	}
	if !(c.RMSNormEps > 0 && c.RMSNormEps < 1) {
		return nil, fmt.Errorf("rms_norm_eps: %g is not in (0, 1)", c.RMSNormEps)
	}
	c.MaxPositions = defaultMaxPositions[c.Arch]
	if r.MaxPositions != nil {
		c.MaxPositions = *r.MaxPositions
	}
	if c.MaxPositions <= 0 {
		return nil, fmt.Errorf("max_position_embeddings: %d is not positive", c.MaxPositions)
	}
	if r.TieEmbeddings != nil {
		c.TieEmbedding = *r.TieEmbeddings
	}

	switch c.Arch {
	case ArchQwen2:
		c.AttentionBias = true // Qwen2 always biases q, k and v
	case ArchLlama:
		c.AttentionBias = r.AttentionBias != nil && *r.AttentionBias
	case ArchMistral:
		if r.AttentionBias != nil && *r.AttentionBias {
			return nil, errors.New("attention_bias: Mistral has no attention biases")
		}
	}

	if err := r.resolveSlidingWindow(c); err != nil {
		return nil, err
	}
	if err := r.resolveRope(c); err != nil {
		return nil, err
	}
	if err := r.resolveTokens(c); err != nil {
		return nil, err
	}

	switch {
	case r.DType != nil:
		c.DType = *r.DType
	case r.TorchDType != nil:
		c.DType = *r.TorchDType
	}
	switch c.DType {
	case "", "bfloat16", "float16", "float32":
	default:
		return nil, fmt.Errorf("dtype: unsupported %q (want bfloat16, float16 or float32)", c.DType)
	}
	return c, nil
}

// resolveSlidingWindow accepts a sliding window only when it is off.
func (r *rawConfig) resolveSlidingWindow(c *Config) error {
	off := isNull(r.SlidingWindow)
	if c.Arch == ArchQwen2 {
		// Qwen2 carries a window size but applies it only with
		// use_sliding_window.
		if r.UseSlidingWindow != nil && *r.UseSlidingWindow {
			return errors.New("use_sliding_window: sliding-window attention is not supported")
		}
		off = true
	}
	if !off {
		return fmt.Errorf("sliding_window: sliding-window attention (window %s) is not supported", bytes.TrimSpace(r.SlidingWindow))
	}
	if r.LayerTypes != nil && len(r.LayerTypes) != c.NumLayers {
		return fmt.Errorf("layer_types: %d entries for %d layers", len(r.LayerTypes), c.NumLayers)
	}
	for i, t := range r.LayerTypes {
		if t != "full_attention" {
			return fmt.Errorf("layer_types: layer %d is %q; only full_attention is supported", i, t)
		}
	}
	return nil
}

// resolveRope reads rope_parameters (transformers 5) or rope_theta and
// rope_scaling (transformers 4).
func (r *rawConfig) resolveRope(c *Config) error {
	c.RopeTheta = 10000
	if r.RopeTheta != nil {
		c.RopeTheta = *r.RopeTheta
	}
	field, msg := "rope_scaling", r.RopeScaling
	if !isNull(r.RopeParameters) {
		field, msg = "rope_parameters", r.RopeParameters
	}
	if !isNull(msg) {
		var rr rawRope
		if err := json.Unmarshal(msg, &rr); err != nil {
			return fmt.Errorf("%s: %w", field, err)
		}
		if rr.RopeTheta != nil {
			c.RopeTheta = *rr.RopeTheta
		}
		typ := "default"
		switch {
		case rr.RopeType != nil:
			typ = *rr.RopeType
		case rr.Type != nil:
			typ = *rr.Type
		}
		switch typ {
		case "default":
		case "llama3":
			s, err := rr.llama3(field)
			if err != nil {
				return err
			}
			c.RopeScaling = s
		default:
			return fmt.Errorf("%s: unsupported rope type %q (want default or llama3)", field, typ)
		}
	}
	if !(c.RopeTheta > 0) {
		return fmt.Errorf("rope_theta: %g is not positive", c.RopeTheta)
	}
	return nil
}

func (rr *rawRope) llama3(field string) (*RopeScaling, error) {
	for _, f := range []struct {
		name string
		v    *float64
	}{{"factor", rr.Factor}, {"low_freq_factor", rr.LowFreqFactor}, {"high_freq_factor", rr.HighFreqFactor}} {
		if f.v == nil {
			return nil, fmt.Errorf("%s.%s: missing for llama3 rope", field, f.name)
		}
		if !(*f.v > 0) {
			return nil, fmt.Errorf("%s.%s: %g is not positive", field, f.name, *f.v)
		}
	}
	if rr.OriginalMax == nil {
		return nil, fmt.Errorf("%s.original_max_position_embeddings: missing for llama3 rope", field)
	}
	if *rr.OriginalMax <= 0 {
		return nil, fmt.Errorf("%s.original_max_position_embeddings: %d is not positive", field, *rr.OriginalMax)
	}
	if *rr.HighFreqFactor <= *rr.LowFreqFactor {
		return nil, fmt.Errorf("%s.high_freq_factor: %g is not above low_freq_factor %g", field, *rr.HighFreqFactor, *rr.LowFreqFactor)
	}
	return &RopeScaling{
		Type:                 "llama3",
		Factor:               *rr.Factor,
		LowFreqFactor:        *rr.LowFreqFactor,
		HighFreqFactor:       *rr.HighFreqFactor,
		OriginalMaxPositions: *rr.OriginalMax,
	}, nil
}

// resolveTokens reads bos_token_id (an id or null) and eos_token_id (an id,
// a list of ids, or null).
func (r *rawConfig) resolveTokens(c *Config) error {
	c.BOS = -1
	if !isNull(r.BOS) {
		if err := json.Unmarshal(r.BOS, &c.BOS); err != nil {
			return fmt.Errorf("bos_token_id: %s is not a token id", bytes.TrimSpace(r.BOS))
		}
		if c.BOS < 0 || c.BOS >= c.VocabSize {
			return fmt.Errorf("bos_token_id: %d is outside the vocabulary of %d", c.BOS, c.VocabSize)
		}
	}
	c.EOS = []int{}
	if !isNull(r.EOS) {
		var one int
		if err := json.Unmarshal(r.EOS, &one); err == nil {
			c.EOS = []int{one}
		} else if err := json.Unmarshal(r.EOS, &c.EOS); err != nil {
			return fmt.Errorf("eos_token_id: %s is not a token id or a list of them", bytes.TrimSpace(r.EOS))
		}
		for _, id := range c.EOS {
			if id < 0 || id >= c.VocabSize {
				return fmt.Errorf("eos_token_id: %d is outside the vocabulary of %d", id, c.VocabSize)
			}
		}
	}
	return nil
}
