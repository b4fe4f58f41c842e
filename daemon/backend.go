package daemon

import (
	"github.com/tandem-llm/tandem/daemon/placement"
	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/stage/cuda"
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

// cudaWorkspace is the device memory of a CUDA stage besides weights, KV
// cache and graphs for its batch bounds, as stage/cuda lays it out
// (cuda.WorkspaceBytes); a model the CUDA backend cannot run counts 0 here
// and fails when its stage is built. The stage reports the actual figure
// (LoadResponse.workspace_bytes).
func cudaWorkspace(cfg *model.Config, maxTokens, maxSeqs int) uint64 {
	n, err := cuda.WorkspaceBytes(cuda.Config{Model: cfg, MaxTokens: maxTokens, MaxSeqs: maxSeqs})
	if err != nil {
		return 0
	}
	return uint64(n)
}
