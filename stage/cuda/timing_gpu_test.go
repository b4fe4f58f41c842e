package cuda

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/safetensors"
	"github.com/tandem-llm/tandem/stage"
	"github.com/tandem-llm/tandem/stage/stagetest"
)

// benchModel is a model TestDecodeTiming times: a checkpoint or random
// weights of a named shape.
type benchModel struct {
	name    string
	cfg     *model.Config
	weights stage.Weights
}

// benchModels are the checkpoint in TANDEM_BENCH_CHECKPOINT (named
// llama1b) and the shapes listed in TANDEM_BENCH_SHAPES (llama1b, llama8b:
// random bf16 weights made here, N(0, 0.02)-like uniform).
func benchModels(t *testing.T) []benchModel {
	var ms []benchModel
	if dir := os.Getenv("TANDEM_BENCH_CHECKPOINT"); dir != "" {
		ck, err := model.Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ck.Close() })
		ms = append(ms, benchModel{"llama1b", ck.Config(), ck})
	}
	for _, name := range strings.Split(os.Getenv("TANDEM_BENCH_SHAPES"), ",") {
		var cfg *model.Config
		switch name {
		case "":
			continue
		case "llama1b":
			cfg = llama1B()
		case "llama8b":
			cfg = llama8B()
		default:
			t.Fatalf("TANDEM_BENCH_SHAPES: unknown shape %q", name)
		}
		cfg.BOS, cfg.EOS, cfg.DType = 1, []int{2}, "bfloat16"
		ms = append(ms, benchModel{name, cfg, &randomBF16{cfg: cfg, shapes: stagetest.TensorShapes(cfg)}})
	}
	return ms
}

// randomBF16 is a checkpoint of random bf16 weights made on demand, in
// parallel: matrices uniform with standard deviation 0.02, norm weights
// near 1, biases small.
type randomBF16 struct {
	cfg    *model.Config
	shapes map[string][]int
}

func (w *randomBF16) Tensor(name string) (*safetensors.Tensor, error) {
	shape, ok := w.shapes[name]
	if !ok {
		return nil, fmt.Errorf("no tensor %s", name)
	}
	n := 1
	for _, d := range shape {
		n *= d
	}
	lo, hi := float32(-0.02*math.Sqrt(3)), float32(0.02*math.Sqrt(3))
	if len(shape) == 1 {
		lo, hi = 0.9, 1.1
		if strings.HasSuffix(name, ".bias") {
			lo, hi = -0.1, 0.1
		}
	}
	data := make([]byte, 2*n)
	const chunk = 1 << 20
	var wg sync.WaitGroup
	sem := make(chan struct{}, runtime.GOMAXPROCS(0))
	for c := 0; c < n; c += chunk {
		wg.Add(1)
		sem <- struct{}{}
		go func(c int) {
			defer wg.Done()
			defer func() { <-sem }()
			rng := rand.NewPCG(uint64(len(name)), uint64(c))
			scale := (hi - lo) * 0x1p-32
			for i := c; i < min(n, c+chunk); i++ {
				v := lo + float32(uint32(rng.Uint64()))*scale
				binary.LittleEndian.PutUint16(data[2*i:], uint16(math.Float32bits(v)>>16))
			}
		}(c)
	}
	wg.Wait()
	return &safetensors.Tensor{Name: name, DType: safetensors.BF16, Shape: shape, Data: data}, nil
}

// TestDecodeTiming times, for each benchModels model: decode steps at
// batch 1, 8 and 32 (or the batches TANDEM_BENCH_BATCHES lists, e.g.
// 1,4,8,16,24,32) in each CUDA-graph mode (NONE, PIECEWISE, FULL,
// FULL_AND_PIECEWISE), next to the HBM floor (weight bytes over the
// device-to-device copy bandwidth measured here); the per-kernel breakdown
// of one eager decode step at batch 1 and 32 on the skinny path and on the
// cuBLAS path (SkinnyTokens -1 and no dependent launches: the unfused
// kernels, as before the skinny ones); and eager prefills of 512 and 2,048
// tokens with their rate against the bf16 tensor-core peak. The stage
// captures the keys of FULL_AND_PIECEWISE for 512 tokens and 32 sequences
// (full decode graphs of 1 to 32 requests, piecewise graphs of 1 to 512
// tokens); capture time and graph memory are reported. Each batch's
// sequences prefill 64 tokens (or TANDEM_BENCH_PROMPT's), then decode 128
// steps with the mode rotating step by step, so that every mode sees the
// same context lengths;
// each figure is the median of the mode's last 24 steps: wall time of
// Forward, and device time between events around the step's work.
func TestDecodeTiming(t *testing.T) {
	models := benchModels(t)
	if len(models) == 0 {
		t.Skip("neither TANDEM_BENCH_CHECKPOINT nor TANDEM_BENCH_SHAPES is set: nothing to time")
	}
	dev := device(t)
	bw := copyBandwidth(t, dev)
	for _, bm := range models {
		t.Run(bm.name, func(t *testing.T) { timeDecode(t, dev, bw, bm) })
	}
}

// peakTFLOPS is the bf16 tensor-core rate prefill is held against: cuBLAS
// on 4096^3 on an H200 (gpu-facts.md).
const peakTFLOPS = 790

func timeDecode(t *testing.T, dev *gpu.Device, bw float64, bm benchModel) {
	cfg := bm.cfg
	const maxTokens, captureTokens, maxSeqs, maxSeqLen, steps = 2048, 512, 32, 4 * 512, 128
	// TANDEM_BENCH_PROMPT sets the decoded sequences' prompt (64 tokens
	// unless set); 192 decodes at the contexts of an API bench's last half
	// (192-320 keys).
	prompt := 64
	if v := os.Getenv("TANDEM_BENCH_PROMPT"); v != "" {
		var err error
		if prompt, err = strconv.Atoi(v); err != nil || prompt < 1 || prompt+steps > maxSeqLen {
			t.Fatalf("TANDEM_BENCH_PROMPT: %q is not a prompt of 1 to %d tokens", v, maxSeqLen-steps)
		}
	}
	// TANDEM_BENCH_COMPENSATED sets Config.CompensatedTokens.
	comp := 0
	if v := os.Getenv("TANDEM_BENCH_COMPENSATED"); v != "" {
		var err error
		if comp, err = strconv.Atoi(v); err != nil {
			t.Fatalf("TANDEM_BENCH_COMPENSATED: %v", err)
		}
	}
	loadStart := time.Now()
	st := openTestStage(t, Config{Model: cfg, Lo: 0, Hi: cfg.NumLayers, Weights: bm.weights, MaxTokens: maxTokens, MaxSeqs: maxSeqs,
		MaxSeqLen: maxSeqLen, MaxLogitRows: 256, CompensatedTokens: comp})
	loadTime := time.Since(loadStart)
	choice := st.Skinny()
	var tried []map[string]any
	for _, tr := range choice.Tried {
		t.Logf("%s: skinny kernels at %d tokens: %.3f ms, cuBLAS %.3f ms (replayed graph, device time), outputs %.2g apart", bm.name, tr.Tokens,
			float64(tr.Skinny)/1e6, float64(tr.CuBLAS)/1e6, tr.RelDiff)
		tried = append(tried, map[string]any{"tokens": tr.Tokens, "skinny_ms": float64(tr.Skinny) / 1e6, "cublas_ms": float64(tr.CuBLAS) / 1e6, "rel_diff": tr.RelDiff})
	}
	var oTried []map[string]any
	for _, tr := range choice.OTried {
		t.Logf("%s: o product on %d warps a unit: one-row pass %.3f ms (replayed graph, device time)", bm.name, tr.Splits, float64(tr.Time)/1e6)
		oTried = append(oTried, map[string]any{"splits": tr.Splits, "ms": float64(tr.Time) / 1e6})
	}
	t.Logf("%s: steps of up to %d tokens run on the skinny kernels (gemvt.cu compiled: %v); o on %d warps a unit", bm.name, st.sk.maxTokens,
		st.sk.qkv.mma.wide, choice.OSplits)
	floor := float64(st.Memory().WeightBytes) / bw
	modes := []graphs.Mode{graphs.None, graphs.Piecewise, graphs.Full, graphs.FullAndPiecewise}
	ds := map[graphs.Mode]*graphs.Dispatcher{}
	for _, m := range modes[1:] {
		ds[m] = mustDispatcher(t, graphs.Config{Mode: m, MaxCaptureSize: captureTokens, MaxNumSeqs: maxSeqs})
	}
	free0 := memFree(t, dev)
	start := time.Now()
	if err := st.Capture(ds[graphs.FullAndPiecewise].Keys()); err != nil {
		t.Fatal(err)
	}
	captureWall := time.Since(start)
	free1 := memFree(t, dev)
	rep := st.Graphs()
	var full, piecewise KeyReport
	for _, k := range rep.PerKey {
		r := &full
		if k.Step.Mode == graphs.Piecewise {
			r = &piecewise
		}
		r.Graphs += k.Graphs
		r.Nodes += k.Nodes
		r.Bytes += k.Bytes
	}
	t.Logf("%s: loaded in %v; captured %d keys (%d graphs, %d nodes) in %v (Capture's own clock %v): %d bytes (free memory %d -> %d); full decode graphs %d bytes, %d nodes; piecewise %d bytes over %d graphs",
		bm.name, loadTime, rep.Keys, rep.Graphs, rep.Nodes, captureWall, rep.CaptureTime, rep.Bytes, free0, free1, full.Bytes, full.Nodes, piecewise.Bytes, piecewise.Graphs)
	res := map[string]any{"model": bm.name, "weight_bytes": st.Memory().WeightBytes, "copy_bw_bytes_per_s": bw, "floor_ms": floor * 1e3,
		"device": dev.Info().Name, "capture_s": captureWall.Seconds(), "graph_keys": rep.Keys, "graphs": rep.Graphs,
		"graph_nodes": rep.Nodes, "graph_bytes": rep.Bytes, "full_graph_bytes": full.Bytes, "full_graphs": full.Graphs,
		"piecewise_graph_bytes": piecewise.Bytes, "piecewise_graphs": piecewise.Graphs,
		"skinny_tokens": st.sk.maxTokens, "dependent_launch": st.pdl, "gemvt": st.sk.qkv.mma.wide, "skinny_tried": tried,
		"o_splits": choice.OSplits, "o_splits_tried": oTried}
	rng := rand.New(rand.NewPCG(1, 1))
	ctx := context.Background()
	tables := tablesFor(st)
	next := uint64(1)
	newSeqs := func(n, length int) ([]uint64, *stage.Batch) {
		b := &stage.Batch{ID: next}
		next++
		ids := make([]uint64, n)
		for j := range ids {
			ids[j] = next*1000 + uint64(j)
			toks := make([]int32, length)
			for k := range toks {
				toks[k] = int32(rng.IntN(cfg.VocabSize))
			}
			b.Seqs = append(b.Seqs, stage.Seq{ID: ids[j], Tokens: toks, Sample: true})
		}
		return ids, fill(t, tables, b)
	}
	release := func(ids []uint64) {
		for _, id := range ids {
			st.Free(id)
			tables.Free(id)
		}
	}
	// Prefill, eagerly: 8 sequences of 64 tokens, 32 of 64 (the API
	// bench's 32 prompts in one step), then 4 of 512.
	layerFlops := 2 * float64(st.Memory().WeightBytes-int64(cfg.VocabSize*cfg.HiddenSize*2)) / 2 // 2 FLOP per weight per token
	if !cfg.TieEmbedding {
		layerFlops = 2 * float64(st.Memory().WeightBytes-2*int64(cfg.VocabSize*cfg.HiddenSize*2)) / 2
	}
	// Each size as the stage runs it (past CompensatedTokens rows the GEMMs
	// take the bf16 activations alone) and with every GEMM compensated;
	// then the per-kernel breakdowns of the prefills of 32 x 64 and 4 x 512.
	for _, pf := range []struct{ seqs, len int }{{8, 64}, {32, 64}, {4, 512}} {
		n := pf.seqs * pf.len
		// Attention: each token attends to its position + 1 keys (QK and PV).
		attn := float64(pf.seqs) * float64(pf.len*(pf.len+1)/2) * 4 * float64(cfg.NumHeads*cfg.HeadDim) * float64(cfg.NumLayers)
		for _, comp := range []bool{false, true} {
			saved := st.compTokens
			if comp {
				st.compTokens = -1
			}
			var times []float64
			for rep := 0; rep < 3; rep++ {
				ids, b := newSeqs(pf.seqs, pf.len)
				if _, err := st.Forward(ctx, b); err != nil {
					t.Fatal(err)
				}
				times = append(times, float64(st.LastStepTime())/1e6)
				release(ids)
			}
			st.compTokens = saved
			ms := median(times)
			tflops := (layerFlops*float64(n) + attn) / (ms / 1e3) / 1e12
			key, how := fmt.Sprintf("prefill_%d", n), fmt.Sprintf("as run (compensated up to %d rows)", st.compTokens)
			if pf.len < 512 {
				key = fmt.Sprintf("prefill_%dx%d", pf.seqs, pf.len)
			}
			if comp {
				key, how = key+"_compensated", "every GEMM compensated"
			}
			res[key+"_gpu_ms"] = ms
			res[key+"_tflops"] = tflops
			t.Logf("%s: eager prefill of %d tokens (%d x %d), %s: %.3f ms GPU, %.0f TFLOP/s (%.0f%% of %d)", bm.name, n, pf.seqs, pf.len, how, ms, tflops, 100*tflops/peakTFLOPS, peakTFLOPS)
		}
	}
	// The step the API bench's leader runs when 31 prompts arrive behind a
	// decoding sequence: that sequence's one row first, then the prompts,
	// each repetition timed (the first of a shape may differ).
	{
		var times []string
		for rep := 0; rep < 3; rep++ {
			ids, b := newSeqs(1, 64)
			if _, err := st.Forward(ctx, b); err != nil {
				t.Fatal(err)
			}
			more, mixed := newSeqs(31, 64)
			mixed.Seqs = append([]stage.Seq{{ID: ids[0], Pos: 64, Tokens: []int32{1}, Sample: true}}, mixed.Seqs...)
			if _, err := st.Forward(ctx, fill(t, tables, mixed)); err != nil {
				t.Fatal(err)
			}
			times = append(times, fmt.Sprintf("%.3f", float64(st.LastStepTime())/1e6))
			release(append(ids, more...))
		}
		t.Logf("%s: eager step of a decode row and 31 prompts of 64 tokens: %s ms GPU", bm.name, strings.Join(times, ", "))
	}
	for _, pf := range []struct {
		seqs, len int
		key       string
	}{{32, 64, "profile_prefill_32x64"}, {4, 512, "profile_prefill_2048"}} {
		ids, b := newSeqs(pf.seqs, pf.len)
		p, _, err := st.ProfileStep(ctx, b)
		if err != nil {
			t.Fatal(err)
		}
		release(ids)
		var prof strings.Builder
		res[pf.key] = profileResult(p, &prof)
		t.Logf("%s prefill of %d x %d tokens: kernels %.3f ms (step %.3f ms eager, events between kernels)\n%s", bm.name,
			pf.seqs, pf.len, float64(p.Sum)/1e6, float64(p.Step)/1e6, prof.String())
	}

	var table strings.Builder
	fmt.Fprintf(&table, "%6s %-20s %9s %9s %7s\n", "batch", "mode", "wall ms", "GPU ms", "x floor")
	var prof strings.Builder
	batches := []int{1, 8, 32}
	if v := os.Getenv("TANDEM_BENCH_BATCHES"); v != "" {
		batches = nil
		for _, f := range strings.Split(v, ",") {
			n, err := strconv.Atoi(f)
			if err != nil || n < 1 || n > maxSeqs {
				t.Fatalf("TANDEM_BENCH_BATCHES: %q is not a batch of 1 to %d", f, maxSeqs)
			}
			batches = append(batches, n)
		}
	}
	for _, batch := range batches {
		ids := make([]uint64, 0, batch)
		last := make([]int32, batch)
		for i := 0; i < batch; i += 8 {
			got, b := newSeqs(min(8, batch-i), prompt)
			ids = append(ids, got...)
			out, err := st.Forward(ctx, b)
			if err != nil {
				t.Fatal(err)
			}
			for k, s := range out.Sampled {
				last[i+k] = s.Token
			}
		}
		wall := map[graphs.Mode][]float64{}
		gpuT := map[graphs.Mode][]float64{}
		decode := func(step int) *stage.Batch {
			next++
			return decodeBatch(t, tables, next-1, ids, last, prompt, step)
		}
		for step := 0; step < steps; step++ {
			mode := modes[step%len(modes)]
			b := decode(step)
			b.Graph = graphs.Step{Mode: graphs.None, Desc: graphs.BatchDescriptor{NumTokens: batch}}
			if d := ds[mode]; d != nil {
				m, desc := d.Dispatch(batch, true, batch)
				b.Graph = graphs.Step{Mode: m, Desc: desc}
			}
			begin := time.Now()
			out, err := st.Forward(ctx, b)
			el := time.Since(begin)
			if err != nil {
				t.Fatalf("batch %d step %d (%s): %v", batch, step, b.Graph, err)
			}
			for k, s := range out.Sampled {
				last[k] = s.Token
			}
			if step >= steps-24*len(modes) {
				wall[mode] = append(wall[mode], float64(el)/1e6)
				gpuT[mode] = append(gpuT[mode], float64(st.LastStepTime())/1e6)
			}
		}
		for _, mode := range modes {
			r := map[string]float64{"wall_ms": median(wall[mode]), "gpu_ms": median(gpuT[mode])}
			res[fmt.Sprintf("batch_%d_%s", batch, mode)] = r
			fmt.Fprintf(&table, "%6d %-20s %9.3f %9.3f %7.2f\n", batch, mode, r["wall_ms"], r["gpu_ms"], r["wall_ms"]/(floor*1e3))
		}
		{
			// Per-kernel breakdown of one more decode step on each path
			// (the first profiled step of a path warms it up).
			for _, path := range []string{"cublas", "skinny"} {
				sk, pdl := st.sk.maxTokens, st.pdl
				if path == "cublas" {
					st.sk.maxTokens, st.pdl = 0, false
				} else if st.sk.qkv.mma.wide {
					// The skinny kernels' breakdown at every batch, whatever
					// the stage chose.
					st.sk.maxTokens = gemvMaxTokens
				}
				var p *StepProfile
				for k := 0; k < 2; k++ {
					step := steps + k
					if path == "skinny" {
						step += 2
					}
					var out *stage.Output
					var err error
					p, out, err = st.ProfileStep(ctx, decode(step))
					if err != nil {
						t.Fatal(err)
					}
					for j, s := range out.Sampled {
						last[j] = s.Token
					}
				}
				st.sk.maxTokens, st.pdl = sk, pdl
				key := fmt.Sprintf("profile_batch_%d_%s", batch, path)
				fmt.Fprintf(&prof, "%s batch %d, %s path: kernels %.3f ms (step %.3f ms eager, events between kernels)\n", bm.name, batch, path,
					float64(p.Sum)/1e6, float64(p.Step)/1e6)
				res[key] = profileResult(p, &prof)
			}
		}
		release(ids)
	}
	t.Logf("%s: decode step, floor %.3f ms (GEMMs compensated up to %d rows)\n%s\n%s", bm.name, floor*1e3, st.compTokens, table.String(), prof.String())
	writeResult(t, "decode_"+bm.name, res)
}

func median(v []float64) float64 {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	return s[len(s)/2]
}

// copyBandwidth measures device-to-device copy bandwidth (bytes read plus
// written per second) with a 1 GiB copy, median of 10 after 2 of warm-up.
func copyBandwidth(t *testing.T, dev *gpu.Device) float64 {
	t.Helper()
	const n = 1 << 30
	var times []float64
	err := dev.Do(func() error {
		a, err := gpu.Alloc(n)
		if err != nil {
			return err
		}
		defer a.Free()
		b, err := gpu.Alloc(n)
		if err != nil {
			return err
		}
		defer b.Free()
		s, err := gpu.NewStream()
		if err != nil {
			return err
		}
		defer s.Destroy()
		if err := gpu.MemsetD32Async(a.Ptr(), 0x3f803f80, n/4, s); err != nil {
			return err
		}
		e0, err := gpu.NewEvent()
		if err != nil {
			return err
		}
		defer e0.Destroy()
		e1, err := gpu.NewEvent()
		if err != nil {
			return err
		}
		defer e1.Destroy()
		for i := 0; i < 12; i++ {
			if err := e0.Record(s); err != nil {
				return err
			}
			if err := gpu.CopyDtoDAsync(b.Ptr(), a.Ptr(), n, s); err != nil {
				return err
			}
			if err := e1.Record(s); err != nil {
				return err
			}
			if err := e1.Synchronize(); err != nil {
				return err
			}
			d, err := gpu.Elapsed(e0, e1)
			if err != nil {
				return err
			}
			if i >= 2 {
				times = append(times, d.Seconds())
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("copy bandwidth: %v", err)
	}
	return 2 * n / median(times)
}

// profileResult writes p's kernels to table, a line each, and returns them
// for the results file.
func profileResult(p *StepProfile, table *strings.Builder) map[string]any {
	kernels := map[string]any{}
	for _, k := range p.Kernels {
		kernels[k.Label] = map[string]any{"count": k.Count, "ms": float64(k.Time) / 1e6}
		fmt.Fprintf(table, "  %-22s %4d %9.3f ms %5.1f%%\n", k.Label, k.Count, float64(k.Time)/1e6, 100*float64(k.Time)/float64(p.Sum))
	}
	return map[string]any{"sum_ms": float64(p.Sum) / 1e6, "step_ms": float64(p.Step) / 1e6, "kernels": kernels}
}

// TestSplitDecodeTiming times a decode step of 64 sequences (64-token
// contexts, FULL graphs) of each TANDEM_BENCH_SHAPES model on one stage of
// all its layers and on the two halves of a two-stage split, one GPU
// holding all three: what each stage of a two-GPU pipeline costs against
// the whole model, and the per-kernel breakdown of each (eager, events
// around each kernel), to show where a split adds time and how evenly it
// divides the step. Run by scripts/gpu-check.sh device split
// (TANDEM_BENCH_SPLIT set).
func TestSplitDecodeTiming(t *testing.T) {
	if os.Getenv("TANDEM_BENCH_SPLIT") == "" {
		t.Skip("TANDEM_BENCH_SPLIT is not set: scripts/gpu-check.sh device split runs this")
	}
	models := benchModels(t)
	if len(models) == 0 {
		t.Skip("neither TANDEM_BENCH_CHECKPOINT nor TANDEM_BENCH_SHAPES is set: nothing to time")
	}
	device(t)
	for _, bm := range models {
		t.Run(bm.name, func(t *testing.T) {
			cfg := bm.cfg
			const batch, prompt, steps = 64, 64, 40
			L := cfg.NumLayers
			open := func(lo, hi int) *Stage {
				return openTestStage(t, Config{Model: cfg, Lo: lo, Hi: hi, Weights: bm.weights, MaxTokens: 512, MaxSeqs: batch, MaxSeqLen: 256})
			}
			stages := []*Stage{open(0, L), open(0, L/2), open(L/2, L)}
			d := mustDispatcher(t, graphs.Config{Mode: graphs.Full, MaxCaptureSize: batch, MaxNumSeqs: batch})
			for _, st := range stages {
				if err := st.Capture(d.Keys()); err != nil {
					t.Fatal(err)
				}
			}
			ctx := context.Background()
			rng := rand.New(rand.NewPCG(3, 3))
			tables := tablesFor(stages[0])
			ids := make([]uint64, batch)
			last := make([]int32, batch)
			next := uint64(1)
			// forward runs b on the whole stage and on the split, the first
			// half's activations copied into the second's input.
			forward := func(b *stage.Batch, dev []time.Duration) {
				for k, st := range stages {
					out, err := st.Forward(ctx, b)
					if err != nil {
						t.Fatalf("stage %d: %v", k, err)
					}
					dev[k] += st.LastStepTime()
					switch k {
					case 0:
						for j, s := range out.Sampled {
							last[j] = s.Token
						}
					case 1:
						src, dst := out.Activations.(gpu.Mem), stages[2].Input().(gpu.Mem)
						if err := st.dev.Do(func() error {
							return gpu.CopyDtoDAsync(dst.Ptr(), src.Ptr(), out.Header.Bytes(), st.stream)
						}); err != nil {
							t.Fatal(err)
						}
					}
				}
			}
			scratch := make([]time.Duration, 3)
			for i := 0; i < batch; i += 8 {
				b := &stage.Batch{ID: next}
				next++
				for j := i; j < i+8; j++ {
					ids[j] = uint64(j + 1)
					toks := make([]int32, prompt)
					for k := range toks {
						toks[k] = int32(rng.IntN(cfg.VocabSize))
					}
					b.Seqs = append(b.Seqs, stage.Seq{ID: ids[j], Tokens: toks, Sample: true})
				}
				forward(fill(t, tables, b), scratch)
			}
			decode := func(step int) *stage.Batch {
				next++
				return decodeBatch(t, tables, next-1, ids, last, prompt, step)
			}
			sum := make([]time.Duration, 3)
			for step := 0; step < steps; step++ {
				b := decode(step)
				m, desc := d.Dispatch(batch, true, batch)
				b.Graph = graphs.Step{Mode: m, Desc: desc}
				if step < 8 {
					forward(b, scratch)
				} else {
					forward(b, sum)
				}
			}
			n := time.Duration(steps - 8)
			var prof strings.Builder
			b := decode(steps)
			for _, st := range stages {
				p, _, err := st.ProfileStep(ctx, b)
				if err != nil {
					t.Fatal(err)
				}
				fmt.Fprintf(&prof, "stage [%d,%d): kernels %.3f ms (step %.3f ms eager)\n", st.lo, st.hi, float64(p.Sum)/1e6, float64(p.Step)/1e6)
				profileResult(p, &prof)
			}
			t.Logf("%s, decode of %d sequences, FULL graphs, device ms a step: whole %.3f; halves %.3f + %.3f = %.3f (x%.3f)\n%s", bm.name, batch,
				float64(sum[0]/n)/1e6, float64(sum[1]/n)/1e6, float64(sum[2]/n)/1e6, float64((sum[1]+sum[2])/n)/1e6,
				float64(sum[1]+sum[2])/float64(sum[0]), prof.String())
		})
	}
}

// decodeBatch is batch id of decode step step after prompts of prompt
// tokens: for each sequence ids[j], the token last[j] it sampled, its
// block tables filled in.
func decodeBatch(t *testing.T, tables *stagetest.BlockTables, id uint64, ids []uint64, last []int32, prompt, step int) *stage.Batch {
	b := &stage.Batch{ID: id}
	for j := range ids {
		b.Seqs = append(b.Seqs, stage.Seq{ID: ids[j], Pos: prompt + step, Tokens: []int32{last[j]}, Sample: true, Index: step + 1})
	}
	return fill(t, tables, b)
}
