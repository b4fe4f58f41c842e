package daemon

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/daemon/membership"
	"github.com/tandem-llm/tandem/daemon/placement"
	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/model"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
	"github.com/tandem-llm/tandem/stage"
	"github.com/tandem-llm/tandem/stage/cpu"
	"github.com/tandem-llm/tandem/stage/cuda"
)

// stageDevice is what this node's stage runs on: the host's CPU, or one
// GPU the daemon holds open from start to stop (its stages run on it).
type stageDevice struct {
	backend string // membership.BackendCPU or BackendCUDA
	name    string // the CPU's or GPU's name
	// total is the device's memory; free what was free at start.
	total, free uint64
	memErr      error       // why total and free are unknown
	gpu         *gpu.Device // nil on the CPU
}

// gpuProbe finds the CUDA driver; a variable so tests can stand in for a
// host with or without one.
var gpuProbe = gpu.Probe

// openDevice picks the stage backend the configuration asks for: cpu;
// cuda, failing when no GPU can be used; auto, cuda when a driver and the
// configured device are there, else cpu, logging why.
func openDevice(cfg StageConfig, log *slog.Logger) (*stageDevice, error) {
	if cfg.Backend == BackendCPU {
		return cpuDevice(), nil
	}
	dev, err := openGPU(cfg.Device)
	switch {
	case err == nil:
		log.Info("using CUDA backend", "device", dev.name, "ordinal", cfg.Device, "memory", ByteSize(dev.total), "free", ByteSize(dev.free))
		return dev, nil
	case cfg.Backend == BackendCUDA:
		return nil, fmt.Errorf("stage.backend cuda: %w", err)
	}
	why := "no usable GPU"
	if errors.Is(err, gpu.ErrNoDriver) {
		why = "no CUDA driver"
	}
	log.Info(fmt.Sprintf("using CPU backend: %s (stage.backend auto)", why), "reason", err)
	return cpuDevice(), nil
}

// cpuDevice is the host's CPU and memory (none known when /proc/meminfo
// cannot be read: stage.memory must then say it).
func cpuDevice() *stageDevice {
	d := &stageDevice{backend: membership.BackendCPU, name: cpuName()}
	d.total, d.free, d.memErr = hostMemory()
	return d
}

// openGPU opens GPU ordinal and reads its memory.
func openGPU(ordinal int) (*stageDevice, error) {
	if err := gpuProbe(); err != nil {
		return nil, err
	}
	n, err := gpu.DeviceCount()
	if err != nil {
		return nil, fmt.Errorf("count CUDA devices: %w", err)
	}
	if ordinal >= n {
		return nil, fmt.Errorf("GPU %d: %d CUDA devices visible (CUDA_VISIBLE_DEVICES=%q)", ordinal, n, os.Getenv("CUDA_VISIBLE_DEVICES"))
	}
	d, err := gpu.Open(ordinal)
	if err != nil {
		return nil, fmt.Errorf("open GPU %d: %w", ordinal, err)
	}
	var free, total int
	if err := d.Do(func() (err error) { free, total, err = gpu.MemInfo(); return err }); err != nil {
		d.Close()
		return nil, fmt.Errorf("GPU %d memory: %w", ordinal, err)
	}
	return &stageDevice{backend: membership.BackendCUDA, name: d.Info().Name, total: uint64(total), free: uint64(free), gpu: d}, nil
}

// usable is what the stage may use: the configured amount, or 90% of what
// was free at start.
func (d *stageDevice) usable(configured ByteSize) (uint64, error) {
	switch {
	case configured > 0:
		return uint64(configured), nil
	case d.memErr != nil:
		return 0, fmt.Errorf("%w (set stage.memory)", d.memErr)
	}
	return d.free / 10 * 9, nil
}

// close releases the GPU, if one is open.
func (d *stageDevice) close() error {
	if d == nil || d.gpu == nil {
		return nil
	}
	return d.gpu.Close()
}

// kernelCacheDir is where a cuda stage caches its compiled kernels: the
// configured directory, else (when $TANDEM_CACHE_DIR, which the stage
// itself reads, is unset) the kernels folder of systemd's
// $CACHE_DIRECTORY, else "" (the stage's default).
func kernelCacheDir(configured string) string {
	if configured != "" || os.Getenv("TANDEM_CACHE_DIR") != "" {
		return configured
	}
	if dirs := os.Getenv("CACHE_DIRECTORY"); dirs != "" {
		first, _, _ := strings.Cut(dirs, ":")
		return filepath.Join(first, "kernels")
	}
	return ""
}

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
// reaches sp.blocks, the most the batch bounds can use.
func (s *stageSlot) newStage(cfg *model.Config, sp stageSpec, estimate int) (stage.Stage, error) {
	if s.dev.backend != BackendCUDA {
		return cpu.New(cpu.Config{Model: cfg, Lo: sp.lo, Hi: sp.hi, Weights: s.ckpt, MaxTokens: sp.maxTokens, MaxSeqs: sp.maxSeqs, NumBlocks: sp.blocks, BlockSize: sp.blockSize})
	}
	c := cuda.Config{
		Model: cfg, Lo: sp.lo, Hi: sp.hi, Weights: s.ckpt, MaxTokens: sp.maxTokens, MaxSeqs: sp.maxSeqs,
		NumBlocks: sp.blocks, BlockSize: sp.blockSize,
		Device: s.dev.gpu, CacheDir: s.cacheDir, GraphMemory: s.graphMemory,
	}
	if estimate < sp.blocks {
		// What was free at start, less what the stage may use (its KV,
		// weights and workspace: usable; its graphs: graphMemory).
		c.NumBlocks = 0
		c.KVMargin = max(int64(s.dev.free)-int64(s.usable)-s.graphMemory, minKVMargin)
	}
	return cuda.New(c)
}

// minKVMargin is the least device memory a CUDA stage leaves free when it
// sizes its KV cache.
const minKVMargin = 256 << 20

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

// encodeGraphKeys writes the dispatcher's keys for Node.Capture.
func encodeGraphKeys(keys []graphs.Step) []*tandemv1.GraphKey {
	out := make([]*tandemv1.GraphKey, len(keys))
	for i, k := range keys {
		out[i] = &tandemv1.GraphKey{Mode: k.Mode.String(), NumTokens: uint32(k.Desc.NumTokens), NumReqs: uint32(k.Desc.NumReqs),
			UniformDecode: k.Desc.UniformDecode, QueryLen: uint32(k.Desc.QueryLen)}
	}
	return out
}

// decodeGraphKeys reads the keys of a Capture request.
func decodeGraphKeys(in []*tandemv1.GraphKey) ([]graphs.Step, error) {
	out := make([]graphs.Step, len(in))
	for i, k := range in {
		m, err := graphs.ParseMode(k.GetMode())
		if err != nil {
			return nil, fmt.Errorf("graph key %d: %w", i, err)
		}
		if m != graphs.Full && m != graphs.Piecewise {
			return nil, fmt.Errorf("graph key %d: mode %s: graphs are captured for FULL or PIECEWISE", i, m)
		}
		if k.GetNumTokens() == 0 || k.GetNumTokens() > graphs.MaxCaptureSizeLimit {
			return nil, fmt.Errorf("graph key %d: %d tokens, want [1, %d]", i, k.GetNumTokens(), graphs.MaxCaptureSizeLimit)
		}
		out[i] = graphs.Step{Mode: m, Desc: graphs.BatchDescriptor{NumTokens: int(k.GetNumTokens()), NumReqs: int(k.GetNumReqs()),
			UniformDecode: k.GetUniformDecode(), QueryLen: int(k.GetQueryLen())}}
	}
	return out, nil
}
