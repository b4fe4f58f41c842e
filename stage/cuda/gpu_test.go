package cuda

import (
	"context"
	"errors"
	"os"
	"sync"
	"testing"

	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/stage"
	"github.com/tandem-llm/tandem/stage/stagetest"
)

// The tests in this file need a GPU; they skip, saying why, without one.

// testDev is the device every GPU test shares, opened on first use, and the
// kernel cache directory of the test process.
var testDev struct {
	once  sync.Once
	dev   *gpu.Device
	err   error
	cache string
}

func TestMain(m *testing.M) {
	code := m.Run()
	if testDev.dev != nil {
		testDev.dev.Close()
	}
	if testDev.cache != "" {
		os.RemoveAll(testDev.cache)
	}
	os.Exit(code)
}

// device returns the shared device, or skips t when there is no GPU.
func device(t *testing.T) *gpu.Device {
	t.Helper()
	testDev.once.Do(func() {
		if testDev.err = gpu.Probe(); testDev.err != nil {
			return
		}
		if testDev.cache, testDev.err = os.MkdirTemp("", "tandem-kernels"); testDev.err != nil {
			return
		}
		testDev.dev, testDev.err = gpu.Open(0)
	})
	if testDev.err != nil {
		t.Skipf("no GPU: %v", testDev.err)
	}
	return testDev.dev
}

// newTestStage builds a stage, on the shared device unless cfg names one,
// closed when t ends.
func newTestStage(t *testing.T, cfg Config) *Stage {
	t.Helper()
	if cfg.Device == nil {
		cfg.Device = device(t)
	}
	if cfg.CacheDir == "" {
		cfg.CacheDir = testDev.cache
	}
	st, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := st.Close(); err != nil {
			t.Error(err)
		}
	})
	return st
}

// deviceTransfer copies a stage's bf16 activations into the next stage's
// Input, device to device.
func deviceTransfer(t *testing.T, out *stage.Output, next stage.Stage) {
	t.Helper()
	src, ok := out.Activations.(gpu.Mem)
	dst, ok2 := next.Input().(gpu.Mem)
	ns, ok3 := next.(*Stage)
	if !ok || !ok2 || !ok3 {
		t.Fatalf("activations %T into %T of %T: want device buffers of CUDA stages", out.Activations, next.Input(), next)
	}
	n := out.Header.Bytes()
	err := ns.dev.Do(func() error {
		if err := gpu.CopyDtoDAsync(dst.Ptr(), src.Ptr(), n, ns.stream); err != nil {
			return err
		}
		return ns.stream.Synchronize()
	})
	if err != nil {
		t.Fatalf("copy activations: %v", err)
	}
}

// bf16Tol bounds the relative error of bf16 logits against the float64
// reference, the tolerance the HF comparison uses too.
const bf16Tol = 2e-2

func TestConformance(t *testing.T) {
	device(t)
	stagetest.Run(t, stagetest.Backend{
		New: func(t *testing.T, s stagetest.Spec) stage.Stage {
			return newTestStage(t, Config{Model: s.Model, Lo: s.Lo, Hi: s.Hi, Weights: s.Weights,
				MaxTokens: s.MaxTokens, MaxSeqs: s.MaxSeqs})
		},
		Transfer: deviceTransfer,
		// bf16 activations, and for the F32 and F16 shapes weights rounded
		// to bf16 at load, against a float64 reference on the unrounded
		// weights: up to 3e-2 measured on an H100.
		Tol: 4e-2,
		// A split hands the fp32 residual stream over exactly as one
		// stage keeps it between layers: the results are identical.
		SplitTol: 1e-6,
	})
}

func TestNewWithoutGPU(t *testing.T) {
	if gpu.Probe() == nil {
		t.Skip("a GPU is present")
	}
	sh := stagetest.Shapes()[0]
	_, err := New(Config{Model: &sh.Model, Lo: 0, Hi: sh.Model.NumLayers,
		Weights: stagetest.RandomWeights(&sh.Model, sh.DType, 1), MaxTokens: 8, MaxSeqs: 1})
	if !errors.Is(err, gpu.ErrNoDriver) {
		t.Fatalf("New without a GPU: %v; want an error wrapping gpu.ErrNoDriver", err)
	}
	t.Logf("New without a GPU: %v", err)
}

func TestKernelCacheOnGPU(t *testing.T) {
	dev := device(t)
	dir := t.TempDir()
	s := &Stage{dev: dev}
	ck, err := s.compileKey()
	if err != nil {
		t.Fatal(err)
	}
	c := kernelCache{dir: dir}
	sh := stagetest.Shapes()[0]
	w := stagetest.RandomWeights(&sh.Model, sh.DType, 1)
	build := func() {
		st, err := New(Config{Model: &sh.Model, Lo: 0, Hi: sh.Model.NumLayers, Weights: w,
			MaxTokens: 8, MaxSeqs: 1, Device: dev, CacheDir: dir})
		if err != nil {
			t.Fatal(err)
		}
		out, err := st.Forward(context.Background(), &stage.Batch{ID: 1, Seqs: []stage.Seq{{ID: 1, Tokens: []int32{1, 2}, Sample: true}}})
		if err != nil || len(out.Sampled) != 1 {
			t.Fatalf("forward: %v, %v", out, err)
		}
		if err := st.Close(); err != nil {
			t.Fatal(err)
		}
	}
	build()
	img, err := c.get(ck.key)
	if err != nil || img == nil {
		t.Fatalf("after New the cache holds %d bytes under the key, %v; want the image", len(img), err)
	}
	// An entry with a sound checksum whose image does not load is
	// recompiled and replaced.
	if err := c.put(ck.key, []byte("not a cubin")); err != nil {
		t.Fatal(err)
	}
	build()
	if again, err := c.get(ck.key); err != nil || string(again) == "not a cubin" {
		t.Fatalf("unloadable entry was not replaced (err %v)", err)
	}
	// A damaged file is recompiled too.
	if err := os.WriteFile(c.path(ck.key), []byte("garbage"), 0o644); err != nil {
		t.Fatal(err)
	}
	build()
	if again, err := c.get(ck.key); err != nil || again == nil {
		t.Fatalf("damaged entry was not rewritten (err %v)", err)
	}
}

func TestMemoryReport(t *testing.T) {
	sh := stagetest.Shapes()[0]
	m := sh.Model
	w := stagetest.RandomWeights(&m, sh.DType, 1)
	st := newTestStage(t, Config{Model: &m, Lo: 0, Hi: m.NumLayers, Weights: w, MaxTokens: 16, MaxSeqs: 2, KVSlots: 3, MaxSeqLen: 40})
	mem := st.Memory()
	// Weights: embedding, per layer two norms, q|k|v, o, gate|up, down,
	// then the final norm and LM head; each at a 256-byte boundary.
	H, I, V := m.HiddenSize, m.IntermediateSize, m.VocabSize
	q, kv := m.NumHeads*m.HeadDim, m.NumKVHeads*m.HeadDim
	perLayer := 2*H + (q+2*kv)*H + H*q + 2*I*H + H*I
	want := 2 * int64(V*H+m.NumLayers*perLayer+H+V*H)
	if mem.WeightBytes < want || mem.WeightBytes > want+int64(256*(3+6*m.NumLayers)) {
		t.Errorf("weight bytes %d; want %d plus alignment", mem.WeightBytes, want)
	}
	// 3 slots of 40 positions and the scratch row.
	if wantKV := int64(2 * m.NumLayers * (3*40 + 1) * kv * 2); mem.KVBytes != wantKV || mem.KVSlots != 3 || mem.KVPositions != 40 {
		t.Errorf("KV %d bytes, %d slots × %d positions; want %d bytes, 3 × 40", mem.KVBytes, mem.KVSlots, mem.KVPositions, wantKV)
	}
	if mem.WorkspaceBytes < cublasWorkspace {
		t.Errorf("workspace %d bytes; want at least the cuBLAS workspace", mem.WorkspaceBytes)
	}
	// The cache holds 3 sequences of 40 positions.
	ctx := context.Background()
	for id := uint64(1); id <= 3; id++ {
		if _, err := st.Forward(ctx, &stage.Batch{ID: id, Seqs: []stage.Seq{{ID: id, Tokens: make([]int32, 16)}}}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := st.Forward(ctx, &stage.Batch{ID: 9, Seqs: []stage.Seq{{ID: 4, Tokens: []int32{1}}}}); err == nil {
		t.Error("a fourth sequence fit in a 3-slot cache")
	}
	if _, err := st.Forward(ctx, &stage.Batch{ID: 10, Seqs: []stage.Seq{{ID: 1, Pos: 16, Tokens: make([]int32, 16)}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Forward(ctx, &stage.Batch{ID: 11, Seqs: []stage.Seq{{ID: 1, Pos: 32, Tokens: make([]int32, 9)}}}); err == nil {
		t.Error("a sequence grew past 40 positions")
	}
}
