package cuda

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/stage"
)

// TestDecodeTiming times decode steps of the checkpoint in
// TANDEM_BENCH_CHECKPOINT at batch 1, 8 and 32 in each CUDA-graph mode
// (NONE, PIECEWISE, FULL, FULL_AND_PIECEWISE), next to the HBM floor
// (weight bytes over the device-to-device copy bandwidth measured here).
// The stage captures the keys of FULL_AND_PIECEWISE for 512 tokens and 32
// sequences (full decode graphs of 1 to 32 requests, piecewise graphs of 1
// to 512 tokens), which every mode's decode steps use; capture time and
// graph memory are reported. Each batch's sequences prefill 64 tokens,
// then decode 128 steps with the mode rotating step by step, so that every
// mode sees the same context lengths; each figure is the median of the
// mode's last 24 steps: wall time of Forward, and device time between
// events around the step's work (for a replayed FULL graph, the sum of its
// kernels' own time and the graph's node gaps). It also times the eager
// prefill of 512 tokens (8 sequences of 64).
func TestDecodeTiming(t *testing.T) {
	dir := os.Getenv("TANDEM_BENCH_CHECKPOINT")
	if dir == "" {
		t.Skip("TANDEM_BENCH_CHECKPOINT is not set: nothing to time")
	}
	dev := device(t)
	bw := copyBandwidth(t, dev)
	ck, err := model.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	cfg := ck.Config()
	const maxTokens, maxSeqs, prompt, steps = 512, 32, 64, 128
	st := newTestStage(t, Config{Model: cfg, Lo: 0, Hi: cfg.NumLayers, Weights: ck, MaxTokens: maxTokens, MaxSeqs: maxSeqs, MaxSeqLen: prompt + steps + 8})
	floor := float64(st.Memory().WeightBytes) / bw
	modes := []graphs.Mode{graphs.None, graphs.Piecewise, graphs.Full, graphs.FullAndPiecewise}
	ds := map[graphs.Mode]*graphs.Dispatcher{}
	for _, m := range modes[1:] {
		ds[m] = mustDispatcher(t, graphs.Config{Mode: m, MaxCaptureSize: maxTokens, MaxNumSeqs: maxSeqs})
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
	t.Logf("captured %d keys (%d graphs, %d nodes) in %v (Capture's own clock %v): %d bytes (free memory %d -> %d); full decode graphs %d bytes, %d nodes; piecewise %d bytes over %d graphs",
		rep.Keys, rep.Graphs, rep.Nodes, captureWall, rep.CaptureTime, rep.Bytes, free0, free1, full.Bytes, full.Nodes, piecewise.Bytes, piecewise.Graphs)
	res := map[string]any{"weight_bytes": st.Memory().WeightBytes, "copy_bw_bytes_per_s": bw, "floor_ms": floor * 1e3,
		"device": dev.Info().Name, "capture_s": captureWall.Seconds(), "graph_keys": rep.Keys, "graphs": rep.Graphs,
		"graph_nodes": rep.Nodes, "graph_bytes": rep.Bytes, "full_graph_bytes": full.Bytes, "full_graphs": full.Graphs,
		"piecewise_graph_bytes": piecewise.Bytes, "piecewise_graphs": piecewise.Graphs}
	rng := rand.New(rand.NewPCG(1, 1))
	ctx := context.Background()
	tables := tablesFor(st)
	next := uint64(1)
	var prefill []float64
	var table strings.Builder
	fmt.Fprintf(&table, "%6s %-20s %9s %9s %7s\n", "batch", "mode", "wall ms", "GPU ms", "x floor")
	for _, batch := range []int{1, 8, 32} {
		ids := make([]uint64, batch)
		last := make([]int32, batch)
		for i := 0; i < batch; i += 8 {
			b := &stage.Batch{ID: next}
			next++
			for j := i; j < min(batch, i+8); j++ {
				ids[j] = next*100 + uint64(j)
				toks := make([]int32, prompt)
				for k := range toks {
					toks[k] = int32(rng.IntN(cfg.VocabSize))
				}
				b.Seqs = append(b.Seqs, stage.Seq{ID: ids[j], Tokens: toks, Sample: true})
			}
			out, err := st.Forward(ctx, fill(t, tables, b))
			if err != nil {
				t.Fatal(err)
			}
			if b.NumTokens() == 8*prompt {
				prefill = append(prefill, float64(st.LastStepTime())/1e6)
			}
			for k, s := range out.Sampled {
				last[i+k] = s.Token
			}
		}
		wall := map[graphs.Mode][]float64{}
		gpuT := map[graphs.Mode][]float64{}
		for step := 0; step < steps; step++ {
			mode := modes[step%len(modes)]
			b := &stage.Batch{ID: next}
			next++
			for j := range ids {
				b.Seqs = append(b.Seqs, stage.Seq{ID: ids[j], Pos: prompt + step, Tokens: []int32{last[j]}, Sample: true, Index: step + 1})
			}
			b.Graph = graphs.Step{Mode: graphs.None, Desc: graphs.BatchDescriptor{NumTokens: batch}}
			if d := ds[mode]; d != nil {
				m, desc := d.Dispatch(batch, true, batch)
				b.Graph = graphs.Step{Mode: m, Desc: desc}
			}
			fill(t, tables, b)
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
		for _, id := range ids {
			st.Free(id)
			tables.Free(id)
		}
		for _, mode := range modes {
			r := map[string]float64{"wall_ms": median(wall[mode]), "gpu_ms": median(gpuT[mode])}
			res[fmt.Sprintf("batch_%d_%s", batch, mode)] = r
			fmt.Fprintf(&table, "%6d %-20s %9.3f %9.3f %7.2f\n", batch, mode, r["wall_ms"], r["gpu_ms"], r["wall_ms"]/(floor*1e3))
		}
	}
	res["prefill_512_gpu_ms"] = median(prefill)
	t.Logf("decode step, floor %.3f ms; eager prefill of 512 tokens %.3f ms GPU\n%s", floor*1e3, median(prefill), table.String())
	writeResult(t, "decode", res)
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
