package cuda

import (
	"context"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/stage"
	"github.com/tandem-llm/tandem/stage/stagetest"
)

// fourLayers is the 4-layer conformance shape with its random weights.
func fourLayers(t *testing.T, seed uint64) (stagetest.Shape, stagetest.TensorSource) {
	t.Helper()
	for _, s := range stagetest.Shapes() {
		if s.Model.NumLayers == 4 {
			return s, stagetest.RandomWeights(&s.Model, s.DType, seed)
		}
	}
	t.Fatal("no 4-layer shape in stagetest.Shapes")
	return stagetest.Shape{}, nil
}

func mustDispatcher(t *testing.T, c graphs.Config) *graphs.Dispatcher {
	t.Helper()
	d, err := graphs.NewDispatcher(c)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// memFree is the free device memory, from cuMemGetInfo.
func memFree(t *testing.T, dev *gpu.Device) int {
	t.Helper()
	var free int
	if err := dev.Do(func() error {
		var err error
		free, _, err = gpu.MemInfo()
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return free
}

// uniformDecode reports whether every sequence of b decodes one token.
func uniformDecode(b *stage.Batch) bool {
	for _, q := range b.Seqs {
		if len(q.Tokens) != 1 {
			return false
		}
	}
	return true
}

// TestGraphsMatchEager runs the same batches through an eager stage, a
// stage replaying graphs and a pipeline of two stages replaying graphs,
// with the step's mode rotating through the dispatchers of PIECEWISE, FULL
// and FULL_AND_PIECEWISE: decodes of 1 to 5 sequences (padded to 1, 2, 4
// and 8), mixed batches of prefill chunks and decodes, and a step past the
// largest key, eager on the captured stages with its products padded to
// the shapes Capture warmed (gemmwarm.go). At batch 1 (no
// padding) the logits and tokens must be identical; elsewhere the GEMMs
// run at the padded size, so the logits agree within 1e-2 relative and the
// tokens wherever the eager top-2 gap is decisive. Every step's inputs are
// the eager stage's tokens (teacher forcing), so any damage the padding did
// to another sequence's KV cache would show in later steps. Twice: on the
// suite's four-layer shape, and on a four-layer model of head dim 64, whose
// attention runs on the tensor cores (with the rotary embedding and cache
// write folded in for decode steps on the GEMM path: eager decodes and
// FULL decode graphs, padded, against the unfolded steps of prefills and
// PIECEWISE graphs).
func TestGraphsMatchEager(t *testing.T) {
	t.Run("hd16", func(t *testing.T) {
		sh, w := fourLayers(t, 31)
		testGraphsMatchEager(t, sh, w)
	})
	t.Run("hd64", func(t *testing.T) {
		var sh stagetest.Shape
		for _, s := range stagetest.Shapes() {
			if s.Model.HeadDim == 64 {
				sh = s
			}
		}
		if sh.Name == "" {
			t.Fatal("no head-dim-64 shape in stagetest.Shapes")
		}
		sh.Model.NumLayers = 4
		testGraphsMatchEager(t, sh, stagetest.RandomWeights(&sh.Model, sh.DType, 31))
	})
}

func testGraphsMatchEager(t *testing.T, sh stagetest.Shape, w stagetest.TensorSource) {
	m := sh.Model
	cfg := func(lo, hi int) Config {
		return Config{Model: &m, Lo: lo, Hi: hi, Weights: w, MaxTokens: 64, MaxSeqs: 8, MaxLogitRows: 64, MaxSeqLen: 128, GraphDebug: true}
	}
	sizes := []int{1, 2, 4, 8, 16, 32}
	ds := []*graphs.Dispatcher{
		mustDispatcher(t, graphs.Config{Mode: graphs.Piecewise, CaptureSizes: sizes, MaxNumSeqs: 8}),
		mustDispatcher(t, graphs.Config{Mode: graphs.Full, CaptureSizes: sizes, MaxNumSeqs: 8}),
		mustDispatcher(t, graphs.Config{Mode: graphs.FullAndPiecewise, CaptureSizes: sizes, MaxNumSeqs: 8}),
	}
	var keys []graphs.Step
	for _, d := range ds {
		for _, k := range d.Keys() {
			if !slices.Contains(keys, k) {
				keys = append(keys, k)
			}
		}
	}
	eager := newTestStage(t, cfg(0, 4))
	whole := newTestStage(t, cfg(0, 4))
	first, second := newTestStage(t, cfg(0, 2)), newTestStage(t, cfg(2, 4))
	for _, st := range []*Stage{whole, first, second} {
		if err := st.Capture(keys); err != nil {
			t.Fatal(err)
		}
	}
	if info := whole.Info(); info.Graphs != graphs.Always {
		t.Errorf("support %s, want ALWAYS", info.Graphs)
	}
	// A piecewise key has a graph per dense segment (layers + 1), a full
	// key one.
	wantGraphs := 0
	for _, k := range keys {
		wantGraphs++
		if k.Mode == graphs.Piecewise {
			wantGraphs += 4
		}
	}
	rep := whole.Graphs()
	if rep.Keys != len(keys) || rep.Graphs != wantGraphs {
		t.Errorf("report %d keys, %d graphs; want %d keys, %d graphs", rep.Keys, rep.Graphs, len(keys), wantGraphs)
	}
	t.Logf("captured %d keys, %d graphs, %d nodes, %d bytes, in %v", rep.Keys, rep.Graphs, rep.Nodes, rep.Bytes, rep.CaptureTime)
	ctx := context.Background()
	tables := tablesFor(eager)
	split := func(b *stage.Batch) (*stage.Output, error) {
		out, err := first.Forward(ctx, b)
		if err != nil {
			return nil, err
		}
		deviceTransfer(t, out, second)
		return second.Forward(ctx, b)
	}
	rng := rand.New(rand.NewPCG(31, 2))
	type seqState struct {
		pos    int
		prompt []int32
		next   int32
	}
	seqs := map[uint64]*seqState{}
	newSeq := func(id uint64, n int) {
		p := make([]int32, n)
		for i := range p {
			p[i] = int32(rng.IntN(m.VocabSize))
		}
		seqs[id] = &seqState{prompt: p}
	}
	// Each step lists (sequence, prefill chunk length; 0 = decode).
	type part struct {
		id    uint64
		chunk int
	}
	newSeq(1, 5)
	plan := [][]part{{{1, 5}}, {{1, 0}}, {{1, 0}}, {{1, 0}}}
	newSeq(2, 9)
	newSeq(3, 3)
	plan = append(plan, []part{{1, 0}, {2, 6}, {3, 3}}, []part{{1, 0}, {2, 3}, {3, 0}},
		[]part{{1, 0}, {2, 0}, {3, 0}}, []part{{1, 0}, {2, 0}, {3, 0}}, []part{{1, 0}, {2, 0}, {3, 0}})
	newSeq(4, 12)
	newSeq(5, 2)
	plan = append(plan, []part{{1, 0}, {4, 12}, {5, 2}, {3, 0}}, []part{{1, 0}, {2, 0}, {3, 0}, {4, 0}, {5, 0}},
		[]part{{1, 0}, {2, 0}, {3, 0}, {4, 0}, {5, 0}}, []part{{1, 0}, {2, 0}, {3, 0}, {4, 0}, {5, 0}},
		[]part{{2, 0}}, []part{{2, 0}}, []part{{2, 0}, {4, 0}})
	// Past the largest key (32 tokens) a step runs eagerly on the captured
	// stages, its products padded to the shapes Capture warmed (41 GEMM
	// rows to 64, 41 logits rows to 48), against the stage that captured
	// nothing.
	newSeq(6, 40)
	plan = append(plan, []part{{2, 0}, {6, 40}}, []part{{2, 0}, {6, 0}})
	exact, padded := 0, 0
	worst := 0.0
	for stepNo, parts := range plan {
		b := &stage.Batch{ID: uint64(stepNo + 1)}
		for _, pt := range parts {
			q := seqs[pt.id]
			toks := []int32{q.next}
			if pt.chunk > 0 {
				toks = q.prompt[q.pos : q.pos+pt.chunk]
			}
			sample := pt.chunk == 0 || q.pos+pt.chunk == len(q.prompt)
			b.Seqs = append(b.Seqs, stage.Seq{ID: pt.id, Pos: q.pos, Tokens: toks, Logits: true, Sample: sample,
				Sampling: stage.Sampling{Logprobs: 2}})
		}
		want, err := eager.Forward(ctx, fill(t, tables, b))
		if err != nil {
			t.Fatal(err)
		}
		wantLogits := copyLogits(want)
		wantSampled := slices.Clone(want.Sampled)
		d := ds[stepNo%len(ds)]
		mode, desc := d.Dispatch(b.NumTokens(), uniformDecode(b), len(b.Seqs))
		switch {
		case mode != graphs.None:
			b.Graph = graphs.Step{Mode: mode, Desc: desc}
		case b.NumTokens() <= slices.Max(sizes):
			t.Fatalf("step %d: %d tokens not dispatched to a graph", stepNo, b.NumTokens())
		default:
			b.Graph = graphs.Step{} // eager, padded
		}
		bitwise := b.NumTokens() == 1 && desc.NumTokens == 1
		for name, run := range map[string]func(*stage.Batch) (*stage.Output, error){
			"one stage":  func(b *stage.Batch) (*stage.Output, error) { return whole.Forward(ctx, b) },
			"two stages": split,
		} {
			got, err := run(b)
			if err != nil {
				t.Fatalf("step %d (%s), %s: %v", stepNo, b.Graph, name, err)
			}
			for i, sl := range got.Logits {
				for r, row := range sl.Rows {
					ref := wantLogits[i][r]
					rel := relDiff(row, ref)
					worst = max(worst, rel)
					switch {
					case bitwise && !slices.Equal(row, ref):
						t.Errorf("step %d (%s), %s: seq %d row %d differs from eager (%.3g relative); want identical at batch 1", stepNo, b.Graph, name, sl.Seq, r, rel)
					case !(rel <= 1e-2):
						t.Errorf("step %d (%s), %s: seq %d row %d differs from eager by %.3g relative", stepNo, b.Graph, name, sl.Seq, r, rel)
					}
				}
			}
			if len(got.Sampled) != len(wantSampled) {
				t.Fatalf("step %d, %s: %d sampled, eager %d", stepNo, name, len(got.Sampled), len(wantSampled))
			}
			k := 0
			for i, q := range b.Seqs {
				if !q.Sample {
					continue
				}
				g, e := got.Sampled[k], wantSampled[k]
				k++
				row := wantLogits[i][len(q.Tokens)-1]
				a, b2 := top2f(row)
				decisive := row[a]-row[b2] > 1e-2
				if (bitwise || decisive) && g.Token != e.Token {
					t.Errorf("step %d (%s), %s: seq %d sampled %d, eager %d", stepNo, b.Graph, name, q.ID, g.Token, e.Token)
				}
				if bitwise && (g.Logprob != e.Logprob || !slices.Equal(g.Top, e.Top)) {
					t.Errorf("step %d, %s: seq %d log-probabilities differ from eager at batch 1", stepNo, name, q.ID)
				}
			}
			if bitwise {
				exact++
			} else {
				padded++
			}
		}
		k := 0
		for _, q := range b.Seqs {
			seqs[q.ID].pos += len(q.Tokens)
			if q.Sample {
				seqs[q.ID].next = wantSampled[k].Token
				k++
			}
		}
	}
	t.Logf("%d runs identical to eager at batch 1, %d padded runs within tolerance (max relative logits difference %.3g)", exact, padded, worst)
}

func copyLogits(out *stage.Output) [][][]float32 {
	l := make([][][]float32, len(out.Logits))
	for i, sl := range out.Logits {
		for _, r := range sl.Rows {
			l[i] = append(l[i], slices.Clone(r))
		}
	}
	return l
}

func relDiff(got, want []float32) float64 {
	var num, den float64
	for i := range want {
		d := float64(got[i]) - float64(want[i])
		num += d * d
		den += float64(want[i]) * float64(want[i])
	}
	r := math.Sqrt(num / den)
	if math.IsNaN(r) {
		return math.Inf(1)
	}
	return r
}

// TestGraphErrors checks that a stage refuses steps it cannot replay and
// keys it cannot capture, and that the debug mode catches a buffer moved
// since capture.
func TestGraphErrors(t *testing.T) {
	sh, w := fourLayers(t, 5)
	m := sh.Model
	st := newTestStage(t, Config{Model: &m, Lo: 0, Hi: 4, Weights: w, MaxTokens: 16, MaxSeqs: 4, GraphDebug: true, GraphMemory: 64 << 20})
	if got := st.Memory().GraphBytes; got != 64<<20 {
		t.Errorf("graph bytes before capture %d, want the 64 MiB held back", got)
	}
	ctx := context.Background()
	decode := func(id uint64, pos int, g graphs.Step) *stage.Batch {
		return &stage.Batch{ID: id, Seqs: []stage.Seq{{ID: 1, Pos: pos, Tokens: []int32{3}, Blocks: []int32{2}, Sample: true}}, Graph: g}
	}
	// Before Capture no graph step runs.
	if _, err := st.Forward(ctx, decode(1, 0, decodeKey(1))); err == nil || !strings.Contains(err.Error(), "cannot replay") {
		t.Fatalf("graph step before capture: %v", err)
	}
	if err := st.Capture([]graphs.Step{mixedKey(graphs.Piecewise, 32)}); err == nil {
		t.Error("captured a key larger than the stage's max tokens")
	}
	keys := []graphs.Step{decodeKey(1), decodeKey(2), mixedKey(graphs.Piecewise, 4)}
	if err := st.Capture(keys); err != nil {
		t.Fatal(err)
	}
	if err := st.Capture(keys); err == nil || !strings.Contains(err.Error(), "already") {
		t.Errorf("second capture: %v", err)
	}
	if got, rep := st.Memory().GraphBytes, st.Graphs(); got != rep.Bytes || rep.Keys != 3 || rep.Graphs != 2+5 {
		t.Errorf("after capture: graph bytes %d, report %+v; want the report's bytes, 3 keys, 7 graphs", got, rep)
	}
	pos := 0
	for i, g := range []graphs.Step{{}, {Mode: graphs.None, Desc: graphs.BatchDescriptor{NumTokens: 1}}, decodeKey(1), decodeKey(2), mixedKey(graphs.Piecewise, 4)} {
		if _, err := st.Forward(ctx, decode(uint64(10+i), pos, g)); err != nil {
			t.Fatalf("step %q: %v", g, err)
		}
		pos++
	}
	for _, g := range []graphs.Step{
		decodeKey(4), // not captured
		mixedKey(graphs.Piecewise, 2),
		mixedKey(graphs.Full, 4),
		{Mode: graphs.None, Desc: graphs.BatchDescriptor{NumTokens: 2}}, // wrong token count
		{Mode: graphs.FullAndPiecewise, Desc: graphs.BatchDescriptor{NumTokens: 1}},
	} {
		if _, err := st.Forward(ctx, decode(30, pos, g)); err == nil {
			t.Errorf("step %q ran; want an error", g)
		} else {
			t.Logf("step %q: %v", g, err)
		}
	}
	// A batch larger than the key's graph.
	two := &stage.Batch{ID: 40, Seqs: []stage.Seq{{ID: 1, Pos: pos, Tokens: []int32{1, 2}, Blocks: []int32{2}}}, Graph: decodeKey(1)}
	if _, err := st.Forward(ctx, two); err == nil {
		t.Error("2 tokens ran in the graph of 1")
	}
	// Debug mode: a buffer moved since capture fails the replay loudly.
	kc := st.kcache
	st.kcache += 256
	_, err := st.Forward(ctx, decode(41, pos, decodeKey(1)))
	st.kcache = kc
	if err == nil || !strings.Contains(err.Error(), "K cache moved") {
		t.Fatalf("replay with a moved K cache: %v; want an error naming it", err)
	}
	if _, err := st.Forward(ctx, decode(42, pos, decodeKey(1))); err != nil {
		t.Fatalf("replay after restoring the K cache: %v", err)
	}
}

// TestGraphLongRun drives at least 2,000 requests of random prompt and
// output lengths, sampling parameters and batch compositions through a
// stage whose every step the FULL_AND_PIECEWISE dispatcher sends to a
// graph, and checks that device memory in use afterwards is what it was
// just after start-up (capture included): zero growth.
func TestGraphLongRun(t *testing.T) {
	dev := device(t)
	sh, w := fourLayers(t, 77)
	m := sh.Model
	const maxTokens, maxSeqs = 64, 8
	st := newTestStage(t, Config{Model: &m, Lo: 0, Hi: 4, Weights: w, MaxTokens: maxTokens, MaxSeqs: maxSeqs, MaxSeqLen: 80})
	d := mustDispatcher(t, graphs.Config{Mode: graphs.FullAndPiecewise, MaxCaptureSize: maxTokens, MaxNumSeqs: maxSeqs})
	if err := st.Capture(d.Keys()); err != nil {
		t.Fatal(err)
	}
	startFree := memFree(t, dev)
	tables := tablesFor(st)
	requests := 2000
	if testing.Short() {
		requests = 200
	}
	rng := rand.New(rand.NewPCG(77, 3))
	type req struct {
		id          uint64
		prompt      []int32
		pos, outLen int
		out         []int32
		sampling    stage.Sampling
	}
	var waiting, active []*req
	for i := range requests {
		r := &req{id: uint64(i + 1), prompt: make([]int32, 1+rng.IntN(48)), outLen: 1 + rng.IntN(24)}
		for j := range r.prompt {
			r.prompt[j] = int32(rng.IntN(m.VocabSize))
		}
		if rng.IntN(2) == 0 {
			r.sampling = stage.Sampling{Temperature: 0.8, TopK: rng.IntN(20), TopP: 0.9, Seed: rng.Uint64(), Logprobs: rng.IntN(3)}
		}
		waiting = append(waiting, r)
	}
	var stats graphs.Stats
	ctx := context.Background()
	done, steps := 0, 0
	for done < requests {
		for len(active) < maxSeqs && len(waiting) > 0 && rng.IntN(4) != 0 {
			active = append(active, waiting[0])
			waiting = waiting[1:]
		}
		budget := maxTokens
		if rng.IntN(3) == 0 {
			budget = 1 + rng.IntN(maxTokens)
		}
		b := &stage.Batch{ID: uint64(steps + 1)}
		for _, r := range active {
			if budget == 0 {
				break
			}
			var toks []int32
			if r.pos < len(r.prompt) {
				n := min(len(r.prompt)-r.pos, budget, 1+rng.IntN(len(r.prompt)))
				toks = r.prompt[r.pos : r.pos+n]
			} else {
				toks = r.out[len(r.out)-1:]
			}
			budget -= len(toks)
			b.Seqs = append(b.Seqs, stage.Seq{ID: r.id, Pos: r.pos, Tokens: toks, Sample: r.pos+len(toks) >= len(r.prompt),
				Sampling: r.sampling, Index: len(r.out)})
		}
		if len(b.Seqs) == 0 {
			continue
		}
		mode, desc := d.Dispatch(b.NumTokens(), uniformDecode(b), len(b.Seqs))
		if mode == graphs.None {
			t.Fatalf("step of %d tokens dispatched eagerly", b.NumTokens())
		}
		b.Graph = graphs.Step{Mode: mode, Desc: desc}
		stats.Record(b.NumTokens(), desc.NumTokens, mode)
		out, err := st.Forward(ctx, fill(t, tables, b))
		if err != nil {
			t.Fatalf("step %d (%s): %v", steps, b.Graph, err)
		}
		steps++
		byID := map[uint64]int32{}
		for _, s := range out.Sampled {
			if s.Token < 0 || int(s.Token) >= m.VocabSize || len(s.Top) > MaxLogprobs {
				t.Fatalf("step %d: sampled %+v", steps, s)
			}
			byID[s.Seq] = s.Token
		}
		kept := active[:0]
		for _, r := range active {
			for _, q := range b.Seqs {
				if q.ID == r.id {
					r.pos += len(q.Tokens)
				}
			}
			if tok, ok := byID[r.id]; ok {
				r.out = append(r.out, tok)
			}
			if len(r.out) == r.outLen {
				st.Free(r.id)
				tables.Free(r.id)
				done++
				continue
			}
			kept = append(kept, r)
		}
		active = kept
	}
	endFree := memFree(t, dev)
	counts := map[graphs.Mode]uint64{}
	for _, r := range stats.Snapshot() {
		counts[r.Mode] += r.Count
	}
	var tab strings.Builder
	if err := stats.Format(&tab); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d requests in %d steps (%d FULL, %d PIECEWISE); free device memory %d bytes after capture, %d after the run\n%s",
		requests, steps, counts[graphs.Full], counts[graphs.Piecewise], startFree, endFree, tab.String())
	if counts[graphs.Full] == 0 || counts[graphs.Piecewise] == 0 {
		t.Errorf("the workload did not exercise both graph modes: %v", counts)
	}
	if endFree != startFree {
		t.Errorf("device memory in use grew by %d bytes over the run", startFree-endFree)
	}
	writeResult(t, "graphs_long_run", map[string]any{"requests": requests, "steps": steps, "full_steps": counts[graphs.Full],
		"piecewise_steps": counts[graphs.Piecewise], "free_after_capture": startFree, "free_after_run": endFree, "growth_bytes": startFree - endFree})
}

// TestGraphsHandoff runs decodes fed by on-device hand-off (placeholders
// filled from the slot table in the embedding, inside the replayed graph)
// on one stage and on two, against a stage replaying the same graphs with
// the tokens spelled out: every logits row and sample must be identical.
// Steps rotate through the FULL, PIECEWISE and FULL_AND_PIECEWISE
// dispatchers, and batches of 3, 5 and 6 sequences replay padded graphs.
func TestGraphsHandoff(t *testing.T) {
	sh, w := fourLayers(t, 37)
	m := sh.Model
	cfg := func(lo, hi int) Config {
		return Config{Model: &m, Lo: lo, Hi: hi, Weights: w, MaxTokens: 64, MaxSeqs: 8, MaxLogitRows: 64, MaxSeqLen: 128, BlockSize: 4, GraphDebug: true}
	}
	sizes := []int{1, 2, 4, 8, 16, 32, 64}
	ds := []*graphs.Dispatcher{
		mustDispatcher(t, graphs.Config{Mode: graphs.Full, CaptureSizes: sizes, MaxNumSeqs: 8}),
		mustDispatcher(t, graphs.Config{Mode: graphs.Piecewise, CaptureSizes: sizes, MaxNumSeqs: 8}),
		mustDispatcher(t, graphs.Config{Mode: graphs.FullAndPiecewise, CaptureSizes: sizes, MaxNumSeqs: 8}),
	}
	var keys []graphs.Step
	for _, d := range ds {
		for _, k := range d.Keys() {
			if !slices.Contains(keys, k) {
				keys = append(keys, k)
			}
		}
	}
	explicit, one := newTestStage(t, cfg(0, 4)), newTestStage(t, cfg(0, 4))
	first, second := newTestStage(t, cfg(0, 2)), newTestStage(t, cfg(2, 4))
	for _, st := range []*Stage{explicit, one, first, second} {
		if err := st.Capture(keys); err != nil {
			t.Fatal(err)
		}
	}
	ctx := context.Background()
	tables := tablesFor(explicit)
	// handed runs a step with placeholders on stages and applies the
	// rows the last reports to the first.
	handed := func(b *stage.Batch, stages ...*Stage) *stage.Output {
		t.Helper()
		for i, st := range stages {
			out, err := st.Forward(ctx, b)
			if err != nil {
				t.Fatalf("batch %d (%s) with placeholders, stage %d: %v", b.ID, b.Graph, i, err)
			}
			if i+1 < len(stages) {
				deviceTransfer(t, out, stages[i+1])
				continue
			}
			deviceHandoffTransfer(t, out, stages[0])
			if err := stages[0].ApplyHandoff(ctx, out.HandoffHeader.Rows); err != nil {
				t.Fatalf("batch %d: %v", b.ID, err)
			}
			return out
		}
		panic("no stages")
	}
	rng := rand.New(rand.NewPCG(37, 4))
	const nseq = 6
	pos, index := make([]int, nseq), make([]int, nseq)
	next := make([]int32, nseq)
	prompts := make([][]int32, nseq)
	for i := range prompts {
		prompts[i] = make([]int32, 2+rng.IntN(9))
		for j := range prompts[i] {
			prompts[i][j] = int32(rng.IntN(m.VocabSize))
		}
	}
	// Which sequences each step runs: all prefill in step 0, then
	// decodes of varying subsets.
	subsets := [][]int{{0, 1, 2, 3, 4, 5}, {0, 1, 2, 3, 4, 5}, {0, 2, 4}, {1, 3, 5}, {0, 1, 2, 3, 4}, {0}, {5, 4, 3, 2, 1, 0},
		{2, 3}, {0, 1, 2, 3, 4, 5}, {0, 2, 4}, {1, 3, 5}, {1}, {0, 1, 2, 3, 4, 5}}
	replays := 0
	for step, subset := range subsets {
		b := &stage.Batch{ID: uint64(step + 1)}
		for _, i := range subset {
			toks := []int32{next[i]}
			if pos[i] == 0 {
				toks = prompts[i]
			}
			sp := stage.Sampling{Logprobs: 2}
			if i%2 == 1 {
				sp = stage.Sampling{Temperature: 0.8, TopK: 30, Seed: uint64(i), Logprobs: 1}
			}
			b.Seqs = append(b.Seqs, stage.Seq{ID: uint64(i + 1), Pos: pos[i], Tokens: toks, Slot: (i + 3) % 8,
				Sample: true, Sampling: sp, Index: index[i], Logits: true})
		}
		fill(t, tables, b)
		d := ds[step%len(ds)]
		mode, desc := d.Dispatch(b.NumTokens(), uniformDecode(b), len(b.Seqs))
		b.Graph = graphs.Step{Mode: mode, Desc: desc}
		want, err := explicit.Forward(ctx, b)
		if err != nil {
			t.Fatalf("step %d (%s): %v", step, b.Graph, err)
		}
		wantLogits, wantSampled := copyLogits(want), slices.Clone(want.Sampled)
		hb := &stage.Batch{ID: b.ID, Graph: b.Graph, Handoff: true, Seqs: slices.Clone(b.Seqs)}
		for k := range hb.Seqs {
			if hb.Seqs[k].Pos > 0 {
				hb.Seqs[k].Tokens = []int32{stage.Placeholder}
			}
		}
		for name, stages := range map[string][]*Stage{"one stage": {one}, "two stages": {first, second}} {
			got := handed(hb, stages...)
			for k, s := range got.Sampled {
				if e := wantSampled[k]; s.Token != e.Token || s.Logprob != e.Logprob || !slices.Equal(s.Top, e.Top) {
					t.Errorf("step %d (%s), %s: seq %d sampled %+v with placeholders, %+v with tokens", step, b.Graph, name, s.Seq, s, e)
				}
			}
			for k, sl := range got.Logits {
				for r, row := range sl.Rows {
					if !slices.Equal(row, wantLogits[k][r]) {
						t.Errorf("step %d (%s), %s: seq %d logits row %d differ with placeholders (%.3g relative)", step, b.Graph, name, sl.Seq, r, relDiff(row, wantLogits[k][r]))
					}
				}
			}
			if mode != graphs.None {
				replays++
			}
		}
		for k, q := range b.Seqs {
			i := q.ID - 1
			pos[i] += len(q.Tokens)
			next[i] = wantSampled[k].Token
			index[i]++
		}
	}
	t.Logf("%d steps with placeholders on one and two stages identical to the tokens spelled out (%d graph replays)", len(subsets), replays)
}

// TestGraphsLaunched launches decodes two deep on a whole-model stage, as
// a pipeline's only stage runs them (stage.Launcher): each step's
// placeholders stand for the tokens of the step launched just before it,
// still running, which the stage records on the device after it; steps
// replay FULL and PIECEWISE graphs, padded, and every sample must be that
// of the same steps run one Forward at a time with the tokens spelled out.
func TestGraphsLaunched(t *testing.T) {
	sh, w := fourLayers(t, 41)
	m := sh.Model
	cfg := Config{Model: &m, Lo: 0, Hi: 4, Weights: w, MaxTokens: 64, MaxSeqs: 8, MaxLogitRows: 64, MaxSeqLen: 128, BlockSize: 4, GraphDebug: true}
	sizes := []int{1, 2, 4, 8, 16, 32, 64}
	ds := []*graphs.Dispatcher{
		mustDispatcher(t, graphs.Config{Mode: graphs.FullAndPiecewise, CaptureSizes: sizes, MaxNumSeqs: 8}),
		mustDispatcher(t, graphs.Config{Mode: graphs.Piecewise, CaptureSizes: sizes, MaxNumSeqs: 8}),
	}
	var keys []graphs.Step
	for _, d := range ds {
		for _, k := range d.Keys() {
			if !slices.Contains(keys, k) {
				keys = append(keys, k)
			}
		}
	}
	explicit, ahead := newTestStage(t, cfg), newTestStage(t, cfg)
	for _, st := range []*Stage{explicit, ahead} {
		if err := st.Capture(keys); err != nil {
			t.Fatal(err)
		}
	}
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(41, 4))
	const nseq = 5
	prompts := make([][]int32, nseq)
	for i := range prompts {
		prompts[i] = make([]int32, 2+rng.IntN(9))
		for j := range prompts[i] {
			prompts[i][j] = int32(rng.IntN(m.VocabSize))
		}
	}
	// Every sequence prefills in step 0, then all decode in every step, a
	// few of them with logprobs or sampling.
	const steps = 16
	tables, aheadTables := tablesFor(explicit), tablesFor(ahead)
	pos, next := make([]int, nseq), make([]int32, nseq)
	var want [][]stage.Sampled
	var batches []*stage.Batch
	for step := range steps {
		b, hb := &stage.Batch{ID: uint64(step + 1)}, &stage.Batch{ID: uint64(step + 1), Handoff: true}
		for i := range nseq {
			toks, htoks := prompts[i], prompts[i]
			if pos[i] > 0 {
				toks, htoks = []int32{next[i]}, []int32{stage.Placeholder}
			}
			sp := stage.Sampling{Logprobs: i % 3}
			if i%2 == 1 {
				sp = stage.Sampling{Temperature: 0.9, TopP: 0.9, Seed: uint64(i), Logprobs: 1}
			}
			q := stage.Seq{ID: uint64(i + 1), Pos: pos[i], Tokens: toks, Slot: (i + 2) % 8, Sample: true, Sampling: sp, Index: step}
			b.Seqs = append(b.Seqs, q)
			q.Tokens = htoks
			hb.Seqs = append(hb.Seqs, q)
		}
		fill(t, tables, b)
		fill(t, aheadTables, hb)
		mode, desc := ds[step%len(ds)].Dispatch(b.NumTokens(), uniformDecode(b), len(b.Seqs))
		b.Graph = graphs.Step{Mode: mode, Desc: desc}
		hb.Graph = b.Graph
		out, err := explicit.Forward(ctx, b)
		if err != nil {
			t.Fatalf("step %d (%s): %v", step, b.Graph, err)
		}
		want = append(want, cloneSampled(out.Sampled))
		batches = append(batches, hb)
		for k, q := range b.Seqs {
			pos[k] += len(q.Tokens)
			next[k] = out.Sampled[k].Token
		}
	}
	finished := 0
	finish := func() {
		t.Helper()
		out, err := ahead.Finish(ctx)
		if err != nil {
			t.Fatalf("finish step %d: %v", finished, err)
		}
		for k, s := range out.Sampled {
			if e := want[finished][k]; s.Seq != e.Seq || s.Token != e.Token || s.Logprob != e.Logprob || !slices.Equal(s.Top, e.Top) {
				t.Errorf("step %d (%s): seq %d sampled %+v launched ahead, %+v one at a time", finished, batches[finished].Graph, s.Seq, s, e)
			}
		}
		finished++
	}
	for i, hb := range batches {
		if i-finished == stage.LaunchDepth {
			finish()
		}
		if _, err := ahead.Launch(ctx, hb); err != nil {
			t.Fatalf("launch step %d (%s): %v", i, hb.Graph, err)
		}
	}
	for finished < steps {
		finish()
	}
	t.Logf("%d steps launched %d deep with graphs, identical to the steps run one at a time", steps, stage.LaunchDepth)
}

func cloneSampled(s []stage.Sampled) []stage.Sampled {
	out := make([]stage.Sampled, len(s))
	for i, x := range s {
		x.Top = slices.Clone(x.Top)
		out[i] = x
	}
	return out
}
