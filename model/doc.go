// Package model describes Llama-family checkpoints: their configuration
// (Config, parsed from a Hugging Face config.json) and their weights
// (Checkpoint, a directory of config.json and safetensors files).
//
// ParseConfig reads LlamaForCausalLM, MistralForCausalLM and
// Qwen2ForCausalLM configs in both the transformers 4 and 5 layouts and
// resolves every default, so no other package reads config.json. What
// tandem does not implement (sliding windows, rope types other than default
// and llama3, MLP biases, quantization, other activations) is an error naming
// the field.
//
// Usage:
//
//	ck, err := model.Open(dir)           // config.json + weights
//	cfg := ck.Config()
//	err = ck.CheckLayers(8, 16, false, true) // what a stage needs is there
//	t, err := ck.Tensor(model.LayerTensor(8, model.QProj))
//	id := ck.Identity()                  // same bytes ⇒ same id on every host
//	n, err := ck.StageBytes(8, 16, false, true) // what loading those layers reads
//	w := ck.Counted(report)              // Tensor as ck, reporting bytes gone through
//	ck.Close()
//
// A sharded checkpoint maps a shard only when one of its tensors is first
// asked for, so a stage loading some layers maps only the shards holding
// them (Mapped reports which).
//
// Concurrency: a Checkpoint is safe for concurrent use (Tensor, CheckLayers,
// StageBytes, Mapped; a Counted too) except Close, which must come after every use of its tensors. A
// Config is read-only once parsed.
package model
