package cuda

import (
	"math"
	"strings"
	"testing"

	"github.com/tandem-llm/tandem/stage"
)

func newTestPlanner(first, last bool) (*planner, *plan) {
	lay := layout{maxTokens: 40, maxSeqs: 4, maxLogitRows: 8}
	pl := &planner{lay: lay, first: first, last: last, vocab: 100, maxPos: 36, kv: newKVSlots(3, 32)}
	return pl, &plan{words: make([]int32, lay.words())}
}

func toks(n int) []int32 {
	t := make([]int32, n)
	for i := range t {
		t[i] = int32(10 + i)
	}
	return t
}

func TestPlanPacking(t *testing.T) {
	pl, p := newTestPlanner(true, true)
	// Sequence 7 prefills 3 tokens, sequence 9 prefills 2 with logits.
	b1 := &stage.Batch{ID: 1, Seqs: []stage.Seq{
		{ID: 7, Pos: 0, Tokens: toks(3), Sample: true, Sampling: stage.Sampling{Temperature: 0.5, TopK: 4, TopP: 0.9, Seed: 0x1122334455667788, Logprobs: 2}, Index: 0},
		{ID: 9, Pos: 0, Tokens: toks(2), Logits: true},
	}}
	if err := pl.build(b1, p); err != nil {
		t.Fatal(err)
	}
	pl.commit(b1, p)
	// Then 9 decodes (sampled and with logits) and 7 continues with 2 tokens.
	b2 := &stage.Batch{ID: 2, Seqs: []stage.Seq{
		{ID: 9, Pos: 2, Tokens: []int32{42}, Sample: true, Logits: true, Index: 5},
		{ID: 7, Pos: 3, Tokens: []int32{43, 44}},
	}}
	if err := pl.build(b2, p); err != nil {
		t.Fatal(err)
	}
	lay := pl.lay
	// Slots are handed out lowest first: 7 → 0, 9 → 1; each holds 32 rows.
	wantTokens := []int32{42, 43, 44}
	wantPos := []int32{2, 3, 4}
	wantRow := []int32{32 + 2, 3, 4}
	wantBase := []int32{32, 0, 0}
	if p.tokens != 3 || p.rows != 1 || p.nSampled != 1 {
		t.Fatalf("tokens, rows, sampled = %d, %d, %d; want 3, 1, 1", p.tokens, p.rows, p.nSampled)
	}
	for i := 0; i < 3; i++ {
		if got := p.words[lay.tokens()+i]; got != wantTokens[i] {
			t.Errorf("token %d = %d; want %d", i, got, wantTokens[i])
		}
		if got := p.words[lay.pos()+i]; got != wantPos[i] {
			t.Errorf("pos %d = %d; want %d", i, got, wantPos[i])
		}
		if got := p.words[lay.cacheRow()+i]; got != wantRow[i] {
			t.Errorf("cache row %d = %d; want %d", i, got, wantRow[i])
		}
		if got := p.words[lay.kvBase()+i]; got != wantBase[i] {
			t.Errorf("kv base %d = %d; want %d", i, got, wantBase[i])
		}
	}
	if got := p.words[lay.logitRows()]; got != 0 {
		t.Errorf("logits row 0 reads batch row %d; want 0", got)
	}
	sp := p.words[lay.sample() : lay.sample()+sampleParams]
	if sp[0] != 0 || sp[6] != 5 || sp[7] != 0 {
		t.Errorf("sample params %v: want row 0, index 5, 0 logprobs", sp)
	}
	if len(p.logitStart) != 1 || p.logitStart[0] != 0 {
		t.Errorf("logitStart = %v; want [0]", p.logitStart)
	}
	pl.commit(b2, p)
	if pl.kv.length[0] != 5 || pl.kv.length[1] != 3 {
		t.Errorf("cached lengths %v; want 5 and 3 in slots 0 and 1", pl.kv.length)
	}

	// The first batch's sampling words, rebuilt on a fresh planner.
	pl, p = newTestPlanner(true, true)
	if err := pl.build(b1, p); err != nil {
		t.Fatal(err)
	}
	sp = p.words[lay.sample() : lay.sample()+sampleParams]
	want := []int32{0, int32(math.Float32bits(0.5)), 4, int32(math.Float32bits(0.9)), 0x55667788, 0x11223344, 0, 2}
	for i := range want {
		if sp[i] != want[i] {
			t.Errorf("sample word %d = %#x; want %#x", i, sp[i], want[i])
		}
	}
	// Logits rows: seq 7's sampled last row (2), then seq 9's rows 3 and 4.
	for i, w := range []int32{2, 3, 4} {
		if got := p.words[lay.logitRows()+i]; got != w {
			t.Errorf("logits row %d reads batch row %d; want %d", i, got, w)
		}
	}
	if len(p.logitStart) != 1 || p.logitStart[0] != 1 {
		t.Errorf("logitStart = %v; want [1]", p.logitStart)
	}
}

func TestPlanErrors(t *testing.T) {
	long := toks(41)
	tests := []struct {
		name        string
		first, last bool
		seqs        []stage.Seq
		want        string
	}{
		{"empty batch", true, true, nil, "no sequences"},
		{"too many seqs", true, true, []stage.Seq{{ID: 1, Tokens: toks(1)}, {ID: 2, Tokens: toks(1)}, {ID: 3, Tokens: toks(1)}, {ID: 4, Tokens: toks(1)}, {ID: 5, Tokens: toks(1)}}, "at most 4"},
		{"too many tokens", true, true, []stage.Seq{{ID: 1, Tokens: long}}, "at most 40"},
		{"duplicate", true, true, []stage.Seq{{ID: 1, Tokens: toks(1)}, {ID: 1, Tokens: toks(1)}}, "seq 1 appears twice"},
		{"no tokens", true, true, []stage.Seq{{ID: 1}}, "seq 1 has no tokens"},
		{"gap", true, true, []stage.Seq{{ID: 1, Pos: 2, Tokens: toks(1)}}, "seq 1: chunk starts at position 2 but nothing is cached"},
		{"overlap", true, true, []stage.Seq{{ID: 100, Pos: 0, Tokens: toks(1)}}, "seq 100: chunk starts at position 0 but 4 positions are cached"},
		{"past cache", true, true, []stage.Seq{{ID: 100, Pos: 4, Tokens: toks(29)}}, "seq 100: positions 4..32 exceed the KV cache's 32"},
		{"token range", true, true, []stage.Seq{{ID: 1, Tokens: []int32{3, 100}}}, "seq 1: token 100 outside"},
		{"negative token", true, true, []stage.Seq{{ID: 1, Tokens: []int32{-1}}}, "seq 1: token -1 outside"},
		{"slots exhausted", true, true, []stage.Seq{{ID: 1, Tokens: toks(1)}, {ID: 2, Tokens: toks(1)}, {ID: 3, Tokens: toks(1)}}, "seq 3: all 3 KV slots are in use"},
		{"temperature", true, true, []stage.Seq{{ID: 1, Tokens: toks(1), Sample: true, Sampling: stage.Sampling{Temperature: -1}}}, "temperature"},
		{"temperature NaN", true, true, []stage.Seq{{ID: 1, Tokens: toks(1), Sample: true, Sampling: stage.Sampling{Temperature: float32(math.NaN())}}}, "temperature"},
		{"top-k", true, true, []stage.Seq{{ID: 1, Tokens: toks(1), Sample: true, Sampling: stage.Sampling{TopK: -2}}}, "top-k -2"},
		{"top-p", true, true, []stage.Seq{{ID: 1, Tokens: toks(1), Sample: true, Sampling: stage.Sampling{TopP: 1.5}}}, "top-p 1.5"},
		{"logprobs", true, true, []stage.Seq{{ID: 1, Tokens: toks(1), Sample: true, Sampling: stage.Sampling{Logprobs: 21}}}, "21 logprobs"},
		{"logits rows", true, true, []stage.Seq{{ID: 1, Tokens: toks(9), Logits: true}}, "exceed the stage's 8"},
		{"model positions", true, true, []stage.Seq{{ID: 1, Tokens: toks(37)}}, "seq 1: positions 0..36 outside the model's 36"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			pl, p := newTestPlanner(tc.first, tc.last)
			// Sequence 100 already holds 4 positions in slot 0.
			pre := &stage.Batch{ID: 0, Seqs: []stage.Seq{{ID: 100, Tokens: toks(4)}}}
			if err := pl.build(pre, p); err != nil {
				t.Fatal(err)
			}
			pl.commit(pre, p)
			before := append([]int{}, pl.kv.length...)
			freeBefore := len(pl.kv.free)
			err := pl.build(&stage.Batch{ID: 3, Seqs: tc.seqs}, p)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "batch 3") {
				t.Fatalf("build error = %v; want one naming batch 3 and containing %q", err, tc.want)
			}
			for i := range before {
				if pl.kv.length[i] != before[i] {
					t.Errorf("failed build changed slot %d's length", i)
				}
			}
			if len(pl.kv.free) != freeBefore || len(pl.kv.slot) != 1 {
				t.Errorf("failed build changed the slot table")
			}
		})
	}
}

func TestPlanStagesIgnoreWhatTheyDoNotUse(t *testing.T) {
	// A middle stage ignores token values and sampling parameters.
	pl, p := newTestPlanner(false, false)
	b := &stage.Batch{ID: 1, Seqs: []stage.Seq{{ID: 1, Tokens: []int32{-5, 1000}, Sample: true, Sampling: stage.Sampling{Temperature: -1}, Logits: true}}}
	if err := pl.build(b, p); err != nil {
		t.Fatalf("middle stage: %v", err)
	}
	if p.rows != 0 || p.nSampled != 0 {
		t.Errorf("middle stage planned %d logits rows and %d samples; want none", p.rows, p.nSampled)
	}
}

func TestKVSlotsRelease(t *testing.T) {
	pl, p := newTestPlanner(true, true)
	for id := uint64(1); id <= 3; id++ {
		b := &stage.Batch{Seqs: []stage.Seq{{ID: id, Tokens: toks(2)}}}
		if err := pl.build(b, p); err != nil {
			t.Fatal(err)
		}
		pl.commit(b, p)
	}
	full := &stage.Batch{Seqs: []stage.Seq{{ID: 4, Tokens: toks(1)}}}
	if err := pl.build(full, p); err == nil {
		t.Fatal("a fourth sequence found a slot among 3")
	}
	pl.kv.release(2)
	pl.kv.release(99) // unknown: ignored
	if err := pl.build(full, p); err != nil {
		t.Fatalf("after release: %v", err)
	}
	if p.slots[0] != 1 {
		t.Errorf("new sequence got slot %d; want the released slot 1", p.slots[0])
	}
	if got := p.words[pl.lay.cacheRow()]; got != 32 {
		t.Errorf("cache row %d; want 32 (slot 1, position 0)", got)
	}
	pl.commit(full, p)
	// The released sequence starts again from position 0.
	again := &stage.Batch{Seqs: []stage.Seq{{ID: 2, Pos: 2, Tokens: toks(1)}}}
	if err := pl.build(again, p); err == nil {
		t.Fatal("released sequence continued at position 2")
	}
}
