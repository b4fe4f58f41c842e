package model

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// Real-world configs, as published with the checkpoints (Llama 3.2 1B also
// as transformers 5 rewrites it).
const (
	llama32Config = `{
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": 128001,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 8192,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 16,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0",
  "use_cache": true,
  "vocab_size": 128256
}`
	llama32ConfigV5 = `{
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "dtype": "bfloat16",
  "eos_token_id": 128001,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 8192,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 16,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_parameters": {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rope_type": "llama3"
  },
  "tie_word_embeddings": true,
  "transformers_version": "5.0.0",
  "use_cache": true,
  "vocab_size": 128256
}`
	llama31InstructConfig = `{
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009],
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 131072,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3"
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.42.3",
  "use_cache": true,
  "vocab_size": 128256
}`
	tinyLlamaConfig = `{
  "architectures": ["LlamaForCausalLM"],
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 5632,
  "max_position_embeddings": 2048,
  "model_type": "llama",
  "num_attention_heads": 32,
  "num_hidden_layers": 22,
  "num_key_value_heads": 4,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.35.0",
  "use_cache": true,
  "vocab_size": 32000
}`
	mistralConfig = `{
  "architectures": ["MistralForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 32768,
  "model_type": "mistral",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_theta": 1000000.0,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.42.0.dev0",
  "use_cache": true,
  "vocab_size": 32768
}`
	mistralV01Config = `{
  "architectures": ["MistralForCausalLM"],
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 32768,
  "model_type": "mistral",
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0,
  "sliding_window": 4096,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.34.0.dev0",
  "use_cache": true,
  "vocab_size": 32000
}`
	qwen25Config = `{
  "architectures": ["Qwen2ForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "hidden_act": "silu",
  "hidden_size": 896,
  "initializer_range": 0.02,
  "intermediate_size": 4864,
  "max_position_embeddings": 32768,
  "max_window_layers": 21,
  "model_type": "qwen2",
  "num_attention_heads": 14,
  "num_hidden_layers": 24,
  "num_key_value_heads": 2,
  "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0,
  "sliding_window": 32768,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.43.1",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
}`
)

func TestParseConfig(t *testing.T) {
	llama32 := &Config{
		Arch: ArchLlama, HiddenSize: 2048, NumLayers: 16, NumHeads: 32, NumKVHeads: 8, HeadDim: 64,
		IntermediateSize: 8192, VocabSize: 128256, RMSNormEps: 1e-5, RopeTheta: 500000,
		RopeScaling:  &RopeScaling{Type: "llama3", Factor: 32, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositions: 8192},
		MaxPositions: 131072, TieEmbedding: true, BOS: 128000, EOS: []int{128001}, DType: "bfloat16",
	}
	tests := []struct {
		name string
		json string
		want *Config
	}{
		{"llama-3.2-1b", llama32Config, llama32},
		{"llama-3.2-1b transformers 5", llama32ConfigV5, llama32},
		{"llama-3.1-8b-instruct", llama31InstructConfig, &Config{
			Arch: ArchLlama, HiddenSize: 4096, NumLayers: 32, NumHeads: 32, NumKVHeads: 8, HeadDim: 128,
			IntermediateSize: 14336, VocabSize: 128256, RMSNormEps: 1e-5, RopeTheta: 500000,
			RopeScaling:  &RopeScaling{Type: "llama3", Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositions: 8192},
			MaxPositions: 131072, BOS: 128000, EOS: []int{128001, 128008, 128009}, DType: "bfloat16",
		}},
		{"tinyllama", tinyLlamaConfig, &Config{
			Arch: ArchLlama, HiddenSize: 2048, NumLayers: 22, NumHeads: 32, NumKVHeads: 4, HeadDim: 64,
			IntermediateSize: 5632, VocabSize: 32000, RMSNormEps: 1e-5, RopeTheta: 10000,
			MaxPositions: 2048, BOS: 1, EOS: []int{2}, DType: "bfloat16",
		}},
		{"mistral-7b-v0.3", mistralConfig, &Config{
			Arch: ArchMistral, HiddenSize: 4096, NumLayers: 32, NumHeads: 32, NumKVHeads: 8, HeadDim: 128,
			IntermediateSize: 14336, VocabSize: 32768, RMSNormEps: 1e-5, RopeTheta: 1e6,
			MaxPositions: 32768, BOS: 1, EOS: []int{2}, DType: "bfloat16",
		}},
		{"qwen2.5-0.5b", qwen25Config, &Config{
			Arch: ArchQwen2, HiddenSize: 896, NumLayers: 24, NumHeads: 14, NumKVHeads: 2, HeadDim: 64,
			IntermediateSize: 4864, VocabSize: 151936, RMSNormEps: 1e-6, RopeTheta: 1e6,
			MaxPositions: 32768, TieEmbedding: true, AttentionBias: true, BOS: 151643, EOS: []int{151645}, DType: "bfloat16",
		}},
		{"defaults", `{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
			"num_key_value_heads": null, "head_dim": null, "intermediate_size": 128, "vocab_size": 300, "eos_token_id": null}`, &Config{
			Arch: ArchLlama, HiddenSize: 64, NumLayers: 2, NumHeads: 4, NumKVHeads: 4, HeadDim: 16,
			IntermediateSize: 128, VocabSize: 300, RMSNormEps: 1e-6, RopeTheta: 10000,
			MaxPositions: 2048, BOS: -1, EOS: []int{},
		}},
		{"explicit head_dim", patch(mistralConfig, map[string]any{"hidden_size": 5120, "head_dim": 128}), &Config{
			Arch: ArchMistral, HiddenSize: 5120, NumLayers: 32, NumHeads: 32, NumKVHeads: 8, HeadDim: 128,
			IntermediateSize: 14336, VocabSize: 32768, RMSNormEps: 1e-5, RopeTheta: 1e6,
			MaxPositions: 32768, BOS: 1, EOS: []int{2}, DType: "bfloat16",
		}},
		{"llama with biases, rope type spelled type", patch(tinyLlamaConfig, map[string]any{
			"attention_bias": true, "rope_scaling": map[string]any{"type": "default"}, "rope_theta": 5e5,
		}), &Config{
			Arch: ArchLlama, HiddenSize: 2048, NumLayers: 22, NumHeads: 32, NumKVHeads: 4, HeadDim: 64,
			IntermediateSize: 5632, VocabSize: 32000, RMSNormEps: 1e-5, RopeTheta: 5e5, AttentionBias: true,
			MaxPositions: 2048, BOS: 1, EOS: []int{2}, DType: "bfloat16",
		}},
		{"qwen2 transformers 5", patch(qwen25Config, map[string]any{
			"sliding_window":  nil,
			"layer_types":     fullAttention(24),
			"rope_theta":      remove,
			"rope_parameters": map[string]any{"rope_theta": 1e6, "rope_type": "default"},
			"torch_dtype":     remove,
			"dtype":           "bfloat16",
		}), &Config{
			Arch: ArchQwen2, HiddenSize: 896, NumLayers: 24, NumHeads: 14, NumKVHeads: 2, HeadDim: 64,
			IntermediateSize: 4864, VocabSize: 151936, RMSNormEps: 1e-6, RopeTheta: 1e6,
			MaxPositions: 32768, TieEmbedding: true, AttentionBias: true, BOS: 151643, EOS: []int{151645}, DType: "bfloat16",
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseConfig([]byte(tt.json))
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got  %+v %+v\nwant %+v %+v", *got, got.RopeScaling, *tt.want, tt.want.RopeScaling)
			}
		})
	}
}

// remove, as a patch value, deletes the key.
var remove = new(int)

// patch applies changes to a JSON object (a value of remove deletes the
// key).
func patch(base string, changes map[string]any) string {
	var m map[string]any
	if err := json.Unmarshal([]byte(base), &m); err != nil {
		panic(err)
	}
	for k, v := range changes {
		if v == remove {
			delete(m, k)
		} else {
			m[k] = v
		}
	}
	b, err := json.Marshal(m)
	if err != nil {
		panic(err)
	}
	return string(b)
}

func fullAttention(n int) []string {
	s := make([]string, n)
	for i := range s {
		s[i] = "full_attention"
	}
	return s
}

func TestParseConfigErrors(t *testing.T) {
	llama3 := map[string]any{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
	without := func(k string) map[string]any {
		m := map[string]any{}
		for kk, v := range llama3 {
			if kk != k {
				m[kk] = v
			}
		}
		return m
	}
	tests := []struct {
		name, json, want string
	}{
		{"invalid json", `{"hidden_size": `, "parse config"},
		{"architecture", patch(llama32Config, map[string]any{"architectures": []string{"GPT2LMHeadModel"}}), `architectures: unsupported architecture "GPT2LMHeadModel"`},
		{"qwen3", patch(qwen25Config, map[string]any{"architectures": []string{"Qwen3ForCausalLM"}}), `"Qwen3ForCausalLM"`},
		{"model type", patch(llama32Config, map[string]any{"architectures": remove, "model_type": "gemma"}), `model_type "gemma"`},
		{"hidden missing", patch(llama32Config, map[string]any{"hidden_size": remove}), "hidden_size: missing"},
		{"hidden zero", patch(llama32Config, map[string]any{"hidden_size": 0}), "hidden_size: 0 is not positive"},
		{"hidden string", patch(llama32Config, map[string]any{"hidden_size": "2048"}), "hidden_size"},
		{"layers negative", patch(llama32Config, map[string]any{"num_hidden_layers": -1}), "num_hidden_layers: -1 is not positive"},
		{"vocab missing", patch(llama32Config, map[string]any{"vocab_size": remove}), "vocab_size: missing"},
		{"intermediate", patch(llama32Config, map[string]any{"intermediate_size": 0}), "intermediate_size"},
		{"heads", patch(llama32Config, map[string]any{"num_attention_heads": 0}), "num_attention_heads"},
		{"kv heads", patch(llama32Config, map[string]any{"num_key_value_heads": 5}), "num_key_value_heads: 5 does not divide num_attention_heads 32"},
		{"kv heads zero", patch(llama32Config, map[string]any{"num_key_value_heads": 0}), "num_key_value_heads"},
		{"head_dim", patch(llama32Config, map[string]any{"head_dim": -64}), "head_dim: -64 is not positive"},
		{"head_dim odd", patch(llama32Config, map[string]any{"head_dim": 63}), "head_dim: 63 is odd"},
		{"head_dim underived", patch(tinyLlamaConfig, map[string]any{"hidden_size": 2050}), "head_dim: absent, and hidden_size 2050"},
		{"eps", patch(llama32Config, map[string]any{"rms_norm_eps": 0}), "rms_norm_eps"},
		{"max positions", patch(llama32Config, map[string]any{"max_position_embeddings": 0}), "max_position_embeddings"},
		{"activation", patch(llama32Config, map[string]any{"hidden_act": "gelu"}), `hidden_act: unsupported activation "gelu"`},
		{"mlp bias", patch(llama32Config, map[string]any{"mlp_bias": true}), "mlp_bias"},
		{"mistral bias", patch(mistralConfig, map[string]any{"attention_bias": true}), "attention_bias"},
		{"quantized", patch(llama32Config, map[string]any{"quantization_config": map[string]any{"quant_method": "awq"}}), "quantization_config"},
		{"rope linear", patch(tinyLlamaConfig, map[string]any{"rope_scaling": map[string]any{"type": "linear", "factor": 2.0}}), `rope_scaling: unsupported rope type "linear"`},
		{"rope dynamic", patch(tinyLlamaConfig, map[string]any{"rope_scaling": map[string]any{"rope_type": "dynamic", "factor": 2.0}}), `unsupported rope type "dynamic"`},
		{"rope yarn v5", patch(llama32ConfigV5, map[string]any{"rope_parameters": map[string]any{"rope_type": "yarn", "rope_theta": 1e4}}), `rope_parameters: unsupported rope type "yarn"`},
		{"rope longrope", patch(llama32Config, map[string]any{"rope_scaling": map[string]any{"rope_type": "longrope"}}), `"longrope"`},
		{"rope theta", patch(llama32Config, map[string]any{"rope_theta": -1}), "rope_theta: -1 is not positive"},
		{"rope theta v5", patch(llama32ConfigV5, map[string]any{"rope_parameters": map[string]any{"rope_type": "default", "rope_theta": 0}}), "rope_theta: 0"},
		{"llama3 factor", patch(llama32Config, map[string]any{"rope_scaling": without("factor")}), "rope_scaling.factor: missing"},
		{"llama3 low", patch(llama32ConfigV5, map[string]any{"rope_parameters": without("low_freq_factor")}), "rope_parameters.low_freq_factor: missing"},
		{"llama3 original", patch(llama32Config, map[string]any{"rope_scaling": without("original_max_position_embeddings")}), "rope_scaling.original_max_position_embeddings: missing"},
		{"llama3 order", patch(llama32Config, map[string]any{"rope_scaling": map[string]any{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}}), "rope_scaling.high_freq_factor: 1 is not above low_freq_factor 4"},
		{"rope not object", patch(llama32Config, map[string]any{"rope_scaling": 3}), "rope_scaling"},
		{"mistral window", mistralV01Config, "sliding_window: sliding-window attention (window 4096) is not supported"},
		{"mistral window off flag", patch(mistralV01Config, map[string]any{"use_sliding_window": false}), "sliding_window"},
		{"llama window", patch(llama32Config, map[string]any{"sliding_window": 4096}), "sliding_window"},
		{"qwen2 window on", patch(qwen25Config, map[string]any{"use_sliding_window": true}), "use_sliding_window"},
		{"qwen2 layer types", patch(qwen25Config, map[string]any{"layer_types": append(fullAttention(23), "sliding_attention")}), `layer_types: layer 23 is "sliding_attention"`},
		{"qwen2 layer types count", patch(qwen25Config, map[string]any{"layer_types": fullAttention(3)}), "layer_types: 3 entries for 24 layers"},
		{"bos range", patch(llama32Config, map[string]any{"bos_token_id": 128256}), "bos_token_id: 128256 is outside the vocabulary of 128256"},
		{"bos float", patch(llama32Config, map[string]any{"bos_token_id": 1.5}), "bos_token_id: 1.5 is not a token id"},
		{"eos range", patch(llama31InstructConfig, map[string]any{"eos_token_id": []int{1, -2}}), "eos_token_id: -2 is outside"},
		{"eos string", patch(llama32Config, map[string]any{"eos_token_id": "</s>"}), "eos_token_id"},
		{"dtype", patch(llama32ConfigV5, map[string]any{"dtype": "int8"}), `dtype: unsupported "int8"`},
		{"torch_dtype", patch(llama32Config, map[string]any{"torch_dtype": "float64"}), `dtype: unsupported "float64"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := ParseConfig([]byte(tt.json))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want one containing %q", err, tt.want)
			}
		})
	}
}

func FuzzParseConfig(f *testing.F) {
	for _, s := range []string{llama32Config, llama32ConfigV5, llama31InstructConfig, tinyLlamaConfig, mistralConfig, mistralV01Config, qwen25Config} {
		f.Add([]byte(s))
	}
	f.Add([]byte(`{"model_type":"qwen2","hidden_size":8,"num_hidden_layers":1,"num_attention_heads":2,"intermediate_size":4,"vocab_size":9,"eos_token_id":[8,0]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := ParseConfig(data)
		if err != nil {
			return
		}
		if c.HiddenSize <= 0 || c.NumLayers <= 0 || c.NumHeads <= 0 || c.NumKVHeads <= 0 || c.NumHeads%c.NumKVHeads != 0 ||
			c.HeadDim <= 0 || c.HeadDim%2 != 0 || c.IntermediateSize <= 0 || c.VocabSize <= 0 || c.MaxPositions <= 0 ||
			!(c.RMSNormEps > 0) || !(c.RopeTheta > 0) {
			t.Fatalf("accepted invalid %+v", *c)
		}
		if c.BOS < -1 || c.BOS >= c.VocabSize {
			t.Fatalf("accepted BOS %d", c.BOS)
		}
		for _, e := range c.EOS {
			if e < 0 || e >= c.VocabSize {
				t.Fatalf("accepted EOS %d", e)
			}
		}
		if s := c.RopeScaling; s != nil && (s.Type != "llama3" || !(s.Factor > 0) || !(s.HighFreqFactor > s.LowFreqFactor) || s.OriginalMaxPositions <= 0) {
			t.Fatalf("accepted rope scaling %+v", *s)
		}
		switch c.Arch {
		case ArchLlama, ArchMistral, ArchQwen2:
		default:
			t.Fatalf("accepted architecture %q", c.Arch)
		}
	})
}

func TestLoadConfig(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, ConfigName), []byte(qwen25Config), 0o644); err != nil {
		t.Fatal(err)
	}
	got, err := LoadConfig(dir)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := ParseConfig([]byte(qwen25Config))
	if !reflect.DeepEqual(got, want) {
		t.Errorf("LoadConfig %+v, ParseConfig %+v", *got, *want)
	}
	if err := os.WriteFile(filepath.Join(dir, ConfigName), []byte(mistralV01Config), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadConfig(dir); err == nil || !strings.Contains(err.Error(), filepath.Join(dir, ConfigName)) || !strings.Contains(err.Error(), "sliding_window") {
		t.Errorf("bad config: %v", err)
	}
	if _, err := LoadConfig(t.TempDir()); err == nil || !strings.Contains(err.Error(), "config.json") {
		t.Errorf("missing config: %v", err)
	}
}
