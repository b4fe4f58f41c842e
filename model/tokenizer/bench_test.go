package tokenizer

import (
	"os"
	"strings"
	"testing"
)

func BenchmarkLoadLlama3(b *testing.B) {
	data, err := os.ReadFile(tokenizersPath(b, "llama3.json"))
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		if _, err := Parse(data); err != nil {
			b.Fatal(err)
		}
	}
}

// benchText is a few hundred KB of mixed text (prose, code, many scripts,
// emoji, special-token spellings) built from the reference texts.
func benchText(b *testing.B) string {
	var sb strings.Builder
	cases := loadReference(b)["llama3"]
	for sb.Len() < 300_000 {
		for _, c := range cases {
			sb.WriteString(c.Text)
			sb.WriteByte('\n')
		}
	}
	return sb.String()
}

func benchEncode(b *testing.B, name string) {
	tk := loadShared(b, name)
	text := benchText(b)
	b.SetBytes(int64(len(text)))
	for b.Loop() {
		tk.Encode(text, true)
	}
}

func BenchmarkEncodeLlama3(b *testing.B) { benchEncode(b, "llama3") }
func BenchmarkEncodeQwen3(b *testing.B)  { benchEncode(b, "qwen3") }
func BenchmarkEncodeLlama2(b *testing.B) { benchEncode(b, "llama2") }

func BenchmarkDecodeLlama3(b *testing.B) {
	tk := loadShared(b, "llama3")
	text := benchText(b)
	ids := tk.Encode(text, false)
	b.SetBytes(int64(len(text)))
	for b.Loop() {
		tk.Decode(ids, false)
	}
}

func BenchmarkStreamLlama3(b *testing.B) {
	tk := loadShared(b, "llama3")
	text := benchText(b)
	ids := tk.Encode(text, false)
	b.SetBytes(int64(len(text)))
	for b.Loop() {
		s := tk.NewStream(false)
		for _, id := range ids {
			s.Add(id)
		}
		s.Flush()
	}
}

// BenchmarkStreamInvalidBytes streams 3,600 bytes that are never valid
// UTF-8 (the token of byte 0xF8, over and over), which a stream held back
// to the end and decoded again on every token until held-back text was
// bounded (0.72 s an op on the tiny byte-level tokenizer; 7 ms after).
func BenchmarkStreamInvalidBytes(b *testing.B) {
	tk := mustParse(b, byteLevelJSON(b, nil))
	ids := tk.Encode(strings.Repeat("\xf8", 3600), false)
	for b.Loop() {
		s := tk.NewStream(false)
		for _, id := range ids {
			s.Add(id)
		}
		s.Flush()
	}
}
