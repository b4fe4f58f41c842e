package cuda

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"

	"github.com/tandem-llm/tandem/collective"
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
// closed when t ends. Unless cfg sizes the KV cache, it holds MaxSeqs
// sequences of MaxSeqLen positions (of at most 1024 when that is 0), not
// the whole device. Unless cfg says otherwise, steps of up to
// DefaultSkinnyTokens rows run on the skinny kernels (not a measured
// choice, which could differ between two stages a test compares).
func newTestStage(t *testing.T, cfg Config) *Stage {
	t.Helper()
	if cfg.SkinnyTokens == 0 {
		cfg.SkinnyTokens = DefaultSkinnyTokens
	}
	return openTestStage(t, cfg)
}

// openTestStage is newTestStage with cfg.SkinnyTokens as it is: 0 lets the
// stage measure its choice, as a served stage does.
func openTestStage(t *testing.T, cfg Config) *Stage {
	t.Helper()
	if cfg.Device == nil {
		cfg.Device = device(t)
	}
	if cfg.NumBlocks == 0 {
		n := cfg.MaxSeqLen
		if n == 0 {
			n = min(cfg.Model.MaxPositions, 1024)
		}
		cfg.NumBlocks = cfg.MaxSeqs * blocksFor(n, cmp.Or(cfg.BlockSize, stage.DefaultBlockSize))
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

// tablesFor gives hand-built batches block tables for a pipeline of
// stages, as a leader would.
func tablesFor(stages ...*Stage) *stagetest.BlockTables {
	var ss []stage.Stage
	for _, st := range stages {
		ss = append(ss, st)
	}
	return stagetest.TablesFor(ss, uint64(len(ss)))
}

// fill gives b block tables, failing t when they run out.
func fill(t *testing.T, tables *stagetest.BlockTables, b *stage.Batch) *stage.Batch {
	t.Helper()
	if err := tables.Fill(b); err != nil {
		t.Fatal(err)
	}
	return b
}

// prefillGroups prefills batch sequences of prompt tokens (token k of
// sequence j: tok(j, k)) on every stage of sts in turn, eight sequences a
// batch (batch IDs from *next on, advanced), and returns their IDs and
// each one's sampled token (the last stage's).
func prefillGroups(t *testing.T, sts []*Stage, tables *stagetest.BlockTables, next *uint64, batch, prompt int,
	tok func(j, k int) int32) (ids []uint64, last []int32) {
	t.Helper()
	ids = make([]uint64, batch)
	last = make([]int32, batch)
	for i := 0; i < batch; i += 8 {
		b := &stage.Batch{ID: *next}
		*next++
		for j := i; j < min(i+8, batch); j++ {
			ids[j] = *next*1000 + uint64(j)
			toks := make([]int32, prompt)
			for k := range toks {
				toks[k] = tok(j, k)
			}
			b.Seqs = append(b.Seqs, stage.Seq{ID: ids[j], Tokens: toks, Sample: true})
		}
		fill(t, tables, b)
		for _, st := range sts {
			out, err := st.Forward(context.Background(), b)
			if err != nil {
				t.Fatal(err)
			}
			for k, s := range out.Sampled {
				last[i+k] = s.Token
			}
		}
	}
	return ids, last
}

// deviceHandoffTransfer copies hand-off rows (device memory, or host
// memory the suite made) into the first stage's HandoffInput, skipping a
// copy onto itself, and checks the tokens of rows the stage reported
// against its samples.
func deviceHandoffTransfer(t *testing.T, out *stage.Output, first stage.Stage) {
	t.Helper()
	fs, ok := first.(*Stage)
	dst, ok2 := fs.HandoffInput().(gpu.Mem)
	if !ok || !ok2 {
		t.Fatalf("hand-off into %T of %T: want the device buffer of a CUDA stage", fs.HandoffInput(), first)
	}
	n := out.HandoffHeader.Bytes()
	rows := make([]int32, n/4)
	err := fs.dev.Do(func() error {
		switch src := out.Handoff.(type) {
		case collective.Host:
			return gpu.CopyHtoD(dst.Ptr(), src[:n])
		case gpu.Mem:
			if n == 0 {
				return nil
			}
			if err := gpu.CopyDtoH(gpu.AsBytes(rows), src.Ptr()); err != nil {
				return err
			}
			if src.Ptr() == dst.Ptr() {
				return nil
			}
			if err := gpu.CopyDtoDAsync(dst.Ptr(), src.Ptr(), n, fs.stream); err != nil {
				return err
			}
			return fs.stream.Synchronize()
		}
		return fmt.Errorf("hand-off rows in %T", out.Handoff)
	})
	if err != nil {
		t.Fatalf("copy hand-off rows: %v", err)
	}
	if _, ok := out.Handoff.(gpu.Mem); ok {
		for k, smp := range out.Sampled {
			if got := rows[k*stage.HandoffCols+1]; got != smp.Token {
				t.Errorf("batch %d: hand-off row %d holds token %d, sampled %d", out.HandoffHeader.Batch, k, got, smp.Token)
			}
		}
	}
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

// TestConformance runs the suite on each path of the stage: the skinny
// kernels for steps of up to 8 tokens (the suite's batches also exceed
// that and take the cuBLAS path), with and without dependent launches, up
// to 32 tokens (gemvt.cu past 8), and the cuBLAS path alone.
func TestConformance(t *testing.T) {
	device(t)
	for _, v := range []struct {
		name   string
		skinny int
		nodep  bool
	}{{"skinny", 0, false}, {"cublas", -1, false}, {"skinny-plain-launch", 0, true}, {"skinny-32", 32, false}} {
		t.Run(v.name, func(t *testing.T) { conformance(t, v.skinny, v.nodep) })
	}
}

func conformance(t *testing.T, skinny int, nodep bool) {
	stagetest.Run(t, stagetest.Backend{
		New: func(t *testing.T, s stagetest.Spec) stage.Stage {
			return newTestStage(t, Config{Model: s.Model, Lo: s.Lo, Hi: s.Hi, Weights: s.Weights,
				MaxTokens: s.MaxTokens, MaxSeqs: s.MaxSeqs, NumBlocks: s.KVBlocks, BlockSize: s.BlockSize,
				SkinnyTokens: skinny, NoDependentLaunch: nodep})
		},
		Transfer:        deviceTransfer,
		HandoffTransfer: deviceHandoffTransfer,
		Paged:           true,
		Handoff:         true,
		Launcher:        true,
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
	s := &Stage{dev: dev, log: slog.Default()}
	ck, err := s.compileKey(true)
	if err != nil {
		t.Fatal(err)
	}
	c := kernelCache{dir: dir}
	sh := stagetest.Shapes()[0]
	w := stagetest.RandomWeights(&sh.Model, sh.DType, 1)
	build := func() {
		st, err := New(Config{Model: &sh.Model, Lo: 0, Hi: sh.Model.NumLayers, Weights: w,
			MaxTokens: 8, MaxSeqs: 1, NumBlocks: 1, Device: dev, CacheDir: dir})
		if err != nil {
			t.Fatal(err)
		}
		out, err := st.Forward(context.Background(), &stage.Batch{ID: 1, Seqs: []stage.Seq{{ID: 1, Tokens: []int32{1, 2}, Blocks: []int32{0}, Sample: true}}})
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
	dev := device(t)
	sh := stagetest.Shapes()[0]
	m := sh.Model
	w := stagetest.RandomWeights(&m, sh.DType, 1)
	st := newTestStage(t, Config{Model: &m, Lo: 0, Hi: m.NumLayers, Weights: w, MaxTokens: 16, MaxSeqs: 2, NumBlocks: 10, BlockSize: 4, MaxSeqLen: 40})
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
	// 10 blocks of 4 positions and the scratch row.
	rowBytes := int64(2 * m.NumLayers * kv * 2)
	if wantKV := rowBytes * (10*4 + 1); mem.KVBytes != wantKV || mem.KVBlocks != 10 || mem.BlockSize != 4 {
		t.Errorf("KV %d bytes, %d blocks of %d; want %d bytes, 10 of 4", mem.KVBytes, mem.KVBlocks, mem.BlockSize, wantKV)
	}
	if info := st.Info(); info.KVBlocks != 10 || info.BlockSize != 4 {
		t.Errorf("Info reports %d blocks of %d; want 10 of 4", info.KVBlocks, info.BlockSize)
	}
	if mem.WorkspaceBytes < cublasWorkspace {
		t.Errorf("workspace %d bytes; want at least the cuBLAS workspace", mem.WorkspaceBytes)
	}
	if est, err := WorkspaceBytes(Config{Model: &m, MaxTokens: 16, MaxSeqs: 2, BlockSize: 4, MaxSeqLen: 40}); err != nil || est < mem.WorkspaceBytes {
		t.Errorf("WorkspaceBytes estimates %d bytes (%v); the stage took %d", est, err, mem.WorkspaceBytes)
	}
	// A sequence may fill 40 positions (10 blocks), not 41.
	ctx := context.Background()
	all := []int32{7, 3, 9, 0, 1, 2, 4, 5, 6, 8}
	if _, err := st.Forward(ctx, &stage.Batch{ID: 1, Seqs: []stage.Seq{{ID: 1, Tokens: make([]int32, 16), Blocks: all[:4]}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Forward(ctx, &stage.Batch{ID: 2, Seqs: []stage.Seq{{ID: 1, Pos: 16, Tokens: make([]int32, 16), Blocks: all[:8]}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Forward(ctx, &stage.Batch{ID: 3, Seqs: []stage.Seq{{ID: 1, Pos: 32, Tokens: make([]int32, 9), Blocks: append(all, 0)}}}); err == nil {
		t.Error("a sequence grew past 40 positions")
	}

	// NumBlocks 0 takes the free memory but the margin: leave this stage
	// 1 GiB for everything it allocates. Afterwards the margin is what is
	// free, give or take a block and the 2 MiB granularity of allocations.
	margin := int64(memFree(t, dev)) - 1<<30
	sized, err := New(Config{Model: &m, Lo: 0, Hi: m.NumLayers, Weights: w, MaxTokens: 16, MaxSeqs: 2, Device: dev, CacheDir: testDev.cache, KVMargin: margin})
	if err != nil {
		t.Fatal(err)
	}
	defer sized.Close()
	after := int64(memFree(t, dev))
	sm := sized.Memory()
	blockBytes := rowBytes * stage.DefaultBlockSize
	if sm.BlockSize != stage.DefaultBlockSize || sm.KVBytes != rowBytes*int64(sm.KVBlocks*sm.BlockSize+1) || after < margin-4<<20 || after > margin+blockBytes+4<<20 {
		t.Errorf("sized with a margin of %d bytes: %d blocks of %d (%d bytes), %d bytes free afterwards", margin, sm.KVBlocks, sm.BlockSize, sm.KVBytes, after)
	}
	t.Logf("KV cache sized from free memory: %d blocks of %d positions, %d bytes; %d bytes free afterwards, margin %d", sm.KVBlocks, sm.BlockSize, sm.KVBytes, after, margin)
	if _, err := New(Config{Model: &m, Lo: 0, Hi: m.NumLayers, Weights: w, MaxTokens: 16, MaxSeqs: 2, Device: dev, CacheDir: testDev.cache,
		KVMargin: int64(memFree(t, dev))}); err == nil || !strings.Contains(err.Error(), "KVMargin") {
		t.Errorf("a margin of all the free memory: %v; want an error naming Config.KVMargin", err)
	}
}
