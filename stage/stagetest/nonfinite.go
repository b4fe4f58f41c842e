package stagetest

import (
	"cmp"
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/safetensors"
	"github.com/tandem-llm/tandem/stage"
)

// testNonFinite checks that a sequence whose logits are not finite fails
// alone: its Sampled entry carries an error naming it (and no usable
// token), every other sequence of the batch gets the reference's greedy
// token, hand-off rows stay valid, and the stage goes on serving. Two
// tokens of the checkpoint have a NaN and an infinite embedding row (as a
// corrupt checkpoint may), so a sequence that feeds one has NaN activations
// from the first layer to the logits, and no other sequence does. It runs
// on one stage and on two, under greedy, tempered and nucleus sampling
// (temperature 0.8 and top-p 0.9 once panicked the CPU stage).
func testNonFinite(t *testing.T, b Backend) {
	sh := Shapes()[0] // untied: the poisoned embedding rows are not LM head rows
	m := sh.Model
	w := RandomWeights(&m, sh.DType, 25)
	rng := rand.New(rand.NewPCG(25, 7))
	promptB := randomTokens(rng, 9, m.VocabSize)
	// The poisoned tokens are none of B's prompt, nor among the five most
	// likely next tokens, which a backend's greedy choice must be one of.
	clean, err := NewReference(&m, w)
	if err != nil {
		t.Fatal(err)
	}
	likely := topTokens(clean.Logits(promptB)[len(promptB)-1], 5)
	var bad []int32
	for tok := int32(3); len(bad) < 2; tok++ {
		if !slices.Contains(promptB, tok) && !slices.Contains(likely, tok) {
			bad = append(bad, tok)
		}
	}
	w = poisonRows(t, w, model.EmbedName, sh.DType, m.HiddenSize, map[int32]uint32{bad[0]: nanBits, bad[1]: infBits})
	ref, err := NewReference(&m, w)
	if err != nil {
		t.Fatal(err)
	}
	promptA := append(randomTokens(rng, 4, m.VocabSize), bad[0])
	promptC := append([]int32{bad[1]}, randomTokens(rng, 6, m.VocabSize)...)
	samplings := []stage.Sampling{
		{},
		{Temperature: 0.8, TopP: 0.9, Seed: 1, Logprobs: 2},
		{Temperature: 1, TopK: 5, Seed: 2},
	}
	for _, bounds := range [][]int{{0, m.NumLayers}, {0, 1, m.NumLayers}} {
		for si, sp := range samplings {
			name := fmt.Sprintf("stages %v, sampling %+v", bounds, sp)
			var stages []stage.Stage
			for i := range len(bounds) - 1 {
				stages = append(stages, b.New(t, Spec{Model: &m, Weights: w, Lo: bounds[i], Hi: bounds[i+1], MaxTokens: 32, MaxSeqs: 4}))
			}
			p := newPipeline(b.Transfer, stages...)
			single := len(stages) == 1
			handoff := b.Handoff && single
			const a, bID, c, d = 11, 22, 33, 44
			batch := &stage.Batch{ID: uint64(1 + 10*si), Handoff: handoff, Seqs: []stage.Seq{
				{ID: a, Tokens: promptA, Sample: true, Sampling: sp, Slot: 0},
				{ID: bID, Tokens: promptB, Sample: true, Slot: 1, Logits: true},
				{ID: c, Tokens: promptC, Sample: true, Sampling: sp, Slot: 2},
			}}
			out, err := p.forward(context.Background(), t, batch)
			if err != nil {
				t.Fatalf("%s: the batch failed as a whole: %v", name, err)
			}
			if len(out.Sampled) != 3 {
				t.Fatalf("%s: %d samples, want 3", name, len(out.Sampled))
			}
			for k, id := range []uint64{a, c} {
				got := out.Sampled[2*k]
				if got.Seq != id || got.Err == "" || !strings.Contains(got.Err, fmt.Sprint(id)) {
					t.Errorf("%s: seq %d with non-finite logits sampled %+v, want an error naming it", name, id, got)
				}
			}
			next := out.Sampled[1].Token
			if got := out.Sampled[1]; got.Seq != bID || got.Err != "" || !slices.Contains(likely, next) {
				t.Fatalf("%s: seq %d next to the failed ones sampled %+v, want one of the likely tokens %v", name, bID, got, likely)
			}
			checkRows(t, name+": seq B next to the failed ones", out.Logits[0].Rows, ref.Logits(promptB), b.Tol)
			checkGreedy(t, name+": seq B next to the failed ones", next, ref.Logits(promptB)[len(promptB)-1], b.Tol)
			if handoff {
				// The failed sequences' rows must not make the first stage
				// refuse the hand-off of the healthy one.
				h := stages[0].(stage.HandoffReceiver)
				if b.HandoffTransfer != nil {
					b.HandoffTransfer(t, out, stages[0])
				} else {
					hostHandoffTransfer(t, out, stages[0])
				}
				if err := h.ApplyHandoff(context.Background(), out.HandoffHeader.Rows); err != nil {
					t.Errorf("%s: the hand-off of a batch with failed samples was refused: %v", name, err)
				}
			}
			// The stage keeps serving: B decodes on, the failed ones are
			// freed, and a new sequence starts.
			for _, id := range []uint64{a, c} {
				for _, st := range stages {
					st.Free(id)
				}
				p.tables.Free(id)
			}
			promptD := randomTokens(rng, 5, m.VocabSize)
			for i, tok := range promptD {
				if slices.Contains(bad, tok) {
					promptD[i] = likely[0]
				}
			}
			out, err = p.forward(context.Background(), t, &stage.Batch{ID: uint64(2 + 10*si), Seqs: []stage.Seq{
				{ID: bID, Pos: len(promptB), Tokens: []int32{next}, Sample: true, Logits: true},
				{ID: d, Tokens: promptD, Sample: true, Logits: true},
			}})
			if err != nil {
				t.Fatalf("%s: the stage stopped serving after failed samples: %v", name, err)
			}
			fedB := append(slices.Clone(promptB), next)
			if got := out.Sampled[0]; got.Err != "" {
				t.Errorf("%s: seq %d's next decode: %s", name, bID, got.Err)
			}
			checkRows(t, name+": seq B after the failures", out.Logits[0].Rows, ref.Logits(fedB)[len(promptB):], b.Tol)
			checkGreedy(t, name+": seq B after the failures", out.Sampled[0].Token, ref.Logits(fedB)[len(promptB)], b.Tol)
			checkRows(t, name+": a new sequence after the failures", out.Logits[1].Rows, ref.Logits(promptD), b.Tol)
			if out.Sampled[1].Err != "" {
				t.Errorf("%s: a new sequence after the failures: %s", name, out.Sampled[1].Err)
			}
		}
	}
}

// The bits of a quiet NaN and of +Inf in float32.
const (
	nanBits = 0x7fc00000
	infBits = 0x7f800000
)

// poisonRows returns w with the named [rows × cols] tensor replaced by a
// copy whose given rows are filled with the float32 bit pattern of each
// (NaN or an infinity, stored as dtype: the top half for BF16, the
// half-precision pattern for F16).
func poisonRows(t *testing.T, w Weights, name string, dtype safetensors.DType, cols int, rows map[int32]uint32) Weights {
	t.Helper()
	src := w[name]
	out := Weights{}
	for k, v := range w {
		out[k] = v
	}
	tn := *src
	tn.Data = slices.Clone(src.Data)
	for row, bits := range rows {
		for j := range cols {
			i := int(row)*cols + j
			switch dtype {
			case safetensors.F32:
				binary.LittleEndian.PutUint32(tn.Data[4*i:], bits)
			case safetensors.BF16:
				binary.LittleEndian.PutUint16(tn.Data[2*i:], uint16(bits>>16))
			case safetensors.F16:
				h := uint16(0x7c00) // +Inf
				if bits&0x7fffff != 0 {
					h = 0x7e00 // NaN
				}
				binary.LittleEndian.PutUint16(tn.Data[2*i:], h)
			default:
				t.Fatalf("poison %s: dtype %s is not supported", name, dtype)
			}
		}
	}
	out[name] = &tn
	return out
}

// topTokens returns the ids of the n largest values, largest first.
func topTokens(v []float64, n int) []int32 {
	ids := make([]int32, len(v))
	for i := range ids {
		ids[i] = int32(i)
	}
	slices.SortStableFunc(ids, func(a, b int32) int { return cmp.Compare(v[b], v[a]) })
	return ids[:n]
}

// checkGreedy checks a greedy token against the reference row where the
// reference's margin exceeds what the tolerance allows to flip.
func checkGreedy(t *testing.T, what string, tok int32, row []float64, tol float64) {
	t.Helper()
	best, second := top2(row)
	if row[best]-row[second] > 2*tol*norm(row) && int(tok) != best {
		t.Errorf("%s: greedy token %d, reference arg-max %d (margin %.3g)", what, tok, best, row[best]-row[second])
	}
}
