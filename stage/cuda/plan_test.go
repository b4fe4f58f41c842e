package cuda

import (
	"maps"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/tandem-llm/tandem/stage"
)

// newTestPlanner plans batches of up to 40 tokens and 4 sequences (8
// logits rows) over a cache of 12 blocks of 4 positions, 32 positions per
// sequence, for a model of 100 tokens and 36 positions.
func newTestPlanner(first, last bool) (*planner, *plan) {
	lay := layout{maxTokens: 40, maxSeqs: 4, maxLogitRows: 8, maxBlocks: 8}
	pl := &planner{lay: lay, first: first, last: last, vocab: 100, maxPos: 36, kv: newPagedKV(12, 4, 32)}
	return pl, &plan{words: make([]int32, lay.words())}
}

func toks(n int) []int32 {
	t := make([]int32, n)
	for i := range t {
		t[i] = int32(10 + i)
	}
	return t
}

// seq is sequence id's prefill of n tokens in blocks 0, 1, ...
func seq(id uint64, n int) stage.Seq {
	blocks := make([]int32, (n+3)/4)
	for i := range blocks {
		blocks[i] = int32(i)
	}
	return stage.Seq{ID: id, Tokens: toks(n), Blocks: blocks}
}

func TestPlanPacking(t *testing.T) {
	pl, p := newTestPlanner(true, true)
	// Sequence 7 prefills 3 tokens in block 5, sequence 9 prefills 2 with
	// logits in block 2.
	b1 := &stage.Batch{ID: 1, Seqs: []stage.Seq{
		{ID: 7, Pos: 0, Tokens: toks(3), Blocks: []int32{5}, Slot: 2, Sample: true,
			Sampling: stage.Sampling{Temperature: 0.5, TopK: 4, TopP: 0.9, Seed: 0x1122334455667788, Logprobs: 2}, Index: 0},
		{ID: 9, Pos: 0, Tokens: toks(2), Blocks: []int32{2}, Logits: true},
	}}
	if err := pl.build(b1, p); err != nil {
		t.Fatal(err)
	}
	pl.commit(b1)
	// Then 9 decodes (sampled and with logits) and 7 continues with 2
	// tokens, the second in a new block, 11.
	b2 := &stage.Batch{ID: 2, Seqs: []stage.Seq{
		{ID: 9, Pos: 2, Tokens: []int32{42}, Blocks: []int32{2}, Slot: 1, Sample: true, Logits: true, Index: 5},
		{ID: 7, Pos: 3, Tokens: []int32{43, 44}, Blocks: []int32{5, 11}},
	}}
	if err := pl.build(b2, p); err != nil {
		t.Fatal(err)
	}
	lay := pl.lay
	want := map[string]struct {
		off  int
		want []int32
	}{
		"token":     {lay.tokens(), []int32{42, 43, 44}},
		"position":  {lay.pos(), []int32{2, 3, 4}},
		"cache row": {lay.cacheRow(), []int32{2*4 + 2, 5*4 + 3, 11*4 + 0}},
		"table":     {lay.tableOff(), []int32{1, 2, 2}},
		"tables":    {lay.tables() + 1, []int32{2, 5, 11}},
	}
	if p.tokens != 3 || p.rows != 1 || p.nSampled != 1 || p.tableWords != 4 || p.placeholders {
		t.Fatalf("tokens, rows, sampled, table words, placeholders = %d, %d, %d, %d, %v; want 3, 1, 1, 4, false",
			p.tokens, p.rows, p.nSampled, p.tableWords, p.placeholders)
	}
	for name, w := range want {
		for i, v := range w.want {
			if got := p.words[w.off+i]; got != v {
				t.Errorf("%s word %d = %d; want %d", name, i, got, v)
			}
		}
	}
	if got := p.uploadWords(lay); got != lay.tables()+4 {
		t.Errorf("upload %d words; want %d, up to the tables in use", got, lay.tables()+4)
	}
	if got := p.words[lay.logitRows()]; got != 0 {
		t.Errorf("logits row 0 reads batch row %d; want 0", got)
	}
	sp := p.words[lay.sample() : lay.sample()+sampleParams]
	if sp[0] != 0 || sp[6] != 5 || sp[7] != 0 || sp[8] != 1 {
		t.Errorf("sample params %v: want row 0, index 5, 0 logprobs, slot 1", sp)
	}
	if len(p.logitStart) != 1 || p.logitStart[0] != 0 {
		t.Errorf("logitStart = %v; want [0]", p.logitStart)
	}
	pl.commit(b2)
	if !maps.Equal(pl.kv.length, map[uint64]int{7: 5, 9: 3}) {
		t.Errorf("cached lengths %v; want 7: 5, 9: 3", pl.kv.length)
	}

	// The first batch's sampling words, rebuilt on a fresh planner.
	pl, p = newTestPlanner(true, true)
	if err := pl.build(b1, p); err != nil {
		t.Fatal(err)
	}
	sp = p.words[lay.sample() : lay.sample()+sampleParams]
	wantSP := []int32{0, int32(math.Float32bits(0.5)), 4, int32(math.Float32bits(0.9)), 0x55667788, 0x11223344, 0, 2, 2}
	for i := range wantSP {
		if sp[i] != wantSP[i] {
			t.Errorf("sample word %d = %#x; want %#x", i, sp[i], wantSP[i])
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

func TestPlanPlaceholder(t *testing.T) {
	pl, p := newTestPlanner(true, true)
	pre := &stage.Batch{ID: 1, Seqs: []stage.Seq{seq(7, 5)}}
	if err := pl.build(pre, p); err != nil {
		t.Fatal(err)
	}
	pl.commit(pre)
	b := &stage.Batch{ID: 2, Handoff: true, Seqs: []stage.Seq{
		{ID: 7, Pos: 5, Tokens: []int32{stage.Placeholder}, Blocks: []int32{0, 1}, Slot: 3, Sample: true},
		{ID: 8, Tokens: []int32{4, 5}, Blocks: []int32{6}, Slot: 0, Sample: true},
	}}
	if err := pl.build(b, p); err != nil {
		t.Fatal(err)
	}
	if !p.placeholders {
		t.Error("a batch with a placeholder is planned without")
	}
	// The placeholder of slot 3 is the token word -1 - 3.
	if got := p.words[pl.lay.tokens() : pl.lay.tokens()+3]; got[0] != -4 || got[1] != 4 || got[2] != 5 {
		t.Errorf("token words %v; want [-4 4 5]", got)
	}
	for i, slot := range []int32{3, 0} {
		if got := p.words[pl.lay.sample()+sampleParams*i+8]; got != slot {
			t.Errorf("sample %d reports slot %d; want %d", i, got, slot)
		}
	}
}

func TestPlanErrors(t *testing.T) {
	long := seq(1, 41)
	withSlot := func(q stage.Seq, slot int) stage.Seq { q.Slot = slot; return q }
	sampled := func(q stage.Seq, sp stage.Sampling) stage.Seq { q.Sample, q.Sampling = true, sp; return q }
	withTokens := func(q stage.Seq, tk []int32) stage.Seq { q.Tokens = tk; return q }
	tests := []struct {
		name    string
		handoff bool
		seqs    []stage.Seq
		want    string
	}{
		{"empty batch", false, nil, "no sequences"},
		{"too many seqs", false, []stage.Seq{seq(1, 1), seq(2, 1), seq(3, 1), seq(4, 1), seq(5, 1)}, "at most 4"},
		{"too many tokens", false, []stage.Seq{long}, "at most 40"},
		{"duplicate", false, []stage.Seq{seq(1, 1), seq(1, 1)}, "seq 1 appears twice"},
		{"no tokens", false, []stage.Seq{seq(1, 0)}, "seq 1: no tokens"},
		{"gap", false, []stage.Seq{{ID: 1, Pos: 2, Tokens: toks(1), Blocks: []int32{0}}}, "seq 1: chunk starts at position 2 but nothing is cached"},
		{"overlap", false, []stage.Seq{{ID: 100, Pos: 0, Tokens: toks(1), Blocks: []int32{9}}}, "seq 100: chunk starts at position 0 but 4 positions are cached"},
		{"past the per-sequence positions", false, []stage.Seq{{ID: 100, Pos: 4, Tokens: toks(29), Blocks: make([]int32, 9)}}, "seq 100: positions 4..32 exceed the stage's 32 per sequence"},
		{"model positions", false, []stage.Seq{seq(1, 37)}, "seq 1: positions 0..36 outside the model's 36"},
		{"token range", false, []stage.Seq{withTokens(seq(1, 2), []int32{3, 100})}, "seq 1: token 100 outside"},
		{"negative token", false, []stage.Seq{withTokens(seq(1, 1), []int32{-2})}, "seq 1: token -2 outside"},
		{"slot past max seqs", false, []stage.Seq{withSlot(seq(1, 1), 4)}, "seq 1: hand-off slot 4 outside [0, 4)"},
		{"negative slot", false, []stage.Seq{withSlot(seq(1, 1), -1)}, "seq 1: hand-off slot -1 outside"},
		{"shared slot", true, []stage.Seq{withSlot(sampled(seq(1, 1), stage.Sampling{}), 2), withSlot(sampled(seq(2, 1), stage.Sampling{}), 2)}, "seq 2: hand-off slot 2 is seq 1's too"},
		{"table too short", false, []stage.Seq{{ID: 1, Tokens: toks(5), Blocks: []int32{3}}}, "seq 1: block table of 1 blocks does not cover positions [0, 5)"},
		{"block past the cache", false, []stage.Seq{{ID: 1, Tokens: toks(5), Blocks: []int32{3, 12}}}, "seq 1: block 1 of the table is 12, outside the stage's [0, 12)"},
		{"negative block", false, []stage.Seq{{ID: 1, Tokens: toks(1), Blocks: []int32{-1}}}, "seq 1: block 0 of the table is -1"},
		{"temperature", false, []stage.Seq{sampled(seq(1, 1), stage.Sampling{Temperature: -1})}, "temperature"},
		{"temperature NaN", false, []stage.Seq{sampled(seq(1, 1), stage.Sampling{Temperature: float32(math.NaN())})}, "temperature"},
		{"top-k", false, []stage.Seq{sampled(seq(1, 1), stage.Sampling{TopK: -2})}, "top-k -2"},
		{"top-p", false, []stage.Seq{sampled(seq(1, 1), stage.Sampling{TopP: 1.5})}, "top-p 1.5"},
		{"logprobs", false, []stage.Seq{sampled(seq(1, 1), stage.Sampling{Logprobs: 21})}, "21 logprobs"},
		{"logits rows", false, []stage.Seq{{ID: 1, Tokens: toks(9), Blocks: []int32{0, 1, 2}, Logits: true}}, "exceed the stage's 8"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			pl, p := newTestPlanner(true, true)
			// Sequence 100 already holds 4 positions in block 9.
			pre := &stage.Batch{ID: 0, Seqs: []stage.Seq{{ID: 100, Tokens: toks(4), Blocks: []int32{9}}}}
			if err := pl.build(pre, p); err != nil {
				t.Fatal(err)
			}
			pl.commit(pre)
			err := pl.build(&stage.Batch{ID: 3, Handoff: tc.handoff, Seqs: tc.seqs}, p)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "batch 3") {
				t.Fatalf("build error = %v; want one naming batch 3 and containing %q", err, tc.want)
			}
			if !maps.Equal(pl.kv.length, map[uint64]int{100: 4}) {
				t.Errorf("failed build changed the cached lengths: %v", pl.kv.length)
			}
		})
	}
	// Without Batch.Handoff two sequences may share a slot (the leader
	// assigns slots only with hand-off on).
	pl, p := newTestPlanner(true, true)
	b := &stage.Batch{ID: 4, Seqs: []stage.Seq{sampled(seq(1, 1), stage.Sampling{}), sampled(seq(2, 1), stage.Sampling{})}}
	if err := pl.build(b, p); err != nil {
		t.Errorf("two sequences in slot 0 without hand-off: %v", err)
	}
}

func TestPlanStagesIgnoreWhatTheyDoNotUse(t *testing.T) {
	// A middle stage ignores token values and sampling parameters.
	pl, p := newTestPlanner(false, false)
	b := &stage.Batch{ID: 1, Seqs: []stage.Seq{{ID: 1, Tokens: []int32{-5, 1000}, Blocks: []int32{0}, Sample: true, Sampling: stage.Sampling{Temperature: -1}, Logits: true}}}
	if err := pl.build(b, p); err != nil {
		t.Fatalf("middle stage: %v", err)
	}
	if p.rows != 0 || p.nSampled != 0 || p.placeholders {
		t.Errorf("middle stage planned %d logits rows, %d samples, placeholders %v; want none", p.rows, p.nSampled, p.placeholders)
	}
}

func TestPlanRelease(t *testing.T) {
	pl, p := newTestPlanner(true, true)
	for id := uint64(1); id <= 3; id++ {
		b := &stage.Batch{Seqs: []stage.Seq{seq(id, 2)}}
		if err := pl.build(b, p); err != nil {
			t.Fatal(err)
		}
		pl.commit(b)
	}
	pl.kv.release(2)
	pl.kv.release(99) // unknown: ignored
	// The released sequence starts again from position 0.
	again := &stage.Batch{Seqs: []stage.Seq{{ID: 2, Pos: 2, Tokens: toks(1), Blocks: []int32{0}}}}
	if err := pl.build(again, p); err == nil {
		t.Fatal("released sequence continued at position 2")
	}
	if err := pl.build(&stage.Batch{Seqs: []stage.Seq{seq(2, 3)}}, p); err != nil {
		t.Fatalf("released sequence starting over: %v", err)
	}
	if !maps.Equal(pl.kv.length, map[uint64]int{1: 2, 3: 2}) {
		t.Errorf("cached lengths %v; want 1: 2, 3: 2", pl.kv.length)
	}
}

// TestPrefillLists: which rows of a step the prefill attention takes, in
// tiles (a sequence's rows whose positions share a block of 64; whole: at
// least 16 rows), wherever the sequences' rows lie in the step, and which
// it leaves to the per-row kernel.
func TestPrefillLists(t *testing.T) {
	// The lists are uploaded on their own, from the tile list on, by
	// copy_words: 16-byte aligned.
	for _, l := range []layout{{1, 1, 1, 1}, {512, 64, 256, 2049}, {2048, 3, 7, 5}} {
		if l.tileList()%4 != 0 {
			t.Errorf("layout %+v: tile list at word %d; want a multiple of 4", l, l.tileList())
		}
	}
	lay := layout{maxTokens: 256, maxSeqs: 8, maxLogitRows: 8, maxBlocks: 8}
	// seqs lays out sequences of (rows, first position) one after another,
	// each with its own block table.
	seqs := func(s ...[2]int) ([]int32, int) {
		w := make([]int32, lay.words())
		T := 0
		for i, sq := range s {
			for r := 0; r < sq[0]; r++ {
				w[lay.pos()+T] = int32(sq[1] + r)
				w[lay.tableOff()+T] = int32(1 + i*lay.maxBlocks)
				T++
			}
		}
		return w, T
	}
	for _, tc := range []struct {
		name        string
		seqs        [][2]int
		tiles, rows int
	}{
		{"one prompt of 128", [][2]int{{128, 0}}, 2, 0},
		{"mid-sequence chunk: tiles of 20 and 60 rows", [][2]int{{80, 300}}, 2, 0},
		{"mid-sequence chunk: tiles of 4, 64 and 12 rows", [][2]int{{80, 316}}, 1, 16},
		{"last tile of 2 rows", [][2]int{{130, 0}}, 2, 2},
		{"decodes", [][2]int{{1, 5}, {1, 9}, {1, 2}}, 0, 3},
		{"two prompts of 48 and 16", [][2]int{{48, 0}, {16, 0}}, 2, 0},
		{"a prompt, then decodes", [][2]int{{64, 0}, {1, 7}, {1, 3}}, 1, 2},
		{"a decode, then prompts", [][2]int{{1, 7}, {64, 0}, {64, 0}}, 2, 1},
		{"a chunk's 15-row tail, then prompts", [][2]int{{15, 49}, {64, 0}, {100, 0}}, 3, 15},
		{"three prompts of 64", [][2]int{{64, 0}, {64, 0}, {64, 0}}, 3, 0},
		{"a short prompt", [][2]int{{15, 0}}, 0, 15},
		{"16 rows", [][2]int{{16, 0}}, 1, 0},
		{"16 rows across a block of positions", [][2]int{{16, 56}}, 0, 16},
	} {
		w, T := seqs(tc.seqs...)
		if tiles, rows := lay.prefillLists(w, T); tiles != tc.tiles || rows != tc.rows {
			t.Errorf("%s: prefillLists = %d tiles, %d rows; want %d, %d", tc.name, tiles, rows, tc.tiles, tc.rows)
		}
	}
	// Random steps against the definition: rows grouped by (sequence,
	// position / 64), a group of 16 rows or more a tile, the other rows
	// listed with their sequence's first position.
	rng := rand.New(rand.NewPCG(3, 4))
	for range 2000 {
		var s [][2]int
		for n, T := 0, 0; n < lay.maxSeqs; n++ {
			rows := 1 + rng.IntN(100)
			if T+rows > lay.maxTokens || n > 0 && rng.IntN(3) == 0 {
				break
			}
			s = append(s, [2]int{rows, rng.IntN(200)})
			T += rows
		}
		w, T := seqs(s...)
		var wantTiles, wantRows []int32
		for r, i := 0, 0; i < len(s); i++ {
			group := map[int][]int32{}
			var blocks []int
			for p := s[i][1]; p < s[i][1]+s[i][0]; p, r = p+1, r+1 {
				if group[p/64] == nil {
					blocks = append(blocks, p/64)
				}
				group[p/64] = append(group[p/64], int32(r))
			}
			for _, b := range blocks {
				if g := group[b]; len(g) >= 16 {
					wantTiles = append(wantTiles, g[0], g[len(g)-1])
				} else {
					for _, row := range g {
						wantRows = append(wantRows, row, int32(s[i][1]))
					}
				}
			}
		}
		tiles, rows := lay.prefillLists(w, T)
		gotTiles := w[lay.tileList() : lay.tileList()+2*tiles]
		gotRows := w[lay.rowList() : lay.rowList()+2*rows]
		if !slices.Equal(gotTiles, wantTiles) || !slices.Equal(gotRows, wantRows) {
			t.Fatalf("sequences (rows, first position) %v: tiles %v, rows %v; want %v, %v", s, gotTiles, gotRows, wantTiles, wantRows)
		}
	}
}
