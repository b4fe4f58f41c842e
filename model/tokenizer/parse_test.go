package tokenizer

import (
	"strings"
	"testing"
)

// Every component the package does not implement, and every inconsistency
// between the parts of a file, is a Parse error that names the culprit.
func TestParseErrors(t *testing.T) {
	cases := []struct {
		name string
		edit func(f, model map[string]any)
		want string
	}{
		{"normalizer", func(f, m map[string]any) { f["normalizer"] = map[string]any{"type": "BertNormalizer"} }, `normalizer type "BertNormalizer"`},
		{"nested normalizer", func(f, m map[string]any) {
			f["normalizer"] = map[string]any{"type": "Sequence", "normalizers": []any{map[string]any{"type": "NFC"}, map[string]any{"type": "Precompiled"}}}
		}, `Sequence item 1: unsupported normalizer type "Precompiled"`},
		{"pre_tokenizer", func(f, m map[string]any) { f["pre_tokenizer"] = map[string]any{"type": "Whitespace"} }, `pre_tokenizer type "Whitespace"`},
		{"split behavior", func(f, m map[string]any) {
			f["pre_tokenizer"] = map[string]any{"type": "Split", "pattern": map[string]any{"String": "x"}, "behavior": "Sideways"}
		}, `behavior "Sideways"`},
		{"split pattern", func(f, m map[string]any) {
			f["pre_tokenizer"] = map[string]any{"type": "Split", "pattern": map[string]any{}, "behavior": "Isolated"}
		}, "exactly one of String and Regex"},
		{"bad regex", func(f, m map[string]any) {
			f["pre_tokenizer"] = map[string]any{"type": "Split", "pattern": map[string]any{"Regex": "(x"}, "behavior": "Isolated"}
		}, "compile regex"},
		{"decoder", func(f, m map[string]any) { f["decoder"] = map[string]any{"type": "WordPiece"} }, `decoder type "WordPiece"`},
		{"post_processor", func(f, m map[string]any) { f["post_processor"] = map[string]any{"type": "Unknown"} }, `post_processor type "Unknown"`},
		{"template special", func(f, m map[string]any) {
			f["post_processor"] = map[string]any{"type": "TemplateProcessing", "single": []any{
				map[string]any{"SpecialToken": map[string]any{"id": "[CLS]"}},
				map[string]any{"Sequence": map[string]any{"id": "A"}}}}
		}, `special token "[CLS]"`},
		{"model", func(f, m map[string]any) { m["type"] = "WordPiece" }, `model type "WordPiece"`},
		{"dropout", func(f, m map[string]any) { m["dropout"] = 0.1 }, "dropout"},
		{"unk", func(f, m map[string]any) { m["unk_token"] = "<unk>" }, `unk_token "<unk>"`},
		{"sparse ids", func(f, m map[string]any) { m["vocab"].(map[string]int)["far"] = 1 << 30 }, `token "far" has id 1073741824`},
		{"negative id", func(f, m map[string]any) { m["vocab"].(map[string]int)["neg"] = -1 }, `token "neg" has id -1`},
		{"merge", func(f, m map[string]any) { m["merges"] = []string{"h e", "日 e"} }, `merge 1 ("日" "e"): "日" is not in the vocabulary`},
		{"merge result", func(f, m map[string]any) { m["merges"] = []string{"h o"} }, `result "ho"`},
		{"merge shape", func(f, m map[string]any) { m["merges"] = []string{"h e l"} }, "one space"},
		{"added id", func(f, m map[string]any) { f["added_tokens"] = []any{special(300, "<|begin_of_text|>")} }, "has id 300, but the vocabulary gives it id 263"},
		{"metaspace", func(f, m map[string]any) {
			f["decoder"] = map[string]any{"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "add_prefix_space": false}
		}, "contradicts"},
		{"strip", func(f, m map[string]any) { f["decoder"] = map[string]any{"type": "Strip", "content": "ab", "start": 1} }, "not one character"},
	}
	for _, c := range cases {
		_, err := Parse(byteLevelJSON(t, c.edit))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: Parse error = %v, want one containing %q", c.name, err, c.want)
		}
	}
}

func TestParseMalformed(t *testing.T) {
	good := string(byteLevelJSON(t, nil))
	for name, data := range map[string]string{
		"empty":         "",
		"not an object": "[]",
		"truncated":     good[:len(good)/2],
		"trailing":      good + "x",
		"no model":      `{"added_tokens": []}`,
		"bad vocab id":  strings.Replace(good, `"Ġwor":262`, `"Ġwor":2.5`, 1),
		"bad key":       `{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "extra": [1,}`,
	} {
		if _, err := Parse([]byte(data)); err == nil {
			t.Errorf("%s: Parse accepted %.60q", name, data)
		}
	}
	if _, err := Load("/nonexistent/tokenizer.json"); err == nil || !strings.Contains(err.Error(), "/nonexistent/tokenizer.json") {
		t.Errorf("Load of a missing file: %v", err)
	}
}
