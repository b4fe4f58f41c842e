package stagehost

import (
	"fmt"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/progress"
	"github.com/tandem-llm/tandem/stage"
	"github.com/tandem-llm/tandem/stage/cpu"
	"github.com/tandem-llm/tandem/stage/cuda"
)

// stageSpec is what the leader asks a stage to load: its layers [lo, hi),
// the batch bounds and the KV block size; and the KV blocks the stage
// gets: at most what every sequence of a full batch at the model's
// context length needs, and (once loaded) what the stage reports.
type stageSpec struct {
	lo, hi, maxTokens, maxSeqs, blockSize int
	blocks                                int
}

// maxSeqLen is the longest sequence the stage holds: the model's context,
// bounded by the KV capacity.
func (sp stageSpec) maxSeqLen(cfg *model.Config) int {
	return min(cfg.MaxPositions, sp.blocks*sp.blockSize)
}

// newStage builds the stage on this node's device. A CPU stage gets the
// blocks sp.blocks estimates. A CUDA stage sizes its own KV cache from the
// device memory free once its weights, workspace and graph memory are in,
// leaving free what the stage may not use, unless the estimate already
// reaches sp.blocks, the most the batch bounds can use. Reading the
// weights is shown as it advances, and a CUDA stage's steps through steps.
func (s *Slot) newStage(cfg *model.Config, sp stageSpec, estimate int, steps *progress.Steps) (st stage.Stage, err error) {
	ck := s.cfg.Checkpoint
	total, err := ck.StageBytes(sp.lo, sp.hi, sp.lo == 0, sp.hi == cfg.NumLayers)
	if err != nil {
		return nil, err
	}
	// The bar starts when the stage asks for its first tensor.
	var load *progress.Task
	weights := ck.Counted(func(done int64) {
		if load == nil {
			load = s.cfg.Progress.Start(fmt.Sprintf("load layers [%d,%d)", sp.lo, sp.hi), progress.Bytes, total, "node", s.cfg.Name)
		}
		load.Set(done, 0)
	})
	defer func() {
		if err == nil {
			weights.Finish()
		}
		load.End(err)
		steps.End(err)
	}()
	if s.cfg.Device.Backend != BackendCUDA {
		return cpu.New(cpu.Config{Model: cfg, Lo: sp.lo, Hi: sp.hi, Weights: weights, MaxTokens: sp.maxTokens, MaxSeqs: sp.maxSeqs, NumBlocks: sp.blocks, BlockSize: sp.blockSize})
	}
	c := cuda.Config{
		Model: cfg, Lo: sp.lo, Hi: sp.hi, Weights: weights, MaxTokens: sp.maxTokens, MaxSeqs: sp.maxSeqs,
		NumBlocks: sp.blocks, BlockSize: sp.blockSize,
		Device: s.cfg.Device.gpu, CacheDir: s.cfg.CacheDir, GraphMemory: s.cfg.GraphMemory,
		CompensatedTokens: s.cfg.CompensatedTokens, Progress: steps.Step, Log: s.log,
	}
	if estimate < sp.blocks {
		// What was free at start, less what the stage may use (its KV,
		// weights and workspace: usable; its graphs: graphMemory).
		c.NumBlocks = 0
		c.KVMargin = max(int64(s.cfg.Device.Free)-int64(s.cfg.Usable)-s.cfg.GraphMemory, minKVMargin)
	}
	return cuda.New(c)
}

// minKVMargin is the least device memory a CUDA stage leaves free when it
// sizes its KV cache.
const minKVMargin = 256 << 20

// stageMemory is what a stage holds, as Load reports it: a CUDA stage's
// device memory, a CPU stage's host memory (no graphs).
func stageMemory(st stage.Stage) (weights, workspace, kv, graphs uint64) {
	switch m := st.(type) {
	case memoryReporter:
		mem := m.Memory()
		return uint64(mem.WeightBytes), uint64(mem.WorkspaceBytes), uint64(mem.KVBytes), uint64(mem.GraphBytes)
	case *cpu.Stage:
		mem := m.Memory()
		return uint64(mem.WeightBytes), uint64(mem.WorkspaceBytes), uint64(mem.KVBytes), 0
	}
	return 0, 0, 0, 0
}

// memoryReporter is a stage that reports the device memory it holds
// (stage/cuda).
type memoryReporter interface {
	Memory() cuda.Memory
}

// capturer is a stage that captures CUDA graphs (stage/cuda).
type capturer interface {
	Capture(keys []graphs.Step) error
	Graphs() cuda.GraphReport
}

// activationBytes is the largest activation message of a stage.
func activationBytes(info stage.Info) int { return info.MaxTokens * info.Hidden * info.ActDType.Size() }

// handoffBytes is the largest hand-off message: a (slot, token) row of
// int32 per sequence.
func handoffBytes(info stage.Info) int {
	return info.MaxSeqs * stage.HandoffCols * collective.I32.Size()
}

// position picks the phrase for a stage's place in the pipeline.
func position(cond bool, yes, no string) string {
	if cond {
		return yes
	}
	return no
}
