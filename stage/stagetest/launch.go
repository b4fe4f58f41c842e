package stagetest

import (
	"context"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/tandem-llm/tandem/stage"
)

// launchSeq is one sequence of the launch check: it starts at step start
// with its prompt and decodes until step end, then is freed.
type launchSeq struct {
	id         uint64
	slot       int
	start, end int
	prompt     []int32
	sampling   stage.Sampling
}

// launchSteps is how many steps the launch check runs; step
// launchLogitsStep asks for the logits of its sequences.
const (
	launchSteps      = 12
	launchLogitsStep = 7
)

// testLaunch checks a stage.Launcher that is a whole model (first and last
// stage) as a pipeline's only stage runs it: every step launched while the
// one before it runs, its decodes fed stage.Placeholder that stand for the
// tokens of that running step (which the stage applies on the device),
// sequences freed and their slots taken by new ones between launches, and
// a step asking for logits launched alone. Every step's output must be
// bit for bit that of the same steps run one Forward at a time with their
// tokens spelled out. Then launching past stage.LaunchDepth, or a step
// asking for logits while another is launched, is refused, and the
// launched steps still finish.
func testLaunch(t *testing.T, b Backend) {
	sh := fourLayerShape(t)
	m := sh.Model
	w := RandomWeights(&m, sh.DType, 29)
	rng := rand.New(rand.NewPCG(29, 2))
	seqs := []launchSeq{
		{id: 401, slot: 0, start: 0, end: launchSteps, prompt: randomTokens(rng, 6, m.VocabSize)},
		{id: 402, slot: 1, start: 0, end: 5, prompt: randomTokens(rng, 9, m.VocabSize), sampling: stage.Sampling{Temperature: 0.8, TopK: 30, Seed: 3, Logprobs: 2}},
		{id: 403, slot: 2, start: 2, end: launchSteps, prompt: randomTokens(rng, 4, m.VocabSize), sampling: stage.Sampling{Temperature: 1.2, TopP: 0.85, Seed: 4}},
		// 404 takes 402's slot the step after 402's last.
		{id: 404, slot: 1, start: 5, end: launchSteps, prompt: randomTokens(rng, 3, m.VocabSize), sampling: stage.Sampling{Logprobs: 1}},
	}
	build := func() stage.Stage {
		return b.New(t, Spec{Model: &m, Weights: w, Lo: 0, Hi: m.NumLayers, MaxTokens: 32, MaxSeqs: 4, BlockSize: 4})
	}
	// The steps with their tokens spelled out, one Forward at a time.
	ctx := context.Background()
	ref := newPipeline(b.Transfer, build())
	var want []handoffStep
	next := map[uint64]int32{}
	for i := range launchSteps {
		bt := launchBatch(i, seqs, func(id uint64) int32 { return next[id] })
		out, err := ref.forward(ctx, t, &bt)
		if err != nil {
			t.Fatalf("step %d, one at a time: %v", i, err)
		}
		checkOutputShape(t, &bt, out, m.VocabSize)
		want = append(want, handoffStep{batch: bt, sampled: cloneSampled(out.Sampled), logits: copyLogitRows(out)})
		for k, q := range bt.Seqs {
			next[q.ID] = out.Sampled[k].Token
		}
		for _, s := range seqs {
			if s.end == i+1 {
				ref.stages[0].Free(s.id)
				ref.tables.Free(s.id)
			}
		}
	}

	st := build()
	l, ok := st.(stage.Launcher)
	if !ok {
		t.Fatalf("stage %T is not a stage.Launcher", st)
	}
	tables := TablesFor([]stage.Stage{st}, 5)
	batches := make([]*stage.Batch, launchSteps)
	for i := range batches {
		bt := launchBatch(i, seqs, func(uint64) int32 { return stage.Placeholder })
		bt.Handoff = true
		batches[i] = &bt
	}
	finished := 0
	finish := func() {
		t.Helper()
		out, err := l.Finish(ctx)
		if err != nil {
			t.Fatalf("finish step %d: %v", finished, err)
		}
		compareStep(t, finished, out, want[finished])
		if h := out.HandoffHeader; h.Rows != len(want[finished].sampled) || h.Batch != batches[finished].ID {
			t.Errorf("step %d: hand-off header %+v, want batch %d with %d rows", finished, h, batches[finished].ID, len(want[finished].sampled))
		}
		finished++
	}
	for i, bt := range batches {
		// The block tables of the sequences that ended are the leader's
		// again, so their blocks may be reused by this step.
		for _, s := range seqs {
			if s.end == i {
				st.Free(s.id)
				tables.Free(s.id)
			}
		}
		if err := tables.Fill(bt); err != nil {
			t.Fatal(err)
		}
		for i-finished == stage.LaunchDepth || i == launchLogitsStep && finished < i {
			finish()
		}
		if _, err := l.Launch(ctx, bt); err != nil {
			t.Fatalf("launch step %d (%d launched): %v", i, i-finished, err)
		}
		if i == launchLogitsStep {
			finish()
		}
	}
	for finished < launchSteps {
		finish()
	}
	t.Logf("%d steps launched %d deep, identical to the steps run one at a time", launchSteps, stage.LaunchDepth)

	// Refusals: a launch past the depth, and logits beside another step.
	// The steps launched before are unharmed.
	more := func(id uint64, logits bool) *stage.Batch {
		bt := &stage.Batch{ID: id, Seqs: []stage.Seq{{ID: 900 + id, Tokens: seqs[0].prompt, Sample: true, Logits: logits, Slot: 3}}}
		if err := tables.Fill(bt); err != nil {
			t.Fatal(err)
		}
		return bt
	}
	launch := func(bt *stage.Batch) error {
		_, err := l.Launch(ctx, bt)
		return err
	}
	for k := range stage.LaunchDepth {
		if err := launch(more(uint64(k), false)); err != nil {
			t.Fatalf("launch %d of %d: %v", k+1, stage.LaunchDepth, err)
		}
	}
	if err := launch(more(10, false)); err == nil || !strings.Contains(err.Error(), "launched") {
		t.Errorf("launch past the depth of %d: %v, want a refusal saying so", stage.LaunchDepth, err)
	}
	for range stage.LaunchDepth {
		if _, err := l.Finish(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if err := launch(more(11, false)); err != nil {
		t.Fatal(err)
	}
	if err := launch(more(12, true)); err == nil || !strings.Contains(err.Error(), "logits") {
		t.Errorf("launch of a step asking for logits beside another: %v, want a refusal saying so", err)
	}
	out, err := l.Finish(ctx)
	if err != nil || len(out.Sampled) != 1 || out.Sampled[0].Seq != 911 {
		t.Fatalf("finish after the refusals: %+v, %v; want seq 911's sample", out, err)
	}
	if _, err := l.Finish(ctx); err == nil {
		t.Error("finish with nothing launched succeeded")
	}
}

// launchBatch is step i of the launch check: a prefill of the prompt for
// each sequence starting at i, and a decode of token(id) for each sequence
// running; the logits of step launchLogitsStep.
func launchBatch(i int, seqs []launchSeq, token func(id uint64) int32) stage.Batch {
	bt := stage.Batch{ID: uint64(700 + i)}
	for _, s := range seqs {
		if i < s.start || i >= s.end {
			continue
		}
		q := stage.Seq{ID: s.id, Pos: 0, Tokens: slices.Clone(s.prompt), Sample: true, Sampling: s.sampling,
			Index: i - s.start, Slot: s.slot, Logits: i == launchLogitsStep}
		if i > s.start {
			q.Pos = len(s.prompt) + i - s.start - 1
			q.Tokens = []int32{token(s.id)}
		}
		bt.Seqs = append(bt.Seqs, q)
	}
	return bt
}
