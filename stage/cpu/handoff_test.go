package cpu

import (
	"context"
	"encoding/binary"
	"slices"
	"testing"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/stage"
	"github.com/tandem-llm/tandem/stage/stagetest"
)

// FuzzApplyHandoff feeds arbitrary bytes as hand-off rows (they may arrive
// over TCP) and checks that ApplyHandoff either records every row, when
// all name a distinct slot in [0, MaxSeqs) and a token in the vocabulary,
// or refuses the message and records nothing.
func FuzzApplyHandoff(f *testing.F) {
	sh := shape(f, "llama-mha-f32")
	m := sh.Model
	const maxSeqs = 4
	st, err := New(Config{Model: &m, Lo: 0, Hi: m.NumLayers, Weights: stagetest.RandomWeights(&m, sh.DType, 1), MaxTokens: 8, MaxSeqs: maxSeqs, Threads: 1})
	if err != nil {
		f.Fatal(err)
	}
	row := func(slot, tok int32) []byte {
		return binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint32(nil, uint32(slot)), uint32(tok))
	}
	f.Add(row(0, 5), 1)
	f.Add(append(row(3, 100), row(1, 0)...), 2)
	f.Add(append(row(2, 1), row(2, 2)...), 2)
	f.Add(row(4, 1), 1)
	f.Add(row(-1, 1), 1)
	f.Add(row(1, int32(m.VocabSize)), 1)
	f.Add([]byte{}, 5)
	f.Fuzz(func(t *testing.T, data []byte, rows int) {
		in := st.HandoffInput().(collective.Host)
		clear(in)
		copy(in, data)
		before := slices.Clone(st.ho.tokens)
		err := st.ApplyHandoff(context.Background(), rows)
		valid := rows >= 0 && rows <= maxSeqs
		want := slices.Clone(before)
		seen := map[int32]bool{}
		for i := 0; valid && i < rows; i++ {
			slot := int32(binary.LittleEndian.Uint32(in[8*i:]))
			tok := int32(binary.LittleEndian.Uint32(in[8*i+4:]))
			if slot < 0 || slot >= maxSeqs || tok < 0 || int(tok) >= m.VocabSize || seen[slot] {
				valid = false
				break
			}
			seen[slot] = true
			want[slot] = tok
		}
		switch {
		case valid && err != nil:
			t.Fatalf("valid rows refused: %v", err)
		case !valid && err == nil:
			t.Fatalf("%d malformed rows accepted", rows)
		case !valid:
			want = before
		}
		if !slices.Equal(st.ho.tokens, want) {
			t.Fatalf("recorded tokens %v, want %v", st.ho.tokens, want)
		}
		if slices.Contains(st.ho.seen, true) {
			t.Fatal("ApplyHandoff left slots marked seen")
		}
	})
}

// TestHandoffOwnRows checks that a stage that is both first and last
// reports its hand-off rows in its own HandoffInput, applied with no copy.
func TestHandoffOwnRows(t *testing.T) {
	sh := shape(t, "llama-mha-f32")
	m := sh.Model
	st, err := New(Config{Model: &m, Lo: 0, Hi: m.NumLayers, Weights: stagetest.RandomWeights(&m, sh.DType, 1), MaxTokens: 8, MaxSeqs: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	ctx := context.Background()
	out, err := st.Forward(ctx, &stage.Batch{ID: 1, Handoff: true, Seqs: []stage.Seq{{ID: 9, Tokens: []int32{1, 2, 3}, Blocks: []int32{0}, Slot: 1, Sample: true}}})
	if err != nil {
		t.Fatal(err)
	}
	in, rows := st.HandoffInput().(collective.Host), out.Handoff.(collective.Host)
	if &in[0] != &rows[0] {
		t.Fatal("Output.Handoff is not HandoffInput on a stage that is both first and last")
	}
	if err := st.ApplyHandoff(ctx, out.HandoffHeader.Rows); err != nil {
		t.Fatal(err)
	}
	if got := st.ho.tokens[1]; got != out.Sampled[0].Token {
		t.Fatalf("slot 1 holds token %d, sampled %d", got, out.Sampled[0].Token)
	}
}
