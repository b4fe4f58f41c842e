package daemon

import (
	"github.com/tandem-llm/tandem/daemon/placement"
	"github.com/tandem-llm/tandem/model"
)

// backendCost is what a stage of the backend holds, as placement counts
// it: weights and KV cache in the backend's element type (float32 on the
// CPU, bfloat16 on CUDA) and its workspace for the batch bounds.
func backendCost(cfg *model.Config, backend string, maxBatchTokens, maxSeqs int) placement.Cost {
	if backend == BackendCUDA {
		c := placement.CostOf(cfg, 2)
		c.WorkspaceBytes = cudaWorkspace(cfg, maxBatchTokens, maxSeqs)
		return c
	}
	c := placement.CostOf(cfg, cpuDTypeBytes)
	c.WorkspaceBytes = placement.Workspace(cfg, maxBatchTokens, maxSeqs)
	return c
}

// cudaWorkspace estimates the device memory of a CUDA stage besides
// weights, KV cache and graphs, for its batch bounds: per token row, the
// float32 input, residual stream and GEMM outputs and the bfloat16 GEMM
// inputs (twice the rows, compensated), and the float32 logits of the
// sampled rows; with 96 MiB for the cuBLAS workspace, the batch
// description and the allocator's rounding. The stage reports the actual
// figure (LoadResponse.workspace_bytes).
func cudaWorkspace(cfg *model.Config, maxTokens, maxSeqs int) uint64 {
	h, q, kv, inter := cfg.HiddenSize, cfg.QDim(), cfg.KVDim(), cfg.IntermediateSize
	row := 4*(4*h+2*(q+2*kv)+4*inter) + 2*(2*h+3*q+2*inter)
	logitRows := max(maxSeqs, min(maxTokens, 256))
	return uint64(maxTokens)*uint64(row) + uint64(logitRows)*uint64(cfg.VocabSize)*4 + 96<<20
}
