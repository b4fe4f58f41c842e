package placement

import "github.com/tandem-llm/tandem/model"

// Cost is the memory a model needs, in the terms placement balances.
type Cost struct {
	// Layers is the number of transformer layers.
	Layers int
	// LayerBytes is one layer's weights.
	LayerBytes uint64
	// EmbedBytes is the embedding table, held by the first stage.
	EmbedBytes uint64
	// HeadBytes is the final norm and the LM head, held by the last stage.
	// With tied embeddings the last stage still holds the matrix (unless it
	// is also the first), so it is counted: see CostOf.
	HeadBytes uint64
	// Tied is true when the LM head is the embedding matrix: a single
	// stage, both first and last, then holds the matrix once.
	Tied bool
	// KVBytesPerToken is one layer's KV cache per token: keys and values.
	KVBytesPerToken uint64
	// WorkspaceBytes is what every stage needs besides weights and KV
	// (activations, logits, library workspaces); see Workspace.
	WorkspaceBytes uint64
	// MaxKVTokens is the most KV cache, in tokens, a pipeline can use
	// (UsableKVTokens; 0: no bound). Balance counts a capacity only up to
	// it when it chooses the nodes that take part: a node is not left out
	// for lowering a capacity that exceeds what the scheduler can fill.
	MaxKVTokens int
}

// CostOf derives the cost of the model cfg describes, weights and KV cache
// stored in elements of dtypeBytes bytes (2 for bfloat16 and float16, 4 for
// float32). WorkspaceBytes is left zero: it depends on the batch limits,
// see Workspace. cfg must be a validated config (model.LoadConfig).
func CostOf(cfg *model.Config, dtypeBytes int) Cost {
	h, q, kv, inter := uint64(cfg.HiddenSize), uint64(cfg.QDim()), uint64(cfg.KVDim()), uint64(cfg.IntermediateSize)
	d := uint64(dtypeBytes)
	// q, k, v and o projections; gate, up and down; the two norms.
	layer := h*q + 2*h*kv + q*h + 3*h*inter + 2*h
	if cfg.AttentionBias {
		layer += q + 2*kv
	}
	matrix := uint64(cfg.VocabSize) * h
	// The last stage holds the LM head even when it is tied to the
	// embedding: a separate stage needs its own copy.
	return Cost{
		Layers:          cfg.NumLayers,
		LayerBytes:      layer * d,
		EmbedBytes:      matrix * d,
		HeadBytes:       (matrix + h) * d,
		Tied:            cfg.TieEmbedding,
		KVBytesPerToken: 2 * kv * d,
	}
}

// UsableKVTokens is the most KV cache, in tokens, a pipeline can use:
// every sequence of a full batch of maxSeqs at the model's context length,
// in whole blocks of blockSize positions. A stage allocates no more
// (package stagehost).
func UsableKVTokens(cfg *model.Config, maxSeqs, blockSize int) int {
	return maxSeqs * ((cfg.MaxPositions + blockSize - 1) / blockSize) * blockSize
}

// Workspace estimates a stage's working memory for batches of up to
// maxTokens token rows of which up to maxSeqs are sampled: float32
// activations of one layer at a time (residual, norm, q/k/v, attention
// output, and the MLP's gate and up), float32 logits of the sampled rows,
// and a fixed 64 MiB for library workspaces and the batch description.
func Workspace(cfg *model.Config, maxTokens, maxSeqs int) uint64 {
	const f32 = 4
	row := uint64(3*cfg.HiddenSize+cfg.QDim()+2*cfg.KVDim()+2*cfg.IntermediateSize) * f32
	logits := uint64(maxSeqs) * uint64(cfg.VocabSize) * f32
	return uint64(maxTokens)*row + logits + 64<<20
}
