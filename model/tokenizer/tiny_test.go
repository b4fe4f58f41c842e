package tokenizer

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
)

// gpt2ByteChars is the GPT-2 byte-to-character table, computed here the way
// the GPT-2 encoder.py publishes it, independently of the package's table.
func gpt2ByteChars() map[byte]rune {
	var bs []int
	for b := '!'; b <= '~'; b++ {
		bs = append(bs, int(b))
	}
	for b := '¡'; b <= '¬'; b++ {
		bs = append(bs, int(b))
	}
	for b := '®'; b <= 'ÿ'; b++ {
		bs = append(bs, int(b))
	}
	cs := slices.Clone(bs)
	n := 0
	for b := 0; b < 256; b++ {
		if !slices.Contains(bs, b) {
			bs = append(bs, b)
			cs = append(cs, 256+n)
			n++
		}
	}
	m := map[byte]rune{}
	for i, b := range bs {
		m[byte(b)] = rune(cs[i])
	}
	return m
}

func special(id int, content string) map[string]any {
	return map[string]any{"id": id, "content": content, "single_word": false, "lstrip": false,
		"rstrip": false, "normalized": false, "special": true}
}

// byteLevelJSON is a tiny tokenizer in the shape the random-init checkpoint
// writer emits (GPT-2/Llama 3 style): byte-level BPE whose byte tokens have
// ids equal to the byte, seven merges, two special tokens and a template
// that prepends <|begin_of_text|>.
func byteLevelJSON(t testing.TB, edit func(f, model map[string]any)) []byte {
	t.Helper()
	chars := gpt2ByteChars()
	vocab := map[string]int{}
	for b := 0; b < 256; b++ {
		vocab[string(chars[byte(b)])] = b
	}
	for i, tok := range []string{"he", "ll", "hell", "hello", "Ġw", "or", "Ġwor"} {
		vocab[tok] = 256 + i
	}
	model := map[string]any{
		"type": "BPE", "dropout": nil, "unk_token": nil, "continuing_subword_prefix": nil,
		"end_of_word_suffix": nil, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
		"vocab":  vocab,
		"merges": []string{"h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or"},
	}
	f := map[string]any{
		"version": "1.0", "truncation": nil, "padding": nil,
		"added_tokens": []any{special(263, "<|begin_of_text|>"), special(264, "<|end_of_text|>")},
		"normalizer":   nil,
		"pre_tokenizer": map[string]any{"type": "ByteLevel", "add_prefix_space": false,
			"trim_offsets": true, "use_regex": true},
		"post_processor": map[string]any{
			"type": "TemplateProcessing",
			"single": []any{
				map[string]any{"SpecialToken": map[string]any{"id": "<|begin_of_text|>", "type_id": 0}},
				map[string]any{"Sequence": map[string]any{"id": "A", "type_id": 0}},
			},
			"pair": []any{},
			"special_tokens": map[string]any{"<|begin_of_text|>": map[string]any{
				"id": "<|begin_of_text|>", "ids": []int{263}, "tokens": []string{"<|begin_of_text|>"}}},
		},
		"decoder": map[string]any{"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
		"model":   model,
	}
	if edit != nil {
		edit(f, model)
	}
	data, err := json.Marshal(f)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// sentencePieceJSON is a tiny Llama 2 style tokenizer: <unk>, <s>, </s>,
// the 256 byte tokens <0x00>..<0xFF> (ids 3..258), then ▁=259 h=260 i=261
// ▁h=262 ▁hi=263 !=264 and two merges.
func sentencePieceJSON(t testing.TB, edit func(f, model map[string]any)) []byte {
	t.Helper()
	vocab := map[string]int{"<unk>": 0, "<s>": 1, "</s>": 2}
	for b := 0; b < 256; b++ {
		vocab[fmt.Sprintf("<0x%02X>", b)] = 3 + b
	}
	for i, tok := range []string{"▁", "h", "i", "▁h", "▁hi", "!"} {
		vocab[tok] = 259 + i
	}
	model := map[string]any{
		"type": "BPE", "dropout": nil, "unk_token": "<unk>", "continuing_subword_prefix": nil,
		"end_of_word_suffix": nil, "fuse_unk": true, "byte_fallback": true,
		"vocab": vocab, "merges": []string{"▁ h", "▁h i"},
	}
	f := map[string]any{
		"added_tokens": []any{special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")},
		"normalizer": map[string]any{"type": "Sequence", "normalizers": []any{
			map[string]any{"type": "Prepend", "prepend": "▁"},
			map[string]any{"type": "Replace", "pattern": map[string]any{"String": " "}, "content": "▁"},
		}},
		"pre_tokenizer": nil,
		"post_processor": map[string]any{
			"type": "TemplateProcessing",
			"single": []any{
				map[string]any{"SpecialToken": map[string]any{"id": "<s>", "type_id": 0}},
				map[string]any{"Sequence": map[string]any{"id": "A", "type_id": 0}},
			},
			"special_tokens": map[string]any{"<s>": map[string]any{"id": "<s>", "ids": []int{1}, "tokens": []string{"<s>"}}},
		},
		"decoder": map[string]any{"type": "Sequence", "decoders": []any{
			map[string]any{"type": "Replace", "pattern": map[string]any{"String": "▁"}, "content": " "},
			map[string]any{"type": "ByteFallback"},
			map[string]any{"type": "Fuse"},
			map[string]any{"type": "Strip", "content": " ", "start": 1, "stop": 0},
		}},
		"model": model,
	}
	if edit != nil {
		edit(f, model)
	}
	data, err := json.Marshal(f)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

func mustParse(t testing.TB, data []byte) *Tokenizer {
	t.Helper()
	tk, err := Parse(data)
	if err != nil {
		t.Fatalf("Parse: %v", err)
	}
	return tk
}

type encodeCase struct {
	text       string
	addSpecial bool
	want       []int32
}

func checkEncode(t *testing.T, tk *Tokenizer, cases []encodeCase) {
	t.Helper()
	for _, c := range cases {
		if got := tk.Encode(c.text, c.addSpecial); !slices.Equal(got, c.want) {
			t.Errorf("Encode(%q, %v) = %v, want %v", c.text, c.addSpecial, got, c.want)
		}
	}
}

// Expected ids below are worked out by hand from the merge ranks: "hello"
// merges h+e (rank 0), l+l (1), he+ll (2), hell+o (3); " world" is spelled
// Ġworld and merges Ġ+w (4), o+r (5), Ġw+or (6), leaving l and d.
func TestByteLevelTiny(t *testing.T) {
	for _, form := range []string{"string merges", "pair merges"} {
		t.Run(form, func(t *testing.T) {
			tk := mustParse(t, byteLevelJSON(t, func(f, model map[string]any) {
				if form == "pair merges" {
					var pairs [][2]string
					for _, m := range model["merges"].([]string) {
						l, r, _ := strings.Cut(m, " ")
						pairs = append(pairs, [2]string{l, r})
					}
					model["merges"] = pairs
				}
			}))
			checkEncode(t, tk, []encodeCase{
				{"hello world", false, []int32{259, 262, 'l', 'd'}},
				{"hello world", true, []int32{263, 259, 262, 'l', 'd'}},
				{"<|end_of_text|>hello", false, []int32{264, 259}},
				{"<|end_of_text|>hello", true, []int32{263, 264, 259}},
				{"", true, []int32{263}},
				{"é\n", false, []int32{0xC3, 0xA9, '\n'}},
				{"hel", false, []int32{256, 'l'}},
			})
			ids := []int32{263, 259, 262, 'l', 'd', 0xC3, 0xA9, 264}
			if got, want := tk.Decode(ids, false), "<|begin_of_text|>hello worldé<|end_of_text|>"; got != want {
				t.Errorf("Decode = %q, want %q", got, want)
			}
			if got, want := tk.Decode(ids, true), "hello worldé"; got != want {
				t.Errorf("Decode(skipSpecial) = %q, want %q", got, want)
			}
			if got, want := tk.Decode([]int32{0xC3}, false), "\uFFFD"; got != want {
				t.Errorf("Decode(lone lead byte) = %q, want %q", got, want)
			}
			if got, want := tk.Decode([]int32{259, 9999, -1}, false), "hello"; got != want {
				t.Errorf("Decode(with unknown ids) = %q, want %q", got, want)
			}
		})
	}
}

func TestByteLevelTinyLookups(t *testing.T) {
	tk := mustParse(t, byteLevelJSON(t, nil))
	if got := tk.VocabSize(); got != 265 {
		t.Errorf("VocabSize = %d, want 265", got)
	}
	if id, ok := tk.TokenID("<|end_of_text|>"); !ok || id != 264 {
		t.Errorf("TokenID(<|end_of_text|>) = %d, %v", id, ok)
	}
	if id, ok := tk.TokenID("Ġwor"); !ok || id != 262 {
		t.Errorf("TokenID(Ġwor) = %d, %v", id, ok)
	}
	if _, ok := tk.TokenID("nope"); ok {
		t.Error("TokenID(nope) found")
	}
	if s, ok := tk.Token(259); !ok || s != "hello" {
		t.Errorf("Token(259) = %q, %v", s, ok)
	}
	for _, id := range []int32{-1, 265} {
		if _, ok := tk.Token(id); ok {
			t.Errorf("Token(%d) found", id)
		}
	}
	if !tk.IsSpecial(263) || tk.IsSpecial(259) || tk.IsSpecial(-5) {
		t.Error("IsSpecial wrong")
	}
}

// With ignore_merges a word that is itself in the vocabulary is one token
// even when no merge sequence builds it.
func TestIgnoreMerges(t *testing.T) {
	for _, ignore := range []bool{false, true} {
		tk := mustParse(t, byteLevelJSON(t, func(f, model map[string]any) {
			// Without added tokens, so that "lo" can take the next id.
			f["added_tokens"], f["post_processor"] = []any{}, nil
			model["vocab"].(map[string]int)["lo"] = 263
			model["ignore_merges"] = ignore
		}))
		want := []int32{'l', 'o'}
		if ignore {
			want = []int32{263}
		}
		if got := tk.Encode("lo", false); !slices.Equal(got, want) {
			t.Errorf("ignore_merges=%v: Encode(lo) = %v, want %v", ignore, got, want)
		}
	}
}

func TestSentencePieceTiny(t *testing.T) {
	tk := mustParse(t, sentencePieceJSON(t, nil))
	checkEncode(t, tk, []encodeCase{
		// "▁hi▁hi!": ▁+h at both places (rank 0), then ▁h+i (rank 1).
		{"hi hi!", true, []int32{1, 263, 263, 264}},
		{"hi hi!", false, []int32{263, 263, 264}},
		// é is not in the vocabulary: its bytes C3 A9 fall back to
		// <0xC3> = 3+0xC3 and <0xA9> = 3+0xA9.
		{"hé", false, []int32{262, 3 + 0xC3, 3 + 0xA9}},
		// Each stretch between added tokens gets its own ▁.
		{"hi</s>hi", false, []int32{263, 2, 263}},
		{"", false, nil},
	})
	ids := []int32{1, 262, 3 + 0xC3, 3 + 0xA9, 263}
	if got, want := tk.Decode(ids, false), "<s> hé hi"; got != want {
		t.Errorf("Decode = %q, want %q", got, want)
	}
	if got, want := tk.Decode(ids, true), "hé hi"; got != want {
		t.Errorf("Decode(skipSpecial) = %q, want %q", got, want)
	}
	// A byte run that is not UTF-8 becomes one U+FFFD per byte.
	if got, want := tk.Decode([]int32{263, 3 + 0xC3, 3 + 0x41, 260}, false), "hi\uFFFD\uFFFDh"; got != want {
		t.Errorf("Decode(bad bytes) = %q, want %q", got, want)
	}
}

func TestUnknownTokens(t *testing.T) {
	for _, fuse := range []bool{true, false} {
		tk := mustParse(t, sentencePieceJSON(t, func(f, model map[string]any) {
			model["byte_fallback"] = false
			model["fuse_unk"] = fuse
		}))
		// ▁hxyh: x and y are unknown; fused they make one <unk>.
		want := []int32{262, 0, 0, 260}
		if fuse {
			want = []int32{262, 0, 260}
		}
		if got := tk.Encode("hxyh", false); !slices.Equal(got, want) {
			t.Errorf("fuse_unk=%v: Encode(hxyh) = %v, want %v", fuse, got, want)
		}
	}
}

// Metaspace with prepend_scheme "first" puts ▁ only in front of the start
// of the input, not after an added token.
func TestMetaspaceTiny(t *testing.T) {
	tk := mustParse(t, sentencePieceJSON(t, func(f, model map[string]any) {
		f["normalizer"] = nil
		f["pre_tokenizer"] = map[string]any{"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true}
		f["decoder"] = map[string]any{"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true}
	}))
	checkEncode(t, tk, []encodeCase{
		{"hi hi", false, []int32{263, 263}},
		{"<s>hi", false, []int32{1, 260, 261}},
		{"<s> hi", false, []int32{1, 263}},
	})
	if got, want := tk.Decode([]int32{263, 263}, false), "hi hi"; got != want {
		t.Errorf("Decode = %q, want %q", got, want)
	}
}

// Metaspace with split true cuts the text at every replaced space, so
// merges stop there; with split false the text stays one word and a merge
// across a space ("i ▁", ranked first here) applies.
func TestMetaspaceSplit(t *testing.T) {
	for _, split := range []bool{true, false} {
		tk := mustParse(t, sentencePieceJSON(t, func(f, model map[string]any) {
			model["vocab"].(map[string]int)["i▁"] = 265
			model["merges"] = []string{"i ▁", "▁ h", "▁h i"}
			f["normalizer"] = nil
			f["pre_tokenizer"] = map[string]any{"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": split}
			f["decoder"] = map[string]any{"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": split}
		}))
		want := []int32{263, 263} // ▁hi ▁hi
		if !split {
			want = []int32{262, 265, 260, 261} // ▁h i▁ h i
		}
		checkEncode(t, tk, []encodeCase{{"hi hi", false, want}})
		if got := tk.Decode(want, false); got != "hi hi" {
			t.Errorf("split %v: Decode = %q, want %q", split, got, "hi hi")
		}
	}
}

func TestAddedTokenFlags(t *testing.T) {
	tk := mustParse(t, byteLevelJSON(t, func(f, model map[string]any) {
		f["added_tokens"] = append(f["added_tokens"].([]any),
			map[string]any{"id": 265, "content": "<mask>", "lstrip": true, "rstrip": true, "normalized": false},
			map[string]any{"id": 266, "content": "hi", "single_word": true, "normalized": false},
			map[string]any{"id": 267, "content": "[x]", "normalized": false},
		)
	}))
	checkEncode(t, tk, []encodeCase{
		// lstrip and rstrip take the spaces on both sides into the token.
		{"a <mask>  b", false, []int32{'a', 265, 'b'}},
		// Without them the spaces stay as text (Ġ is byte 32).
		{"a [x] b", false, []int32{'a', ' ', 267, ' ', 'b'}},
		// single_word: only where no word character touches it.
		{"hi there", false, []int32{266, ' ', 't', 256, 'r', 'e'}},
		{"this", false, []int32{'t', 'h', 'i', 's'}},
		{"(hi)", false, []int32{'(', 266, ')'}},
	})
	if got := tk.Decode([]int32{'a', 265, 'b'}, false); got != "a<mask>b" {
		t.Errorf("Decode = %q", got)
	}
}

// A normalized added token is matched in normalized text, its pattern
// normalized too.
func TestNormalizedAddedToken(t *testing.T) {
	tk := mustParse(t, byteLevelJSON(t, func(f, model map[string]any) {
		f["normalizer"] = map[string]any{"type": "Lowercase"}
		f["added_tokens"] = append(f["added_tokens"].([]any),
			map[string]any{"id": 265, "content": "WORLD", "normalized": true})
	}))
	checkEncode(t, tk, []encodeCase{
		{"Hello World", false, []int32{259, ' ', 265}},
		{"HELLO", false, []int32{259}},
	})
}

func TestPostProcessors(t *testing.T) {
	roberta := map[string]any{"type": "RobertaProcessing", "sep": []any{"<|end_of_text|>", 264},
		"cls": []any{"<|begin_of_text|>", 263}, "trim_offsets": true, "add_prefix_space": false}
	seq := map[string]any{"type": "Sequence", "processors": []any{
		map[string]any{"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
		roberta,
	}}
	for name, post := range map[string]any{"Roberta": roberta, "Sequence": seq} {
		tk := mustParse(t, byteLevelJSON(t, func(f, model map[string]any) { f["post_processor"] = post }))
		if got, want := tk.Encode("hello", true), []int32{263, 259, 264}; !slices.Equal(got, want) {
			t.Errorf("%s: Encode = %v, want %v", name, got, want)
		}
		if got, want := tk.Encode("hello", false), []int32{259}; !slices.Equal(got, want) {
			t.Errorf("%s: Encode without specials = %v, want %v", name, got, want)
		}
	}
}
