package cuda

import (
	"strings"
	"testing"

	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/stage"
)

func decodeKey(n int) graphs.Step {
	return graphs.Step{Mode: graphs.Full, Desc: graphs.BatchDescriptor{NumTokens: n, NumReqs: n, UniformDecode: true, QueryLen: 1}}
}

func mixedKey(m graphs.Mode, n int) graphs.Step {
	return graphs.Step{Mode: m, Desc: graphs.BatchDescriptor{NumTokens: n}}
}

func TestKeyShape(t *testing.T) {
	// maxTokens 40, maxSeqs 4, maxLogitRows 8.
	last, _ := newTestPlanner(true, true)
	mid, _ := newTestPlanner(false, false)
	spec := graphs.Step{Mode: graphs.Full, Desc: graphs.BatchDescriptor{NumTokens: 6, NumReqs: 3, UniformDecode: true, QueryLen: 2}}
	tests := []struct {
		pl   *planner
		k    graphs.Step
		want shape
	}{
		{last, decodeKey(1), shape{tokens: 1, rows: 1, sampled: 1, decode: true}},
		{last, decodeKey(4), shape{tokens: 4, rows: 4, sampled: 4, decode: true}},
		{last, spec, shape{tokens: 6, rows: 6, sampled: 3}},
		{last, mixedKey(graphs.Piecewise, 2), shape{tokens: 2, rows: 2, sampled: 2}},
		{last, mixedKey(graphs.Piecewise, 16), shape{tokens: 16, rows: 8, sampled: 4}},
		{last, mixedKey(graphs.Full, 40), shape{tokens: 40, rows: 8, sampled: 4}},
		{mid, decodeKey(4), shape{tokens: 4, rows: 0, sampled: 0, decode: true}},
		{mid, mixedKey(graphs.Piecewise, 16), shape{tokens: 16, rows: 0, sampled: 0}},
	}
	for _, tc := range tests {
		if got := tc.pl.keyShape(tc.k); got != tc.want {
			t.Errorf("last=%v keyShape(%s) = %+v, want %+v", tc.pl.last, tc.k, got, tc.want)
		}
	}
}

func TestCaptureOrder(t *testing.T) {
	pl, _ := newTestPlanner(true, true)
	keys := []graphs.Step{decodeKey(1), mixedKey(graphs.Piecewise, 8), decodeKey(4), mixedKey(graphs.Piecewise, 40), mixedKey(graphs.Full, 8)}
	order, err := pl.captureOrder(keys)
	if err != nil {
		t.Fatal(err)
	}
	want := []graphs.Step{keys[3], keys[1], keys[4], keys[2], keys[0]}
	for i := range want {
		if order[i] != want[i] {
			t.Fatalf("capture order %v, want %v", order, want)
		}
	}
	bad := []struct {
		k    graphs.Step
		want string
	}{
		{mixedKey(graphs.None, 8), "captures no graphs"},
		{mixedKey(graphs.FullAndPiecewise, 8), "captures no graphs"},
		{mixedKey(graphs.Piecewise, 0), "0 tokens"},
		{mixedKey(graphs.Piecewise, 41), "the stage takes 1 to 40"},
		{graphs.Step{Mode: graphs.Piecewise, Desc: graphs.BatchDescriptor{NumTokens: 4, NumReqs: 4}}, "only its token count"},
		{graphs.Step{Mode: graphs.Piecewise, Desc: graphs.BatchDescriptor{NumTokens: 4, NumReqs: 4, UniformDecode: true, QueryLen: 1}}, "token count alone"},
		{graphs.Step{Mode: graphs.Full, Desc: graphs.BatchDescriptor{NumTokens: 4, NumReqs: 3, UniformDecode: true, QueryLen: 1}}, "are not 4 tokens"},
		{decodeKey(8), "at most 4"},
	}
	for _, tc := range bad {
		if _, err := pl.captureOrder([]graphs.Step{decodeKey(1), tc.k}); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("captureOrder with %s: error %v, want one containing %q", tc.k, err, tc.want)
		}
	}
	if _, err := pl.captureOrder([]graphs.Step{decodeKey(2), decodeKey(2)}); err == nil || !strings.Contains(err.Error(), "twice") {
		t.Errorf("a repeated key: error %v", err)
	}
}

// TestPad checks that padding rows of a replayed graph read and write only
// the scratch KV row and ask for nothing, and that the batch's own rows are
// untouched.
func TestPad(t *testing.T) {
	pl, p := newTestPlanner(true, true)
	lay := pl.lay
	for i := range p.words {
		p.words[i] = -7 // left over from earlier batches
	}
	b := &stage.Batch{ID: 1, Seqs: []stage.Seq{
		{ID: 1, Tokens: toks(2), Blocks: []int32{5}, Sample: true, Sampling: stage.Sampling{Temperature: 1, Logprobs: 3}},
		{ID: 2, Tokens: toks(1), Blocks: []int32{2}, Logits: true},
	}}
	if err := pl.build(b, p); err != nil {
		t.Fatal(err)
	}
	own := append([]int32(nil), p.words...)
	sh := pl.keyShape(mixedKey(graphs.Piecewise, 8))
	pl.pad(p, sh)
	scratch := int32(12 * 4) // past 12 blocks of 4 rows
	if pl.kv.scratch() != int(scratch) {
		t.Fatalf("scratch row %d, want %d", pl.kv.scratch(), scratch)
	}
	for r := 0; r < lay.maxTokens; r++ {
		for _, part := range []struct {
			off  int
			want int32
		}{{lay.tokens(), 0}, {lay.pos(), 0}, {lay.cacheRow(), scratch}, {lay.tableOff(), 0}} {
			got := p.words[part.off+r]
			switch {
			case r < p.tokens && got != own[part.off+r]:
				t.Errorf("row %d of the batch changed: %d, was %d", r, got, own[part.off+r])
			case r >= p.tokens && r < sh.tokens && got != part.want:
				t.Errorf("padding row %d at offset %d = %d, want %d", r, part.off, got, part.want)
			case r >= sh.tokens && got != -7:
				t.Errorf("row %d past the shape was written: %d", r, got)
			}
		}
	}
	if p.rows != 2 || sh.rows != 8 {
		t.Fatalf("rows %d, shape rows %d; want 2 and 8", p.rows, sh.rows)
	}
	for r := p.rows; r < sh.rows; r++ {
		if got := p.words[lay.logitRows()+r]; got != 0 {
			t.Errorf("padding logits row %d reads token row %d, want 0", r, got)
		}
	}
	if p.nSampled != 1 || sh.sampled != 4 {
		t.Fatalf("sampled %d, shape %d; want 1 and 4", p.nSampled, sh.sampled)
	}
	for i := 0; i < lay.maxSeqs; i++ {
		q := p.words[lay.sample()+sampleParams*i : lay.sample()+sampleParams*(i+1)]
		for j, v := range q {
			switch {
			case i < p.nSampled && v != own[lay.sample()+sampleParams*i+j]:
				t.Errorf("sample params of sequence %d changed", i)
			case i >= p.nSampled && i < sh.sampled && v != 0:
				t.Errorf("padding sample entry %d: params %v, want zeros (greedy from row 0, no alternatives)", i, q)
			}
		}
	}
	pl.padding(p, shape{tokens: 4, rows: 2, sampled: 2, decode: true})
	if p.tokens != 0 || p.rows != 0 || p.nSampled != 0 || p.tableWords != 1 || p.words[lay.cacheRow()] != scratch || p.words[lay.cacheRow()+3] != scratch {
		t.Errorf("padding-only plan: tokens %d rows %d sampled %d, first cache rows %v", p.tokens, p.rows, p.nSampled, p.words[lay.cacheRow():lay.cacheRow()+4])
	}
}

func TestGraphInputsCheck(t *testing.T) {
	at := graphInputs{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	if err := at.check(at); err != nil {
		t.Fatal(err)
	}
	for i := range at {
		now := at
		now[i] += 256
		err := at.check(now)
		if err == nil || !strings.Contains(err.Error(), graphInputNames[i]) {
			t.Errorf("moved %s: error %v", graphInputNames[i], err)
		}
	}
}
