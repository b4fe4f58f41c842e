package chat

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/tandem-llm/tandem/model/tokenizer"
)

func sharedTokenizer(t *testing.T, name string) *tokenizer.Tokenizer {
	t.Helper()
	p := filepath.Join(sharedDir(), "tokenizers", name)
	if _, err := os.Stat(p); err != nil {
		t.Skipf("shared tokenizer data not found (%v); set TANDEM_SHARED to the shared/ directory to run this test", err)
	}
	tok, err := tokenizer.Load(p)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// TestPromptTokensOneBOS: Llama 2's post-processor adds <s>;
// a prompt that a template rendered with it, or a raw prompt that starts
// with it, gets exactly one, and a raw prompt without it gets one.
func TestPromptTokensOneBOS(t *testing.T) {
	tok := sharedTokenizer(t, "llama2.json")
	bos, ok := tok.TokenID("<s>")
	if !ok {
		t.Fatal("no <s>")
	}
	tmpl := New("t", "{{ bos_token }}{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}", &Env{SpecialTokens: map[string]string{"bos_token": "<s>"}})
	text, err := tmpl.Render(Request{Messages: []byte(`[{"role":"user","content":"Hello"}]`)})
	if err != nil {
		t.Fatal(err)
	}
	count := func(ids []int32) int {
		n := 0
		for _, id := range ids {
			if id == bos {
				n++
			}
		}
		return n
	}
	for _, c := range []struct {
		text     string
		rendered bool
	}{{text, true}, {text, false}, {"Hello", false}} {
		ids := PromptTokens(tok, c.text, c.rendered)
		if count(ids) != 1 || ids[0] != bos {
			t.Errorf("PromptTokens(%q, rendered=%v) = %v: want one BOS, first", c.text, c.rendered, ids)
		}
	}
	// A rendered prompt is exactly the plain encoding, as Hugging Face's
	// apply_chat_template(tokenize=True) gives.
	if got, want := PromptTokens(tok, text, true), tok.Encode(text, false); !slices.Equal(got, want) {
		t.Errorf("rendered: %v, want %v", got, want)
	}
	// A raw prompt without the BOS text is what tokenizer(text) gives.
	if got, want := PromptTokens(tok, "Hello", false), tok.Encode("Hello", true); !slices.Equal(got, want) {
		t.Errorf("raw: %v, want %v", got, want)
	}
}
