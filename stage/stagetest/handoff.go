package stagetest

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"unsafe"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/stage"
)

// hostHandoffTransfer copies the last stage's hand-off rows into the first
// stage's HandoffInput, both host buffers; it copies nothing when they are
// the same memory (a stage that is both first and last may report into its
// own input).
func hostHandoffTransfer(t *testing.T, out *stage.Output, first stage.Stage) {
	t.Helper()
	h, ok := first.(stage.HandoffReceiver)
	if !ok {
		t.Fatalf("first stage %T is not a stage.HandoffReceiver", first)
	}
	src, ok := out.Handoff.(collective.Host)
	dst, ok2 := h.HandoffInput().(collective.Host)
	if !ok || !ok2 {
		t.Fatalf("hand-off rows %T into %T: not host buffers; set Backend.HandoffTransfer", out.Handoff, h.HandoffInput())
	}
	n := out.HandoffHeader.Bytes()
	if len(dst) < n || len(src) < n {
		t.Fatalf("hand-off of %d bytes from a buffer of %d into one of %d", n, len(src), len(dst))
	}
	if n > 0 && unsafe.SliceData(src) != unsafe.SliceData(dst) {
		copy(dst[:n], src[:n])
	}
}

// handoffReq is one sequence of the hand-off check.
type handoffReq struct {
	id       uint64
	slot     int
	prompt   []int32
	sampling stage.Sampling
	logits   bool
}

// handoffStep is one step of the explicit run: the batch, with its tokens
// spelled out, and what the last stage returned.
type handoffStep struct {
	batch   stage.Batch
	sampled []stage.Sampled
	logits  [][][]float32
}

// handoffGen is how many decode steps each sequence of the check runs.
const handoffGen = 5

// testHandoff checks on-device hand-off: decodes whose input token is
// stage.Placeholder, filled by the first stage from the (slot, token) rows
// the last stage reported, give exactly what the same batches with their
// tokens spelled out give, on one stage and on two; then that malformed
// slots, placeholders and hand-off rows are refused.
func testHandoff(t *testing.T, b Backend) {
	sh := fourLayerShape(t)
	m := sh.Model
	w := RandomWeights(&m, sh.DType, 23)
	rng := rand.New(rand.NewPCG(23, 8))
	// Two groups of two sequences take turns, so that on two stages the
	// first runs a group's step before the other group's hand-off arrives.
	reqs := []handoffReq{
		{id: 301, slot: 2, prompt: randomTokens(rng, 5, m.VocabSize), logits: true},
		{id: 302, slot: 0, prompt: randomTokens(rng, 11, m.VocabSize), sampling: stage.Sampling{Temperature: 0.9, TopK: 20, Seed: 5, Logprobs: 2}},
		{id: 303, slot: 3, prompt: randomTokens(rng, 3, m.VocabSize), sampling: stage.Sampling{Temperature: 1.1, TopP: 0.9, Seed: 6}},
		{id: 304, slot: 1, prompt: randomTokens(rng, 8, m.VocabSize), logits: true, sampling: stage.Sampling{Logprobs: 1}},
	}
	for _, bounds := range [][]int{{0, m.NumLayers}, {0, 2, m.NumLayers}} {
		build := func() []stage.Stage {
			var stages []stage.Stage
			for i := range len(bounds) - 1 {
				stages = append(stages, b.New(t, Spec{Model: &m, Weights: w, Lo: bounds[i], Hi: bounds[i+1], MaxTokens: 32, MaxSeqs: 4, BlockSize: 4}))
			}
			return stages
		}
		steps := runExplicit(t, b, build(), reqs)
		runPlaceholders(t, b, build(), steps)
		t.Logf("stages %v: %d steps with placeholders identical to the tokens spelled out", bounds, len(steps))
	}
	testHandoffRefused(t, b, &m, w)
}

func fourLayerShape(t *testing.T) Shape {
	t.Helper()
	for _, s := range Shapes() {
		if s.Model.NumLayers == 4 {
			return s
		}
	}
	t.Fatal("no 4-layer shape")
	return Shape{}
}

// runExplicit runs the requests' steps with every token spelled out and no
// hand-off, and returns them with their results.
func runExplicit(t *testing.T, b Backend, stages []stage.Stage, reqs []handoffReq) []handoffStep {
	t.Helper()
	p := newPipeline(b.Transfer, stages...)
	pos, next, index := map[uint64]int{}, map[uint64]int32{}, map[uint64]int{}
	var steps []handoffStep
	for step := range 2 * (1 + handoffGen) {
		bt := stage.Batch{ID: uint64(500 + step)}
		group := step % 2
		for _, r := range reqs[2*group : 2*group+2] {
			toks := r.prompt
			if pos[r.id] > 0 {
				toks = []int32{next[r.id]}
			}
			bt.Seqs = append(bt.Seqs, stage.Seq{ID: r.id, Pos: pos[r.id], Tokens: toks, Sample: true, Sampling: r.sampling,
				Index: index[r.id], Logits: r.logits, Slot: r.slot})
		}
		out, err := p.forward(context.Background(), t, &bt)
		if err != nil {
			t.Fatalf("explicit step %d: %v", step, err)
		}
		checkOutputShape(t, &bt, out, stages[len(stages)-1].Info().Vocab)
		if out.Handoff != nil {
			t.Errorf("step %d without Batch.Handoff: Output.Handoff is %T, want nil", step, out.Handoff)
		}
		steps = append(steps, handoffStep{batch: bt, sampled: cloneSampled(out.Sampled), logits: copyLogitRows(out)})
		for k, q := range bt.Seqs {
			pos[q.ID] += len(q.Tokens)
			next[q.ID] = out.Sampled[k].Token
			index[q.ID]++
		}
	}
	return steps
}

// runPlaceholders runs the steps again with every decode token a
// placeholder and Batch.Handoff set, applying each step's hand-off rows to
// the first stage, and compares every result with the explicit run's. On
// two stages the first runs each step before the second has finished the
// step before it, as a pipeline does.
func runPlaceholders(t *testing.T, b Backend, stages []stage.Stage, steps []handoffStep) {
	t.Helper()
	ctx := context.Background()
	first, last := stages[0], stages[len(stages)-1]
	if len(stages) > 2 {
		t.Fatalf("runPlaceholders drives one or two stages, not %d", len(stages))
	}
	if _, ok := first.(stage.HandoffReceiver); !ok {
		t.Fatalf("first stage %T is not a stage.HandoffReceiver", first)
	}
	if h, ok := last.(stage.HandoffReceiver); ok && last != first {
		if h.HandoffInput() != nil {
			t.Error("a stage that is not the first has a hand-off input")
		}
		if err := h.ApplyHandoff(ctx, 0); err == nil {
			t.Error("a stage that is not the first applied a hand-off")
		}
	}
	tables := TablesFor(stages, 3)
	batches := make([]*stage.Batch, len(steps))
	for i, st := range steps {
		bt := &stage.Batch{ID: st.batch.ID, Handoff: true, Seqs: slices.Clone(st.batch.Seqs)}
		for k := range bt.Seqs {
			if q := &bt.Seqs[k]; q.Pos > 0 {
				q.Tokens = []int32{stage.Placeholder}
			}
		}
		if err := tables.Fill(bt); err != nil {
			t.Fatal(err)
		}
		batches[i] = bt
	}
	// finish runs the last stage on step i (whose activations are in its
	// Input), checks it and hands its sampled tokens back to the first.
	finish := func(i int) {
		out, err := last.Forward(ctx, batches[i])
		if err != nil {
			t.Fatalf("step %d with placeholders: %v", i, err)
		}
		compareStep(t, i, out, steps[i])
		want := collective.Header{Batch: batches[i].ID, Rows: len(steps[i].sampled), Cols: stage.HandoffCols, DType: collective.I32}
		if out.HandoffHeader != want || out.Handoff == nil || out.Handoff.Len() < want.Bytes() {
			t.Fatalf("step %d: hand-off header %+v in %v, want %+v", i, out.HandoffHeader, out.Handoff, want)
		}
		if host, ok := out.Handoff.(collective.Host); ok {
			checkHandoffRows(t, i, host, batches[i], out.Sampled)
		}
		handoffTransfer(t, b, out, first)
		if err := first.(stage.HandoffReceiver).ApplyHandoff(ctx, out.HandoffHeader.Rows); err != nil {
			t.Fatalf("step %d: apply hand-off: %v", i, err)
		}
	}
	if len(stages) == 1 {
		for i := range batches {
			finish(i)
		}
		return
	}
	for i := range batches {
		out, err := first.Forward(ctx, batches[i])
		if err != nil {
			t.Fatalf("step %d with placeholders, first stage: %v", i, err)
		}
		if out.Handoff != nil {
			t.Errorf("step %d: the first of two stages reports hand-off rows", i)
		}
		if i > 0 {
			finish(i - 1)
		}
		b.Transfer(t, out, last)
	}
	finish(len(batches) - 1)
}

func handoffTransfer(t *testing.T, b Backend, out *stage.Output, first stage.Stage) {
	t.Helper()
	if b.HandoffTransfer != nil {
		b.HandoffTransfer(t, out, first)
		return
	}
	hostHandoffTransfer(t, out, first)
}

// compareStep requires the results of a step run with placeholders to be
// those of the same step with its tokens spelled out, bit for bit.
func compareStep(t *testing.T, i int, out *stage.Output, want handoffStep) {
	t.Helper()
	if len(out.Sampled) != len(want.sampled) {
		t.Fatalf("step %d: %d samples with placeholders, %d with tokens", i, len(out.Sampled), len(want.sampled))
	}
	for k, s := range out.Sampled {
		e := want.sampled[k]
		if s.Seq != e.Seq || s.Token != e.Token || s.Logprob != e.Logprob || !slices.Equal(s.Top, e.Top) {
			t.Errorf("step %d: sampled %+v with placeholders, %+v with tokens", i, s, e)
		}
	}
	got := copyLogitRows(out)
	if len(got) != len(want.logits) {
		t.Fatalf("step %d: logits of %d sequences with placeholders, %d with tokens", i, len(got), len(want.logits))
	}
	for k := range got {
		for r := range got[k] {
			if !slices.Equal(got[k][r], want.logits[k][r]) {
				t.Errorf("step %d: seq %d logits row %d differ with placeholders (relative %.3g)", i, out.Logits[k].Seq, r, RelErr(got[k][r], float64s(want.logits[k][r])))
			}
		}
	}
}

// checkHandoffRows checks host hand-off rows: (slot, token) of each sampled
// sequence, in batch order.
func checkHandoffRows(t *testing.T, i int, rows collective.Host, b *stage.Batch, sampled []stage.Sampled) {
	t.Helper()
	k := 0
	for _, q := range b.Seqs {
		if !q.Sample {
			continue
		}
		off := 4 * stage.HandoffCols * k
		slot, tok := int32(binary.LittleEndian.Uint32(rows[off:])), int32(binary.LittleEndian.Uint32(rows[off+4:]))
		if slot != int32(q.Slot) || tok != sampled[k].Token {
			t.Errorf("step %d: hand-off row %d is (%d, %d), want seq %d's (%d, %d)", i, k, slot, tok, q.ID, q.Slot, sampled[k].Token)
		}
		k++
	}
}

// testHandoffRefused checks that bad slots, placeholders with no token
// and malformed hand-off rows are refused, and that a refused hand-off
// message records none of its rows.
func testHandoffRefused(t *testing.T, b Backend, m *model.Config, w Weights) {
	ref, err := NewReference(m, w)
	if err != nil {
		t.Fatal(err)
	}
	const maxSeqs = 4
	st := b.New(t, Spec{Model: m, Weights: w, Lo: 0, Hi: m.NumLayers, MaxTokens: 32, MaxSeqs: maxSeqs})
	h, ok := st.(stage.HandoffReceiver)
	if !ok {
		t.Fatalf("stage %T is not a stage.HandoffReceiver", st)
	}
	p := newPipeline(b.Transfer, st)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(29, 1))
	prompt := randomTokens(rng, 6, m.VocabSize)
	const a, c = 4242, 4343
	refuse := func(what string, culprit uint64, bt *stage.Batch) {
		t.Helper()
		_, err := p.forward(ctx, t, bt)
		switch {
		case err == nil:
			t.Errorf("%s: batch accepted", what)
		case !strings.Contains(err.Error(), fmt.Sprint(culprit)):
			t.Errorf("%s: error %q does not name seq %d", what, err, culprit)
		}
	}
	for _, rows := range []int{-1, maxSeqs + 1} {
		if err := h.ApplyHandoff(ctx, rows); err == nil {
			t.Errorf("ApplyHandoff of %d rows (max seqs %d) accepted", rows, maxSeqs)
		}
	}
	if _, err := p.forward(ctx, t, &stage.Batch{ID: 1, Seqs: []stage.Seq{{ID: a, Tokens: prompt, Slot: 2}}}); err != nil {
		t.Fatal(err)
	}
	placeholder := func(id uint64, slot int, pos int) stage.Seq {
		return stage.Seq{ID: id, Pos: pos, Tokens: []int32{stage.Placeholder}, Slot: slot, Sample: true, Logits: true}
	}
	refuse("placeholder with no token recorded", a, &stage.Batch{ID: 2, Seqs: []stage.Seq{placeholder(a, 2, 6)}})
	for _, slot := range []int{-1, maxSeqs} {
		refuse(fmt.Sprintf("slot %d", slot), a, &stage.Batch{ID: 3, Seqs: []stage.Seq{{ID: a, Pos: 6, Tokens: prompt[:1], Slot: slot}}})
	}
	refuse("two sampled sequences in one slot", c, &stage.Batch{ID: 4, Handoff: true, Seqs: []stage.Seq{
		{ID: a, Pos: 6, Tokens: prompt[:1], Slot: 2, Sample: true},
		{ID: c, Tokens: prompt[:2], Slot: 2, Sample: true},
	}})
	// A valid step records a's sampled token under slot 2.
	x0 := prompt[0]
	bt := &stage.Batch{ID: 5, Handoff: true, Seqs: []stage.Seq{{ID: a, Pos: 6, Tokens: []int32{x0}, Slot: 2, Sample: true}}}
	out, err := p.forward(ctx, t, bt)
	if err != nil {
		t.Fatalf("valid hand-off step after the refused ones: %v", err)
	}
	t1 := out.Sampled[0].Token
	handoffTransfer(t, b, out, st)
	if err := h.ApplyHandoff(ctx, out.HandoffHeader.Rows); err != nil {
		t.Fatal(err)
	}
	// Malformed messages, each refused whole: by ApplyHandoff, or by the
	// next Forward on a backend that checks rows on its device.
	v := int32(m.VocabSize)
	other := (t1 + 1) % v
	for i, rows := range [][]int32{
		{maxSeqs, 7},
		{-1, 7},
		{2, v},
		{2, -5},
		{2, other, 2, (t1 + 2) % v},
		{0, 7, 2, other, maxSeqs + 3, 1},
	} {
		msg := make(collective.Host, 4*len(rows))
		for j, x := range rows {
			binary.LittleEndian.PutUint32(msg[4*j:], uint32(x))
		}
		n := len(rows) / stage.HandoffCols
		fake := &stage.Output{HandoffHeader: collective.Header{Batch: 99, Rows: n, Cols: stage.HandoffCols, DType: collective.I32}, Handoff: msg}
		handoffTransfer(t, b, fake, st)
		err := h.ApplyHandoff(ctx, n)
		if err == nil {
			probe := &stage.Batch{ID: uint64(10 + i), Seqs: []stage.Seq{{ID: uint64(9000 + i), Tokens: prompt[:2], Slot: 3}}}
			_, err = p.forward(ctx, t, probe)
		}
		if err == nil || !strings.Contains(err.Error(), "hand-off") {
			t.Errorf("hand-off rows %v: error %v, want one about the hand-off", rows, err)
		}
	}
	// Slot 2 still holds t1, and slot 0 nothing.
	out, err = p.forward(ctx, t, &stage.Batch{ID: 30, Seqs: []stage.Seq{placeholder(a, 2, 7)}})
	if err != nil {
		t.Fatalf("placeholder after the refused hand-offs: %v", err)
	}
	all := append(slices.Clone(prompt), x0, t1)
	checkRows(t, "placeholder filled with the last valid hand-off", out.Logits[0].Rows, ref.Logits(all)[7:], b.Tol)
	refuse("placeholder for a slot only refused rows named", c+1, &stage.Batch{ID: 31, Seqs: []stage.Seq{
		{ID: c, Tokens: prompt[:3], Slot: 1},
		placeholder(c+1, 0, 0),
	}})
}

func cloneSampled(s []stage.Sampled) []stage.Sampled {
	out := make([]stage.Sampled, len(s))
	for i, x := range s {
		x.Top = slices.Clone(x.Top)
		out[i] = x
	}
	return out
}

func copyLogitRows(out *stage.Output) [][][]float32 {
	l := make([][][]float32, len(out.Logits))
	for i, sl := range out.Logits {
		for _, r := range sl.Rows {
			l[i] = append(l[i], slices.Clone(r))
		}
	}
	return l
}
