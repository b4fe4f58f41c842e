package tokenizer

import (
	"encoding/json"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// fuzzTokenizer is a tokenizer under fuzzing and what a round trip through
// it must give back.
type fuzzTokenizer struct {
	name string
	tk   *Tokenizer
	// roundTrip returns the text Decode(Encode(text)) must equal, or false
	// when the tokenizer does not promise one for this text and these ids.
	roundTrip func(text string, ids []int32) (string, bool)
}

// fuzzTokenizers returns the tiny tokenizers and, when the shared data is
// present, the real ones.
func fuzzTokenizers(t testing.TB) []fuzzTokenizer {
	byteLevel := func(text string, _ []int32) (string, bool) { return text, utf8.ValidString(text) }
	// SentencePiece-style files turn spaces into ▁ and back and start each
	// stretch between added tokens with one: text round-trips when it has
	// no ▁ of its own and no added token.
	sentencePiece := func(tk *Tokenizer) func(string, []int32) (string, bool) {
		return func(text string, ids []int32) (string, bool) {
			return text, utf8.ValidString(text) && !strings.Contains(text, "▁") && !hasAdded(tk, ids)
		}
	}
	tinySP := mustParse(t, sentencePieceJSON(t, nil))
	out := []fuzzTokenizer{
		{"tiny byte-level", mustParse(t, byteLevelJSON(t, nil)), byteLevel},
		{"tiny sentencepiece", tinySP, sentencePiece(tinySP)},
	}
	if _, err := os.Stat(filepath.Join(sharedDir(), "tokenizers", "reference.json")); err != nil {
		return out
	}
	qwen, llama2 := loadShared(t, "qwen3"), loadShared(t, "llama2")
	return append(out,
		fuzzTokenizer{"llama3", loadShared(t, "llama3"), byteLevel},
		fuzzTokenizer{"qwen3", qwen, func(text string, ids []int32) (string, bool) {
			// NFC applies to each stretch between added tokens.
			return norm.NFC.String(text), utf8.ValidString(text) && !hasAdded(qwen, ids)
		}},
		fuzzTokenizer{"llama2", llama2, sentencePiece(llama2)},
	)
}

// hasAdded reports whether ids hold an added token.
func hasAdded(tk *Tokenizer, ids []int32) bool {
	for _, id := range ids {
		s, _ := tk.Token(id)
		if aid, ok := tk.added[s]; ok && aid == id {
			return true
		}
	}
	return false
}

var fuzzTexts = []string{
	"", "Hello world", "hello  world\n\n", "I'm 123456 ½ naïve café",
	"<|begin_of_text|>hi<|end_of_text|>", "<s>hi</s> <unk>", "数据 مرحبا 😀 \u3000x",
	"a\u0301 e\u0338 >\u0338", "\xff\xfe broken \xe2\x82", "▁leading ▁", "\t\r\n \u00a0",
	strings.Repeat(" ", 600), strings.Repeat("\n", 300) + strings.Repeat("a", 300), strings.Repeat("\u1100\u1161\u11a8", 50),
}

func FuzzEncode(f *testing.F) {
	for _, s := range fuzzTexts {
		f.Add(s)
	}
	tks := fuzzTokenizers(f)
	f.Fuzz(func(t *testing.T, text string) {
		if len(text) > 4096 {
			return
		}
		for _, ft := range tks {
			for _, addSpecial := range []bool{false, true} {
				ids := ft.tk.Encode(text, addSpecial)
				for _, id := range ids {
					if _, ok := ft.tk.Token(id); !ok {
						t.Fatalf("%s: Encode(%q) gave unknown id %d", ft.name, text, id)
					}
				}
				for _, skip := range []bool{false, true} {
					if got, want := streamAll(t, ft.tk, ids, skip), ft.tk.Decode(ids, skip); got != want {
						t.Fatalf("%s: stream of Encode(%q) = %q, Decode = %q", ft.name, text, got, want)
					}
				}
				if addSpecial {
					continue
				}
				// Callers refuse text past MaxTextBytes of their token
				// budget unencoded: no text may encode to fewer tokens.
				if most := ft.tk.MaxTextBytes(len(ids)); len(text) > most {
					t.Fatalf("%s: Encode(%q) gives %d tokens, but MaxTextBytes(%d) = %d < %d bytes", ft.name, text, len(ids), len(ids), most, len(text))
				}
				if want, ok := ft.roundTrip(text, ids); ok {
					if got := ft.tk.Decode(ids, false); got != want {
						t.Fatalf("%s: Decode(Encode(%q)) = %q, want %q", ft.name, text, got, want)
					}
				}
			}
		}
	})
}

// FuzzStream decodes arbitrary id sequences, rich in byte tokens and
// partial characters, incrementally and in one go.
func FuzzStream(f *testing.F) {
	f.Add([]byte{0, 0xE5, 0, 0x8F, 0, 0xAB, 200, 1})
	f.Add([]byte{0, 0xF0, 0, 0x9F, 1, 2, 0, 0x98, 0, 0x80})
	f.Add([]byte{255, 255, 0, 0x20, 0, 0xC3})
	tks := fuzzTokenizers(f)
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 4096 {
			return
		}
		for _, ft := range tks {
			ids := fuzzIDs(ft.tk, data)
			for _, skip := range []bool{false, true} {
				got, want := streamAll(t, ft.tk, ids, skip), ft.tk.Decode(ids, skip)
				if got != want {
					t.Fatalf("%s skip=%v ids %v: stream = %q, Decode = %q", ft.name, skip, ids, got, want)
				}
			}
		}
	})
}

// fuzzIDs reads byte pairs as ids: a pair starting below 128 names the
// token of a single byte (its byte-level character, or <0xXX>), any other
// an id anywhere in the vocabulary (or just past it).
func fuzzIDs(tk *Tokenizer, data []byte) []int32 {
	var ids []int32
	for i := 0; i+1 < len(data); i += 2 {
		if data[i] < 128 {
			if id, ok := tk.TokenID(string(byteChar[data[i+1]])); ok {
				ids = append(ids, id)
			}
			if id, ok := tk.TokenID(byteTokenName(data[i+1])); ok {
				ids = append(ids, id)
			}
			continue
		}
		ids = append(ids, int32((int(data[i]-128)<<8|int(data[i+1]))*(tk.VocabSize()+1)/(128<<8)))
	}
	return ids
}

func byteTokenName(b byte) string {
	const hex = "0123456789ABCDEF"
	return "<0x" + string(hex[b>>4]) + string(hex[b&15]) + ">"
}

func FuzzScanners(f *testing.F) {
	for _, s := range fuzzTexts {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, text string) {
		// regexp2 backtracks quadratically over long whitespace runs.
		if len(text) <= 512 && utf8.ValidString(text) {
			checkScanners(t, text)
		}
	})
}

func FuzzParse(f *testing.F) {
	f.Add(byteLevelJSON(f, nil))
	f.Add(sentencePieceJSON(f, nil))
	f.Add(sentencePieceJSON(f, func(file, model map[string]any) {
		file["pre_tokenizer"] = map[string]any{"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true}
	}))
	f.Add([]byte(`{"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]}}`))
	f.Add([]byte(`{"model": {"vocab": {}, "merges": []}, "added_tokens": [{"id": 0, "content": "x"}]}`))
	f.Add([]byte(`{"normalizer": {"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}, "model": {"vocab": {"\u0041": 0}, "merges": []}}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		tk, err := Parse(data)
		if err != nil {
			return
		}
		for _, text := range fuzzTexts {
			ids := tk.Encode(text, true)
			if got, want := streamAll(t, tk, ids, false), tk.Decode(ids, false); got != want {
				t.Fatalf("stream = %q, Decode = %q", got, want)
			}
		}
	})
}

// FuzzReadJSON checks the vocabulary and merges readers against
// encoding/json: whatever they accept, encoding/json reads the same way.
func FuzzReadJSON(f *testing.F) {
	f.Add([]byte(`{"a": 1, "b\u00e9": -2, "a": 3}`))
	f.Add([]byte(` { } `))
	f.Add([]byte(`{"\ud83d\ude00": 2147483647, "x": 0}`))
	f.Add([]byte(`["a b", ["c", "d e"], "\u0120 x"]`))
	f.Add([]byte(`{"k": 01}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		if v, err := readVocab(data); err == nil {
			var want map[string]int32
			if err := json.Unmarshal(data, &want); err != nil {
				t.Fatalf("readVocab accepted %q, encoding/json: %v", data, err)
			}
			if !maps.Equal(v, want) {
				t.Fatalf("readVocab(%q) = %v, encoding/json %v", data, v, want)
			}
		} else if std := map[string]int32{}; json.Unmarshal(data, &std) == nil && !strings.Contains(string(data), "null") {
			t.Fatalf("readVocab rejected %q (%v), encoding/json accepts it", data, err)
		}
		if m, err := readMerges(data); err == nil {
			var items []any
			if err := json.Unmarshal(data, &items); err != nil {
				t.Fatalf("readMerges accepted %q, encoding/json: %v", data, err)
			}
			var want [][2]string
			for _, it := range items {
				switch it := it.(type) {
				case string:
					l, r, _ := strings.Cut(it, " ")
					want = append(want, [2]string{l, r})
				case []any:
					want = append(want, [2]string{it[0].(string), it[1].(string)})
				}
			}
			if !slices.Equal(m, want) {
				t.Fatalf("readMerges(%q) = %q, encoding/json %q", data, m, want)
			}
		}
	})
}

// Encoding from many goroutines at once gives the same ids as encoding
// alone (run with -race to check the shared word cache).
func TestConcurrentEncode(t *testing.T) {
	for _, ft := range fuzzTokenizers(t) {
		texts := slices.Clone(fuzzTexts)
		for i := range 200 {
			texts = append(texts, strings.Repeat("hello world ", i%7)+fuzzTexts[i%len(fuzzTexts)])
		}
		want := make([][]int32, len(texts))
		for i, s := range texts {
			want[i] = ft.tk.Encode(s, true)
		}
		var wg sync.WaitGroup
		for g := range 4 {
			wg.Go(func() {
				for i := range texts {
					k := (i*7 + g) % len(texts)
					if got := ft.tk.Encode(texts[k], true); !slices.Equal(got, want[k]) {
						t.Errorf("%s: concurrent Encode(%q) = %v, want %v", ft.name, texts[k], got, want[k])
						return
					}
				}
			})
		}
		wg.Wait()
	}
}
