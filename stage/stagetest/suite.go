package stagetest

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/stage"
)

// Backend is what a backend under test provides to Run.
type Backend struct {
	// New builds a stage for s, failing t if it cannot, and arranges for
	// it to be closed when t ends.
	New func(t *testing.T, s Spec) stage.Stage
	// Transfer copies the activations of out into next.Input(). Nil copies
	// bytes between collective.Host buffers.
	Transfer func(t *testing.T, out *stage.Output, next stage.Stage)
	// Tol bounds the relative error ‖a−b‖/‖b‖ of every logits row against
	// the float64 reference, and between chunked and whole prefill.
	Tol float64
	// SplitTol bounds the relative error between the logits of a model split
	// over several stages and the same model on one stage.
	SplitTol float64
	// Paged says the backend keeps a paged KV cache addressed through
	// Seq.Blocks, sized by Spec.KVBlocks and Spec.BlockSize and reported in
	// Info; Run then checks it too.
	Paged bool
	// Handoff says the backend implements on-device hand-off: its first
	// stage is a stage.HandoffReceiver and its last fills Output.Handoff
	// when Batch.Handoff is set; Run then checks it too.
	Handoff bool
	// HandoffTransfer copies the hand-off rows of out (Output.Handoff, of
	// out.HandoffHeader) into first's HandoffInput; the source may also be
	// a collective.Host buffer the suite made. Nil copies bytes between
	// collective.Host buffers.
	HandoffTransfer func(t *testing.T, out *stage.Output, first stage.Stage)
	// Launcher says the backend's stages are stage.Launchers (with
	// Handoff): Run then checks a whole-model stage launching each step
	// while the one before it runs.
	Launcher bool
}

// Spec is the stage a test asks the backend for.
type Spec struct {
	Model              *model.Config
	Weights            Weights
	Lo, Hi             int
	MaxTokens, MaxSeqs int
	// KVBlocks and BlockSize size a paged KV cache (0: the backend's
	// defaults); backends without one ignore them.
	KVBlocks, BlockSize int
}

// Run runs the conformance suite against a backend.
func Run(t *testing.T, b Backend) {
	if b.Transfer == nil {
		b.Transfer = hostTransfer
	}
	for i, sh := range Shapes() {
		t.Run("reference/"+sh.Name, func(t *testing.T) { testReference(t, b, sh, uint64(i)) })
	}
	t.Run("split", func(t *testing.T) { testSplit(t, b) })
	t.Run("validation", func(t *testing.T) { testValidation(t, b) })
	t.Run("free", func(t *testing.T) { testFree(t, b) })
	t.Run("reset", func(t *testing.T) { testReset(t, b) })
	t.Run("info", func(t *testing.T) { testInfo(t, b) })
	t.Run("close", func(t *testing.T) { testClose(t, b) })
	t.Run("nonfinite", func(t *testing.T) { testNonFinite(t, b) })
	if b.Paged {
		t.Run("paged", func(t *testing.T) { testPaged(t, b) })
	}
	if b.Handoff {
		t.Run("handoff", func(t *testing.T) { testHandoff(t, b) })
	}
	if b.Launcher {
		t.Run("launch", func(t *testing.T) { testLaunch(t, b) })
	}
}

// whole prefills every prompt in the first batch and decodes in lock step;
// chunked prefills in chunks of 7 within 24-token batches, starting a
// request every other batch, so prefill chunks mix with other sequences'
// decodes.
var (
	whole   = schedule{name: "whole", chunk: math.MaxInt32, budget: 256, maxSeqs: 8}
	chunked = schedule{name: "chunked", chunk: 7, budget: 24, stagger: 2, maxSeqs: 8}
)

func testReference(t *testing.T, b Backend, sh Shape, seed uint64) {
	m := sh.Model
	w := RandomWeights(&m, sh.DType, seed)
	ref, err := NewReference(&m, w)
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(seed, 1))
	lengths := []int{1, 9, 23, 40}
	if m.RopeScaling != nil {
		// well past original_max_position_embeddings
		lengths = append(lengths, 150)
	}
	var reqs []request
	for i, n := range lengths {
		reqs = append(reqs, request{
			id:       uint64(100 + i),
			prompt:   randomTokens(rng, n, m.VocabSize),
			forced:   randomTokens(rng, 6, m.VocabSize),
			gen:      6,
			logits:   i%2 == 0,
			sampling: stage.Sampling{Logprobs: 3 * (i % 2)},
		})
	}
	// Block sizes of 1 and 3 make every sequence span many blocks.
	spec := Spec{Model: &m, Weights: w, Lo: 0, Hi: m.NumLayers, MaxTokens: 256, MaxSeqs: 8, BlockSize: []int{0, 1, 3, 16}[seed%4]}
	runs := map[string]map[uint64]*result{}
	for _, sch := range []schedule{whole, chunked} {
		p := newPipeline(b.Transfer, b.New(t, spec))
		res := drive(t, p, reqs, sch)
		runs[sch.name] = res
		worst := 0.0
		for _, r := range reqs {
			worst = max(worst, checkAgainstReference(t, sch.name, ref, r, res[r.id], b.Tol))
		}
		t.Logf("%s prefill: max relative logits error against the reference %.3g", sch.name, worst)
	}
	worst := 0.0
	for _, r := range reqs {
		a, c := runs[whole.name][r.id], runs[chunked.name][r.id]
		for p := range a.logits {
			e := RelErr(c.logits[p], float64s(a.logits[p]))
			if !(e <= b.Tol) {
				t.Errorf("seq %d position %d: chunked prefill logits differ from whole prefill by %.3g (relative)", r.id, p, e)
			}
			worst = max(worst, e)
		}
	}
	t.Logf("chunked against whole prefill: max relative logits error %.3g", worst)
}

// checkAgainstReference compares a request's logits and samples with the
// reference and returns the largest relative logits error.
func checkAgainstReference(t *testing.T, sched string, ref *Reference, r request, res *result, tol float64) float64 {
	t.Helper()
	want := append(append([]int32(nil), r.prompt...), r.forced...)[:len(r.prompt)+r.gen]
	if fmt.Sprint(res.tokens) != fmt.Sprint(want) {
		t.Fatalf("%s: seq %d: fed tokens %v, want %v", sched, r.id, res.tokens, want)
	}
	refLogits := ref.Logits(res.tokens)
	worst := 0.0
	if r.logits {
		if len(res.logits) != len(refLogits) {
			t.Fatalf("%s: seq %d: %d logits rows, want %d", sched, r.id, len(res.logits), len(refLogits))
		}
		for p, row := range res.logits {
			e := RelErr(row, refLogits[p])
			if !(e <= tol) {
				t.Errorf("%s: seq %d position %d: relative logits error %.3g against the reference, above %.3g", sched, r.id, p, e, tol)
			}
			worst = max(worst, e)
		}
	}
	if len(res.sampled) != r.gen+1 {
		t.Fatalf("%s: seq %d: %d samples, want %d", sched, r.id, len(res.sampled), r.gen+1)
	}
	for k, smp := range res.sampled {
		row := refLogits[res.samplePos[k]]
		// ‖Δlogits‖∞ ≤ tol·‖row‖ bounds every log-probability's error by twice that.
		bound := 2*tol*norm(row) + 1e-6
		lp := LogSoftmax(row)
		if d := math.Abs(float64(smp.Logprob) - lp[smp.Token]); !(d <= bound*(1+math.Abs(lp[smp.Token]))) {
			t.Errorf("%s: seq %d sample %d: logprob %v, reference %v", sched, r.id, k, smp.Logprob, lp[smp.Token])
		}
		best, second := top2(row)
		if row[best]-row[second] > 2*bound && int(smp.Token) != best {
			t.Errorf("%s: seq %d sample %d: greedy token %d, reference arg-max %d (margin %.3g)", sched, r.id, k, smp.Token, best, row[best]-row[second])
		}
	}
	return worst
}

func testSplit(t *testing.T, b Backend) {
	var sh Shape
	for _, s := range Shapes() {
		if s.Model.NumLayers == 4 {
			sh = s
		}
	}
	m := sh.Model
	w := RandomWeights(&m, sh.DType, 99)
	rng := rand.New(rand.NewPCG(99, 2))
	var reqs []request
	for i, n := range []int{5, 12, 30} {
		reqs = append(reqs, request{
			id:     uint64(200 + i),
			prompt: randomTokens(rng, n, m.VocabSize),
			gen:    8,
			logits: true,
		})
	}
	build := func(bounds []int) *pipeline {
		var stages []stage.Stage
		for i := range len(bounds) - 1 {
			spec := Spec{Model: &m, Weights: w, Lo: bounds[i], Hi: bounds[i+1], MaxTokens: 64, MaxSeqs: 8, BlockSize: 4}
			stages = append(stages, b.New(t, spec))
		}
		return newPipeline(b.Transfer, stages...)
	}
	single := drive(t, build([]int{0, 4}), reqs, chunked)
	for _, bounds := range [][]int{{0, 2, 4}, {0, 1, 3, 4}, {0, 1, 2, 3, 4}} {
		res := drive(t, build(bounds), reqs, chunked)
		worst := 0.0
		for _, r := range reqs {
			a, c := single[r.id], res[r.id]
			if fmt.Sprint(a.tokens) != fmt.Sprint(c.tokens) {
				t.Fatalf("split %v: seq %d greedy tokens %v, one stage gives %v", bounds, r.id, c.tokens, a.tokens)
			}
			for p := range a.logits {
				e := RelErr(c.logits[p], float64s(a.logits[p]))
				if !(e <= b.SplitTol) {
					t.Errorf("split %v: seq %d position %d: relative logits difference %.3g from one stage, above %.3g", bounds, r.id, p, e, b.SplitTol)
				}
				worst = max(worst, e)
			}
		}
		t.Logf("split %v: max relative logits difference from one stage %.3g", bounds, worst)
	}
}

// testValidation sends malformed batches, each also carrying a valid chunk,
// and checks that each is refused with an error naming the sequence at
// fault and that no cache moved: afterwards the valid continuation is still
// accepted and matches the reference.
func testValidation(t *testing.T, b Backend) {
	sh := Shapes()[1]
	m := sh.Model
	m.MaxPositions = 20
	w := RandomWeights(&m, sh.DType, 7)
	ref, err := NewReference(&m, w)
	if err != nil {
		t.Fatal(err)
	}
	st := b.New(t, Spec{Model: &m, Weights: w, Lo: 0, Hi: m.NumLayers, MaxTokens: 16, MaxSeqs: 3})
	p := newPipeline(b.Transfer, st)
	const a, c, d = 1001, 2002, 3003
	rng := rand.New(rand.NewPCG(7, 3))
	promptA := randomTokens(rng, 8, m.VocabSize)
	promptC := randomTokens(rng, 4, m.VocabSize)
	ctx := context.Background()
	if _, err := p.forward(ctx, t, &stage.Batch{ID: 1, Seqs: []stage.Seq{{ID: a, Tokens: promptA[:5]}}}); err != nil {
		t.Fatal(err)
	}
	contA := stage.Seq{ID: a, Pos: 5, Tokens: promptA[5:6]}
	newC := func(mod func(*stage.Seq)) stage.Seq {
		q := stage.Seq{ID: c, Tokens: promptC}
		mod(&q)
		return q
	}
	sampling := func(s stage.Sampling) func(*stage.Seq) {
		return func(q *stage.Seq) { q.Sample, q.Sampling = true, s }
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	cases := []struct {
		name  string
		ctx   context.Context
		seqs  []stage.Seq
		culpr uint64 // the sequence the error must name (0: none)
	}{
		{"no sequences", ctx, nil, 0},
		{"too many sequences", ctx, []stage.Seq{contA, newC(func(*stage.Seq) {}), {ID: d, Tokens: promptC[:1]}, {ID: 4004, Tokens: promptC[:1]}}, 0},
		{"too many tokens", ctx, []stage.Seq{contA, newC(func(q *stage.Seq) { q.Tokens = randomTokens(rng, 16, m.VocabSize) })}, 0},
		{"gap on a new sequence", ctx, []stage.Seq{contA, newC(func(q *stage.Seq) { q.Pos = 2 })}, c},
		{"gap", ctx, []stage.Seq{{ID: a, Pos: 6, Tokens: promptA[6:7]}, newC(func(*stage.Seq) {})}, a},
		{"overlap", ctx, []stage.Seq{{ID: a, Pos: 4, Tokens: promptA[4:6]}, newC(func(*stage.Seq) {})}, a},
		{"past max positions", ctx, []stage.Seq{{ID: a, Pos: 5, Tokens: randomTokens(rng, 16, m.VocabSize)}}, a},
		{"negative token", ctx, []stage.Seq{contA, newC(func(q *stage.Seq) { q.Tokens = []int32{3, -2} })}, c},
		{"token past vocab", ctx, []stage.Seq{contA, newC(func(q *stage.Seq) { q.Tokens = []int32{int32(m.VocabSize)} })}, c},
		{"empty chunk", ctx, []stage.Seq{contA, newC(func(q *stage.Seq) { q.Tokens = nil })}, c},
		{"duplicate sequence", ctx, []stage.Seq{contA, {ID: a, Pos: 5, Tokens: promptA[5:6]}}, a},
		{"negative temperature", ctx, []stage.Seq{contA, newC(sampling(stage.Sampling{Temperature: -1}))}, c},
		{"NaN temperature", ctx, []stage.Seq{contA, newC(sampling(stage.Sampling{Temperature: float32(math.NaN())}))}, c},
		{"negative top-k", ctx, []stage.Seq{contA, newC(sampling(stage.Sampling{Temperature: 1, TopK: -1}))}, c},
		{"top-p above 1", ctx, []stage.Seq{contA, newC(sampling(stage.Sampling{Temperature: 1, TopP: 1.5}))}, c},
		{"negative logprobs", ctx, []stage.Seq{contA, newC(sampling(stage.Sampling{Logprobs: -1}))}, c},
		{"logprobs past vocab", ctx, []stage.Seq{contA, newC(sampling(stage.Sampling{Logprobs: m.VocabSize + 1}))}, c},
		{"cancelled context", cancelled, []stage.Seq{contA, newC(func(*stage.Seq) {})}, 0},
	}
	for i, tc := range cases {
		_, err := p.forward(tc.ctx, t, &stage.Batch{ID: uint64(10 + i), Seqs: tc.seqs})
		switch {
		case err == nil:
			t.Errorf("%s: batch accepted", tc.name)
		case tc.ctx.Err() != nil && !errors.Is(err, context.Canceled):
			t.Errorf("%s: error %q does not wrap context.Canceled", tc.name, err)
		case tc.culpr != 0 && !strings.Contains(err.Error(), fmt.Sprint(tc.culpr)):
			t.Errorf("%s: error %q does not name seq %d", tc.name, err, tc.culpr)
		}
	}
	// Conformance stages capture no CUDA graphs, so a step dispatched to
	// one is refused (never run eagerly), as is an eager step whose token
	// count is not the batch's. Each batch would fit its key.
	for i, tc := range []struct {
		step graphs.Step
		seqs []stage.Seq
	}{
		{graphs.Step{Mode: graphs.Full, Desc: graphs.BatchDescriptor{NumTokens: 2, NumReqs: 2, UniformDecode: true, QueryLen: 1}}, []stage.Seq{contA, {ID: c, Tokens: promptC[:1]}}},
		{graphs.Step{Mode: graphs.Piecewise, Desc: graphs.BatchDescriptor{NumTokens: 8}}, []stage.Seq{contA, newC(func(*stage.Seq) {})}},
		{graphs.Step{Mode: graphs.None, Desc: graphs.BatchDescriptor{NumTokens: 9}}, []stage.Seq{contA, newC(func(*stage.Seq) {})}},
	} {
		if _, err := p.forward(ctx, t, &stage.Batch{ID: uint64(50 + i), Seqs: tc.seqs, Graph: tc.step}); err == nil {
			t.Errorf("step %s accepted by a stage that captured no graphs", tc.step)
		}
	}
	// Nothing moved: A continues at 5, C starts at 0, and both match the
	// reference.
	out, err := p.forward(ctx, t, &stage.Batch{ID: 99, Seqs: []stage.Seq{
		{ID: a, Pos: 5, Tokens: promptA[5:], Logits: true},
		{ID: c, Tokens: promptC, Logits: true},
	}})
	if err != nil {
		t.Fatalf("valid batch after the refused ones: %v", err)
	}
	checkRows(t, "seq A after refused batches", out.Logits[0].Rows, ref.Logits(promptA)[5:], b.Tol)
	checkRows(t, "seq C after refused batches", out.Logits[1].Rows, ref.Logits(promptC), b.Tol)
}

// testFree checks that Free forgets one sequence and only that one.
func testFree(t *testing.T, b Backend) {
	sh := Shapes()[0]
	m := sh.Model
	w := RandomWeights(&m, sh.DType, 11)
	ref, err := NewReference(&m, w)
	if err != nil {
		t.Fatal(err)
	}
	st := b.New(t, Spec{Model: &m, Weights: w, Lo: 0, Hi: m.NumLayers, MaxTokens: 32, MaxSeqs: 4})
	p := newPipeline(b.Transfer, st)
	rng := rand.New(rand.NewPCG(11, 4))
	p1, p2, p3 := randomTokens(rng, 6, m.VocabSize), randomTokens(rng, 9, m.VocabSize), randomTokens(rng, 10, m.VocabSize)
	ctx := context.Background()
	if _, err := p.forward(ctx, t, &stage.Batch{ID: 1, Seqs: []stage.Seq{{ID: 1, Tokens: p1}, {ID: 2, Tokens: p3[:5]}}}); err != nil {
		t.Fatal(err)
	}
	st.Free(1)
	st.Free(12345) // unknown: no effect
	if _, err := p.forward(ctx, t, &stage.Batch{ID: 2, Seqs: []stage.Seq{{ID: 1, Pos: len(p1), Tokens: p2[:1]}}}); err == nil {
		t.Errorf("a freed sequence continued at position %d", len(p1))
	}
	out, err := p.forward(ctx, t, &stage.Batch{ID: 3, Seqs: []stage.Seq{
		{ID: 1, Tokens: p2, Logits: true},
		{ID: 2, Pos: 5, Tokens: p3[5:], Logits: true},
	}})
	if err != nil {
		t.Fatalf("restarting a freed sequence: %v", err)
	}
	checkRows(t, "freed and restarted sequence", out.Logits[0].Rows, ref.Logits(p2), b.Tol)
	checkRows(t, "sequence next to a freed one", out.Logits[1].Rows, ref.Logits(p3)[5:], b.Tol)
}

// testInfo checks Info and Input of a first, a middle and a last stage.
func testInfo(t *testing.T, b Backend) {
	sh := Shapes()[len(Shapes())-1]
	m := sh.Model
	w := RandomWeights(&m, sh.DType, 13)
	for _, r := range [][2]int{{0, 1}, {1, 3}, {3, 4}, {0, 4}} {
		spec := Spec{Model: &m, Weights: w, Lo: r[0], Hi: r[1], MaxTokens: 48, MaxSeqs: 5, KVBlocks: 10, BlockSize: 4}
		st := b.New(t, spec)
		info := st.Info()
		if b.Paged && (info.KVBlocks != spec.KVBlocks || info.BlockSize != spec.BlockSize) {
			t.Errorf("stage [%d,%d): Info reports %d KV blocks of %d positions, want %d of %d", r[0], r[1], info.KVBlocks, info.BlockSize, spec.KVBlocks, spec.BlockSize)
		}
		if info.Backend == "" || info.Lo != r[0] || info.Hi != r[1] || info.First != (r[0] == 0) || info.Last != (r[1] == 4) ||
			info.Hidden != m.HiddenSize || info.Vocab != m.VocabSize || info.MaxTokens != 48 || info.MaxSeqs != 5 || info.ActDType.Size() == 0 {
			t.Errorf("stage [%d,%d): Info %+v does not describe the spec", r[0], r[1], info)
		}
		in := st.Input()
		switch {
		case info.First && in != nil:
			t.Errorf("first stage [%d,%d): Input %v, want nil", r[0], r[1], in)
		case !info.First && (in == nil || in.Len() < 48*m.HiddenSize*info.ActDType.Size()):
			t.Errorf("stage [%d,%d): Input %v cannot hold %d rows of %d %s values", r[0], r[1], in, 48, m.HiddenSize, info.ActDType)
		}
	}
}

// testClose checks that a closed stage refuses to run.
func testClose(t *testing.T, b Backend) {
	sh := Shapes()[0]
	m := sh.Model
	st := b.New(t, Spec{Model: &m, Weights: RandomWeights(&m, sh.DType, 17), Lo: 0, Hi: m.NumLayers, MaxTokens: 8, MaxSeqs: 2})
	if err := st.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if _, err := st.Forward(context.Background(), &stage.Batch{ID: 1, Seqs: []stage.Seq{{ID: 1, Tokens: []int32{1}}}}); err == nil {
		t.Error("Forward after Close succeeded")
	}
}

// testPaged checks a paged KV cache: bad block tables are refused, naming
// the sequence, and move nothing; tables of scattered blocks give the
// reference's logits; a capacity of exactly the blocks in use suffices; and
// the blocks of a freed sequence serve another.
func testPaged(t *testing.T, b Backend) {
	sh := Shapes()[0]
	m := sh.Model
	w := RandomWeights(&m, sh.DType, 19)
	ref, err := NewReference(&m, w)
	if err != nil {
		t.Fatal(err)
	}
	const blockSize, blocks = 3, 8
	st := b.New(t, Spec{Model: &m, Weights: w, Lo: 0, Hi: m.NumLayers, MaxTokens: 32, MaxSeqs: 4, KVBlocks: blocks, BlockSize: blockSize})
	tables := NewBlockTables(blocks, blockSize, 19)
	rng := rand.New(rand.NewPCG(19, 6))
	promptA, promptB, promptC := randomTokens(rng, 10, m.VocabSize), randomTokens(rng, 14, m.VocabSize), randomTokens(rng, 7, m.VocabSize)
	ctx := context.Background()
	forward := func(b *stage.Batch) *stage.Output {
		t.Helper()
		if err := tables.Fill(b); err != nil {
			t.Fatal(err)
		}
		out, err := st.Forward(ctx, b)
		if err != nil {
			t.Fatalf("batch %d: %v", b.ID, err)
		}
		return out
	}
	forward(&stage.Batch{ID: 1, Seqs: []stage.Seq{{ID: 1, Tokens: promptA[:5]}}})
	// A continues to 10 positions (4 blocks), B starts with 12 (4 blocks):
	// every block is in use.
	good := stage.Batch{ID: 2, Seqs: []stage.Seq{
		{ID: 1, Pos: 5, Tokens: promptA[5:], Logits: true},
		{ID: 2, Tokens: promptB[:12], Logits: true},
	}}
	if err := tables.Fill(&good); err != nil {
		t.Fatal(err)
	}
	tableA, tableB := good.Seqs[0].Blocks, good.Seqs[1].Blocks
	for _, tc := range []struct {
		name   string
		a, b   []int32
		culprt uint64
	}{
		{"table too short", tableA[:3], tableB, 1},
		{"no table", tableA, nil, 2},
		{"block id past the capacity", tableA, []int32{tableB[0], tableB[1], blocks, tableB[3]}, 2},
		{"negative block id", []int32{tableA[0], -1, tableA[2], tableA[3]}, tableB, 1},
	} {
		bad := stage.Batch{ID: 3, Seqs: slices.Clone(good.Seqs)}
		bad.Seqs[0].Blocks, bad.Seqs[1].Blocks = tc.a, tc.b
		_, err := st.Forward(ctx, &bad)
		switch {
		case err == nil:
			t.Errorf("%s: batch accepted", tc.name)
		case !strings.Contains(err.Error(), fmt.Sprint(tc.culprt)):
			t.Errorf("%s: error %q does not name seq %d", tc.name, err, tc.culprt)
		}
	}
	out, err := st.Forward(ctx, &good)
	if err != nil {
		t.Fatalf("valid batch after the refused ones: %v", err)
	}
	checkRows(t, "seq A in scattered blocks", out.Logits[0].Rows, ref.Logits(promptA)[5:], b.Tol)
	checkRows(t, "seq B in scattered blocks", out.Logits[1].Rows, ref.Logits(promptB[:12]), b.Tol)
	// A leaves; C takes 3 of its blocks, B the fourth.
	st.Free(1)
	tables.Free(1)
	out = forward(&stage.Batch{ID: 4, Seqs: []stage.Seq{
		{ID: 3, Tokens: promptC, Logits: true},
		{ID: 2, Pos: 12, Tokens: promptB[12:], Logits: true},
	}})
	checkRows(t, "seq C in the blocks of a freed sequence", out.Logits[0].Rows, ref.Logits(promptC), b.Tol)
	checkRows(t, "seq B next to it", out.Logits[1].Rows, ref.Logits(promptB)[12:], b.Tol)
}

// checkRows compares logits rows with reference rows.
func checkRows(t *testing.T, what string, got [][]float32, want [][]float64, tol float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d logits rows, want %d", what, len(got), len(want))
	}
	for p := range got {
		if e := RelErr(got[p], want[p]); !(e <= tol) {
			t.Errorf("%s: row %d: relative logits error %.3g against the reference, above %.3g", what, p, e, tol)
		}
	}
}

func float64s(v []float32) []float64 {
	out := make([]float64, len(v))
	for i, x := range v {
		out[i] = float64(x)
	}
	return out
}

func norm(v []float64) float64 {
	var s float64
	for _, x := range v {
		s += x * x
	}
	return math.Sqrt(s)
}

// top2 returns the indices of the largest and second largest values.
func top2(v []float64) (int, int) {
	best, second := 0, 1
	if v[second] > v[best] {
		best, second = second, best
	}
	for i := 2; i < len(v); i++ {
		switch {
		case v[i] > v[best]:
			best, second = i, best
		case v[i] > v[second]:
			second = i
		}
	}
	return best, second
}
