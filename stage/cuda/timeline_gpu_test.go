package cuda

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/stage"
	"github.com/tandem-llm/tandem/stage/stagetest"
)

// The block timeline's records (00_common.cu, TANDEM_TIMELINE): tags and
// the most records a step keeps.
const (
	tlAttention      = 1
	tlAttentionEmpty = 2
	tlGemvf          = 10 // + gemv.cu's GEMV_* epilogue
	tlMax            = 65536
)

// blockRecord is one block's record: its kernel's tag, the multiprocessor
// it ran on, its grid's blocks and its own index; its start on the
// device's global timer and, after it, the return of its wait for the
// kernel before, its mark and its end, in ns.
type blockRecord struct {
	tag, sm, grid, block int
	start                int64
	wait, mark, end      int64
}

// resetTimeline empties the records on the stage's stream.
func resetTimeline(t *testing.T, s *Stage) {
	t.Helper()
	if err := s.dev.Do(func() error {
		f, err := s.mod.Function("tl_reset")
		if err != nil {
			return err
		}
		return f.Launch(gpu.Dim3{X: 1}, gpu.Dim3{X: 1}, 0, s.stream, new(gpu.KernelArgs))
	}); err != nil {
		t.Fatalf("reset the block timeline: %v", err)
	}
}

// readTimeline waits for the stage's stream and returns the records since
// resetTimeline.
func readTimeline(t *testing.T, s *Stage) []blockRecord {
	t.Helper()
	var recs []blockRecord
	if err := s.dev.Do(func() error {
		f, err := s.mod.Function("tl_read")
		if err != nil {
			return err
		}
		buf, err := gpu.Alloc(tlMax*32 + 16)
		if err != nil {
			return err
		}
		defer buf.Free()
		count := buf.Ptr() + tlMax*32
		if err := f.Launch(gpu.Dim3{X: 64}, gpu.Dim3{X: 256}, 0, s.stream, new(gpu.KernelArgs).Ptr(buf.Ptr()).Ptr(count)); err != nil {
			return err
		}
		if err := s.stream.Synchronize(); err != nil {
			return err
		}
		var n [1]uint32
		if err := gpu.CopyDtoH(gpu.AsBytes(n[:]), count); err != nil {
			return err
		}
		raw := make([]uint64, 4*n[0])
		if err := gpu.CopyDtoH(gpu.AsBytes(raw), buf.Ptr()); err != nil {
			return err
		}
		for i := range int(n[0]) {
			h, at := raw[4*i], raw[4*i+2]
			recs = append(recs, blockRecord{tag: int(h >> 56), sm: int(h>>48) & 0xff, grid: int(h>>24) & 0xffffff, block: int(h & 0xffffff),
				start: int64(raw[4*i+1]), wait: int64(at & 0xffffffff), mark: int64(at >> 32), end: int64(raw[4*i+3])})
		}
		return nil
	}); err != nil {
		t.Fatalf("read the block timeline: %v", err)
	}
	return recs
}

// TestStepTimeline records every block of one replayed FULL decode step of
// one token (the fp32 kernels and decode attention) with the block
// timeline, checks that the step ran as its plan says (every block of
// every kernel recorded, five kernels a layer and the LM head, in order,
// and no block past its wait before every block of the kernel before it
// had ended: dependent launches keep their order), and logs, per kernel
// of a layer, the means over the layers: its blocks, how long from its
// first block's return from the wait to its last block's end, the gap
// before it, its mark (activations staged; attention's first tile) and
// when its first block started against its wait (negative: early). Set
// TANDEM_BENCH_SHAPES (or TANDEM_BENCH_CHECKPOINT) as for TestDecodeTiming;
// `scripts/gpu-check.sh device timeline` runs it for both shapes.
func TestStepTimeline(t *testing.T) {
	models := benchModels(t)
	if len(models) == 0 {
		t.Skip("neither TANDEM_BENCH_CHECKPOINT nor TANDEM_BENCH_SHAPES is set: nothing to record")
	}
	dev := device(t)
	for _, bm := range models {
		t.Run(bm.name, func(t *testing.T) { stepTimeline(t, dev, bm) })
	}
}

// tlKernel is one kernel of the step: its records in the order their
// waits returned.
type tlKernel struct {
	name string
	rs   []blockRecord
}

func (k *tlKernel) firstWait() int64 {
	w := k.rs[0].start + k.rs[0].wait
	for _, r := range k.rs {
		w = min(w, r.start+r.wait)
	}
	return w
}

func (k *tlKernel) lastEnd() int64 {
	var e int64
	for _, r := range k.rs {
		e = max(e, r.start+r.end)
	}
	return e
}

func (k *tlKernel) firstStart() int64 {
	s := k.rs[0].start
	for _, r := range k.rs {
		s = min(s, r.start)
	}
	return s
}

// timelineStage opens a stage of the whole model bm with the block
// timeline on, for up to seqs sequences (512 tokens a step), and captures
// the FULL decode graphs of up to seqs sequences.
func timelineStage(t *testing.T, dev *gpu.Device, bm benchModel, seqs int) (*Stage, *graphs.Dispatcher, *stagetest.BlockTables) {
	t.Helper()
	cfg := bm.cfg
	st := openTestStage(t, Config{Model: cfg, Lo: 0, Hi: cfg.NumLayers, Weights: bm.weights, MaxTokens: 512, MaxSeqs: seqs,
		MaxSeqLen: 1024, MaxLogitRows: 64, Device: dev, timeline: true})
	d := mustDispatcher(t, graphs.Config{Mode: graphs.Full, MaxCaptureSize: seqs, MaxNumSeqs: seqs})
	if err := st.Capture(d.Keys()); err != nil {
		t.Fatal(err)
	}
	return st, d, tablesFor(st)
}

func stepTimeline(t *testing.T, dev *gpu.Device, bm benchModel) {
	cfg := bm.cfg
	st, d, tables := timelineStage(t, dev, bm, 8)
	ctx := context.Background()
	const prompt, steps = 100, 8
	toks := make([]int32, prompt)
	for i := range toks {
		toks[i] = int32((i*7919 + 13) % cfg.VocabSize)
	}
	out, err := st.Forward(ctx, fill(t, tables, &stage.Batch{ID: 1, Seqs: []stage.Seq{{ID: 7, Tokens: toks, Sample: true}}}))
	if err != nil {
		t.Fatal(err)
	}
	last := []int32{out.Sampled[0].Token}
	for step := range steps {
		b := decodeBatch(t, tables, uint64(step+2), []uint64{7}, last, prompt, step)
		m, desc := d.Dispatch(1, true, 1)
		if m != graphs.Full {
			t.Fatalf("dispatch of one token: %v, want a FULL graph", m)
		}
		b.Graph = graphs.Step{Mode: m, Desc: desc}
		if step == steps-1 {
			resetTimeline(t, st)
		}
		if out, err = st.Forward(ctx, b); err != nil {
			t.Fatal(err)
		}
		last[0] = out.Sampled[0].Token
	}
	recs := readTimeline(t, st)
	if len(recs) == 0 || len(recs) >= tlMax {
		t.Fatalf("%d records", len(recs))
	}
	names := tlNames
	for _, r := range recs {
		if names[r.tag] == "" || r.wait < 0 || r.wait > r.end || r.mark > r.end {
			t.Fatalf("record %+v: an unknown tag or times out of order", r)
		}
	}
	// The kernels, in the order their blocks' waits returned.
	sort.Slice(recs, func(i, j int) bool { return recs[i].start+recs[i].wait < recs[j].start+recs[j].wait })
	var ks []*tlKernel
	for _, r := range recs {
		if len(ks) == 0 || ks[len(ks)-1].name != names[r.tag] {
			ks = append(ks, &tlKernel{name: names[r.tag]})
		}
		ks[len(ks)-1].rs = append(ks[len(ks)-1].rs, r)
	}
	layer := []string{"qkv", "attention", "o", "gate_up", "down"}
	var want []string
	for range cfg.NumLayers {
		want = append(want, layer...)
	}
	want = append(want, "lm_head")
	var got []string
	for i, k := range ks {
		if k.name == "resid" { // o follows attention, down gate|up
			k.name = "down"
			if i > 0 && ks[i-1].name == "attention" {
				k.name = "o"
			}
		}
		got = append(got, k.name)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("kernels of the step, by their waits: %v\nwant %v", got, want)
	}
	for i, k := range ks {
		blocks := map[int]bool{}
		for _, r := range k.rs {
			if r.grid != k.rs[0].grid {
				t.Fatalf("kernel %d (%s): blocks of grids %d and %d", i, k.name, k.rs[0].grid, r.grid)
			}
			blocks[r.block] = true
		}
		if len(blocks) != k.rs[0].grid || len(k.rs) != k.rs[0].grid {
			t.Errorf("kernel %d (%s): %d records of %d distinct blocks, grid %d", i, k.name, len(k.rs), len(blocks), k.rs[0].grid)
		}
		if i > 0 && k.firstWait() < ks[i-1].lastEnd() {
			t.Errorf("kernel %d (%s): a block's wait returned %d ns before the last block of %s ended", i, k.name,
				ks[i-1].lastEnd()-k.firstWait(), ks[i-1].name)
		}
	}
	// Means over the layers (and the LM head alone), us.
	type mean struct{ n, gaps, blocks, waitEnd, gap, mark, start float64 }
	means := map[string]*mean{}
	for i, k := range ks {
		m := means[k.name]
		if m == nil {
			m = &mean{}
			means[k.name] = m
		}
		w := k.firstWait()
		var mark float64
		work := 0
		for _, r := range k.rs {
			if r.tag != tlAttentionEmpty {
				mark += float64(r.start + r.mark - w)
				work++
			}
		}
		m.n++
		m.blocks += float64(len(k.rs))
		m.waitEnd += float64(k.lastEnd()-w) / 1e3
		if i > 0 {
			m.gap += float64(w-ks[i-1].lastEnd()) / 1e3
			m.gaps++
		}
		m.mark += mark / float64(work) / 1e3
		m.start += float64(k.firstStart()-w) / 1e3
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "%-10s %7s %11s %11s %9s %13s\n", "kernel", "blocks", "wait->end", "gap before", "mark", "first start")
	for _, name := range append(layer, "lm_head") {
		m := means[name]
		n := m.n
		fmt.Fprintf(&sb, "%-10s %7.0f %11.2f %11.2f %9.2f %13.2f\n", name, m.blocks/n, m.waitEnd/n, m.gap/max(1, m.gaps), m.mark/n, m.start/n)
	}
	step := ks[len(ks)-1].lastEnd() - ks[0].firstStart()
	t.Logf("%s: block timeline of one FULL decode step of one token (%d records, %.1f us from the first block's start to the last's end); means over %d layers, us after the kernel's first return from its wait:\n%s",
		bm.name, len(recs), float64(step)/1e3, cfg.NumLayers, sb.String())
}

// The cuBLAS path's kernels of our own in the block timeline (00_common.cu).
const (
	tlGemvs = 20
	tlGemvg = 21
	tlNorm  = 22
	tlSilu  = 23
	tlGemvh = 24
)

// tlNames names every tag the timeline records.
var tlNames = map[int]string{tlAttention: "attention", tlAttentionEmpty: "attention", tlGemvf + 1: "lm_head",
	tlGemvf + 2: "resid", tlGemvf + 3: "gate_up", tlGemvf + 4: "qkv", tlGemvs: "gemvs", tlGemvg: "gemvg",
	tlNorm: "norm", tlSilu: "silu", tlGemvh: "gemvh"}

// tlGroup cuts records into kernels: sorted by the return of their waits
// (a dependent launch's blocks wait for the whole of the kernel before it;
// a plain launch starts after it), a record starts a new kernel when its
// name or grid differs from the current kernel's or that kernel has all
// its blocks.
func tlGroup(recs []blockRecord) []*tlKernel {
	recs = slices.Clone(recs)
	sort.SliceStable(recs, func(i, j int) bool { return recs[i].start+recs[i].wait < recs[j].start+recs[j].wait })
	var ks []*tlKernel
	for _, r := range recs {
		if n := len(ks); n == 0 || ks[n-1].name != tlNames[r.tag] || ks[n-1].rs[0].grid != r.grid || len(ks[n-1].rs) == r.grid {
			ks = append(ks, &tlKernel{name: tlNames[r.tag]})
		}
		k := ks[len(ks)-1]
		k.rs = append(k.rs, r)
	}
	return ks
}

// tlReport sums kernels ks of a step: for each kernel name, how many ran,
// their mean blocks, mean time from the first return of a wait to the
// last block's end and a block's mean time from its wait to its mark; for
// each pair of recorded kernels in a row, the mean time from the first's
// last end to the second's first wait return (where a kernel the timeline
// does not record, cuBLAS's, ran between them, that is its time and the
// launch gaps around it) and the mean number of the second's blocks that
// started before the first's last end (resident early, their prologue
// beside it); in us.
func tlReport(ks []*tlKernel) string {
	type sum struct {
		n             int
		blocks, us    float64
		first         int // order of first appearance
		name          string
		transition    bool
		transitionGap float64
		mark, early   float64
	}
	sums := map[string]*sum{}
	get := func(key string, tr bool) *sum {
		s := sums[key]
		if s == nil {
			s = &sum{first: len(sums), name: key, transition: tr}
			sums[key] = s
		}
		return s
	}
	for i, k := range ks {
		s := get(k.name, false)
		s.n++
		s.blocks += float64(len(k.rs))
		s.us += float64(k.lastEnd()-k.firstWait()) / 1e3
		var mark int64
		for _, r := range k.rs {
			mark += r.mark - r.wait
		}
		s.mark += float64(mark) / float64(len(k.rs)) / 1e3
		if i > 0 {
			g := get(ks[i-1].name+" -> "+k.name, true)
			g.n++
			end := ks[i-1].lastEnd()
			g.transitionGap += float64(k.firstWait()-end) / 1e3
			for _, r := range k.rs {
				if r.start < end {
					g.early++
				}
			}
		}
	}
	all := make([]*sum, 0, len(sums))
	for _, s := range sums {
		all = append(all, s)
	}
	sort.Slice(all, func(i, j int) bool { return all[i].first < all[j].first })
	var sb strings.Builder
	fmt.Fprintf(&sb, "%-22s %5s %8s %11s %8s %10s\n", "kernel", "runs", "blocks", "wait->end", "total", "wait->mark")
	for _, s := range all {
		if !s.transition {
			fmt.Fprintf(&sb, "%-22s %5d %8.0f %11.2f %8.1f %10.2f\n", s.name, s.n, s.blocks/float64(s.n), s.us/float64(s.n), s.us, s.mark/float64(s.n))
		}
	}
	fmt.Fprintf(&sb, "%-22s %5s %8s %11s %8s %10s\n", "between (end -> wait)", "runs", "", "gap", "total", "early")
	for _, s := range all {
		if s.transition {
			fmt.Fprintf(&sb, "%-22s %5d %8s %11.2f %8.1f %10.1f\n", s.name, s.n, "", s.transitionGap/float64(s.n), s.transitionGap, s.early/float64(s.n))
		}
	}
	return sb.String()
}

// TestBatchTimeline records one FULL decode step of each batch size in
// TANDEM_TIMELINE_BATCHES (unset: skipped; gpu-check.sh's timeline mode
// sets it, as the test compiles the program again and takes about a
// minute) on the bench shapes
// (TANDEM_BENCH_SHAPES or TANDEM_BENCH_CHECKPOINT) with the block timeline
// on, and logs tlReport: where a step of many tokens, on the cuBLAS path,
// spends its time between kernels of our own and cuBLAS's. Informational:
// it asserts only that every recorded kernel ran whole grids.
func TestBatchTimeline(t *testing.T) {
	models := benchModels(t)
	if len(models) == 0 {
		t.Skip("neither TANDEM_BENCH_CHECKPOINT nor TANDEM_BENCH_SHAPES is set: nothing to record")
	}
	v := os.Getenv("TANDEM_TIMELINE_BATCHES")
	if v == "" {
		t.Skip("TANDEM_TIMELINE_BATCHES is not set: scripts/gpu-check.sh device timeline runs this")
	}
	var batches []int
	for _, f := range strings.Split(v, ",") {
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 || n > 64 {
			t.Fatalf("TANDEM_TIMELINE_BATCHES: %q is not a batch size of 1-64", f)
		}
		batches = append(batches, n)
	}
	dev := device(t)
	for _, bm := range models {
		t.Run(bm.name, func(t *testing.T) {
			cfg := bm.cfg
			st, d, tables := timelineStage(t, dev, bm, 64)
			ctx := context.Background()
			const prompt, steps = 64, 4 // 8 prompts a prefill: MaxTokens
			next := uint64(1)
			for _, batch := range batches {
				ids, last := prefillGroups(t, []*Stage{st}, tables, &next, batch, prompt, func(j, k int) int32 {
					return int32((k*7919 + 13*j + 1) % cfg.VocabSize)
				})
				for step := range steps {
					b := decodeBatch(t, tables, next, ids, last, prompt, step)
					next++
					m, desc := d.Dispatch(batch, true, batch)
					if m != graphs.Full {
						t.Fatalf("dispatch of %d tokens: %v, want a FULL graph", batch, m)
					}
					b.Graph = graphs.Step{Mode: m, Desc: desc}
					if step == steps-1 {
						resetTimeline(t, st)
					}
					out, err := st.Forward(ctx, b)
					if err != nil {
						t.Fatal(err)
					}
					for k, s := range out.Sampled {
						last[k] = s.Token
					}
				}
				recs := readTimeline(t, st)
				if len(recs) == 0 || len(recs) >= tlMax {
					t.Fatalf("batch %d: %d records", batch, len(recs))
				}
				for _, r := range recs {
					if tlNames[r.tag] == "" || r.wait < 0 || r.wait > r.end || r.mark > r.end {
						t.Fatalf("record %+v: an unknown tag or times out of order", r)
					}
				}
				ks := tlGroup(recs)
				for i, k := range ks {
					if len(k.rs) != k.rs[0].grid {
						t.Errorf("batch %d, kernel %d (%s): %d records, grid %d", batch, i, k.name, len(k.rs), k.rs[0].grid)
					}
				}
				span := ks[len(ks)-1].lastEnd() - ks[0].firstStart()
				t.Logf("%s batch %d: block timeline of one FULL decode step (%d records, %d kernels of our own, %.1f us from the first block's start to the last's end):\n%s",
					bm.name, batch, len(recs), len(ks), float64(span)/1e3, tlReport(ks))
				for _, id := range ids {
					st.Free(id)
					tables.Free(id)
				}
			}
		})
	}
}
