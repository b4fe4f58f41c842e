package stagetest

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/tandem-llm/tandem/stage"
)

// resetter is a stage that can forget every sequence at once (the CPU and
// CUDA backends): a node reuses such a stage, weights and all, in the next
// pipeline, where the leader re-prefills every request from position 0.
type resetter interface{ Reset() error }

// testReset checks that after Reset a stage holds no sequence: one it held
// must start again at position 0 (continuing refused), and then gives the
// reference logits, as on a fresh stage.
func testReset(t *testing.T, b Backend) {
	sh := Shapes()[0]
	m := sh.Model
	w := RandomWeights(&m, sh.DType, 17)
	ref, err := NewReference(&m, w)
	if err != nil {
		t.Fatal(err)
	}
	st := b.New(t, Spec{Model: &m, Weights: w, Lo: 0, Hi: m.NumLayers, MaxTokens: 32, MaxSeqs: 4})
	r, ok := st.(resetter)
	if !ok {
		t.Skipf("the %s stage has no Reset", st.Info().Backend)
	}
	p := newPipeline(b.Transfer, st)
	rng := rand.New(rand.NewPCG(17, 4))
	p1, p2 := randomTokens(rng, 7, m.VocabSize), randomTokens(rng, 11, m.VocabSize)
	ctx := context.Background()
	if _, err := p.forward(ctx, t, &stage.Batch{ID: 1, Seqs: []stage.Seq{{ID: 1, Tokens: p1}, {ID: 2, Tokens: p2[:4]}}}); err != nil {
		t.Fatal(err)
	}
	if err := r.Reset(); err != nil {
		t.Fatal(err)
	}
	if _, err := p.forward(ctx, t, &stage.Batch{ID: 2, Seqs: []stage.Seq{{ID: 2, Pos: 4, Tokens: p2[4:5]}}}); err == nil {
		t.Error("after Reset, a sequence continued at position 4")
	}
	out, err := p.forward(ctx, t, &stage.Batch{ID: 3, Seqs: []stage.Seq{
		{ID: 2, Tokens: p2, Logits: true},
		{ID: 1, Tokens: p1[:3], Logits: true},
	}})
	if err != nil {
		t.Fatalf("after Reset, prefilling the sequences again: %v", err)
	}
	checkRows(t, "sequence re-prefilled after Reset", out.Logits[0].Rows, ref.Logits(p2), b.Tol)
	checkRows(t, "another re-prefilled after Reset", out.Logits[1].Rows, ref.Logits(p1[:3]), b.Tol)
}
