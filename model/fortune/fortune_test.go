package fortune_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/fortune"
	"github.com/tandem-llm/tandem/model/tokenizer"
)

// golden is testdata/golden.json, recorded by scripts/train-fortune/train.py
// with transformers and the tokenizers library.
type golden struct {
	Greedy []struct {
		Prompt    string  `json:"prompt"`
		PromptIDs []int32 `json:"prompt_ids"`
		IDs       []int32 `json:"ids"`
	} `json:"greedy"`
	Tokenizer []struct {
		Text    string  `json:"text"`
		IDs     []int32 `json:"ids"`
		Decoded string  `json:"decoded"`
	} `json:"tokenizer"`
}

func loadGolden(t *testing.T) golden {
	t.Helper()
	b, err := os.ReadFile("testdata/golden.json")
	if err != nil {
		t.Fatal(err)
	}
	var g golden
	if err := json.Unmarshal(b, &g); err != nil {
		t.Fatal(err)
	}
	if len(g.Greedy) == 0 || len(g.Tokenizer) == 0 {
		t.Fatal("golden.json holds no cases")
	}
	return g
}

// TestWrite writes the embedded checkpoint and opens it as the daemon
// does: every tensor of the whole model is there with its shape.
func TestWrite(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "m")
	if err := fortune.Write(dir); err != nil {
		t.Fatal(err)
	}
	want := []string{"README.md", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
	if got := fortune.Files(); !slices.Equal(got, want) {
		t.Fatalf("files %v, want %v", got, want)
	}
	var n int64
	for _, f := range want {
		fi, err := os.Stat(filepath.Join(dir, f))
		if err != nil {
			t.Fatal(err)
		}
		n += fi.Size()
	}
	if n != fortune.Size() {
		t.Errorf("wrote %d bytes, Size says %d", n, fortune.Size())
	}
	ck, err := model.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	cfg := ck.Config()
	if cfg.NumLayers != 6 || cfg.HiddenSize != 256 || cfg.VocabSize != 4096 || !cfg.TieEmbedding {
		t.Errorf("config %+v: want 6 layers, hidden 256, vocabulary 4096, tied embeddings", cfg)
	}
	if err := ck.CheckLayers(0, cfg.NumLayers, true, true); err != nil {
		t.Fatal(err)
	}
}

// TestTokenizer checks that tandem's tokenizer gives the ids and decoded
// text the Hugging Face tokenizers library gave when the model was
// trained, for the golden texts and every greedy prompt.
func TestTokenizer(t *testing.T) {
	g := loadGolden(t)
	dir := filepath.Join(t.TempDir(), "m")
	if err := fortune.Write(dir); err != nil {
		t.Fatal(err)
	}
	tok, err := tokenizer.Load(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range g.Tokenizer {
		if got := tok.Encode(c.Text, true); !slices.Equal(got, c.IDs) {
			t.Errorf("Encode(%q) = %v, Hugging Face %v", c.Text, got, c.IDs)
		}
		if got := tok.Decode(c.IDs, true); got != c.Decoded {
			t.Errorf("Decode(%v) = %q, Hugging Face %q", c.IDs, got, c.Decoded)
		}
	}
	for _, c := range g.Greedy {
		if got := tok.Encode(c.Prompt, true); !slices.Equal(got, c.PromptIDs) {
			t.Errorf("Encode(%q) = %v, Hugging Face %v", c.Prompt, got, c.PromptIDs)
		}
	}
}
