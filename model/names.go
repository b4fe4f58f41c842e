package model

import "fmt"

// Tensor names in the Hugging Face Llama layout, shared by every supported
// architecture.
const (
	EmbedName  = "model.embed_tokens.weight"
	NormName   = "model.norm.weight"
	LMHeadName = "lm_head.weight"
)

// LayerTensor names one weight of transformer layer i, for example
// LayerTensor(3, "self_attn.q_proj.weight").
func LayerTensor(i int, suffix string) string {
	return fmt.Sprintf("model.layers.%d.%s", i, suffix)
}

// Per-layer weight suffixes.
const (
	InputNorm = "input_layernorm.weight"
	PostNorm  = "post_attention_layernorm.weight"
	QProj     = "self_attn.q_proj.weight"
	KProj     = "self_attn.k_proj.weight"
	VProj     = "self_attn.v_proj.weight"
	OProj     = "self_attn.o_proj.weight"
	QBias     = "self_attn.q_proj.bias"
	KBias     = "self_attn.k_proj.bias"
	VBias     = "self_attn.v_proj.bias"
	GateProj  = "mlp.gate_proj.weight"
	UpProj    = "mlp.up_proj.weight"
	DownProj  = "mlp.down_proj.weight"
)
