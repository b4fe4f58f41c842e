package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/tandem-llm/tandem/model"
)

func run(t *testing.T, stdin string, args ...string) (string, error) {
	t.Helper()
	cmd := newRootCmd()
	var out bytes.Buffer
	cmd.SetArgs(args)
	cmd.SetIn(strings.NewReader(stdin))
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	err := cmd.Execute()
	return out.String(), err
}

// TestModelInitAndTokenize writes a checkpoint with model init, reads it
// back as a model, and round-trips text through its tokenizer with the
// tokenize command.
func TestModelInitAndTokenize(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "m")
	if _, err := run(t, "", "model", "init", "--out", dir, "--layers", "3", "--hidden", "32", "--heads", "4", "--kv-heads", "1", "--intermediate", "64", "--vocab", "300", "--seed", "9"); err != nil {
		t.Fatal(err)
	}
	ckpt, err := model.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	cfg := ckpt.Config()
	ckpt.Close()
	if cfg.NumLayers != 3 || cfg.HiddenSize != 32 || cfg.NumKVHeads != 1 || cfg.VocabSize != 300 {
		t.Fatalf("config %+v does not match the flags", cfg)
	}
	tok := filepath.Join(dir, "tokenizer.json")
	texts := []string{"Hello, world!", "  spaces\tand\nnewlines ", "héllo ✓ 日本"}
	in, _ := json.Marshal(texts)
	out, err := run(t, string(in), "tokenize", "--tokenizer", tok)
	if err != nil {
		t.Fatal(err)
	}
	var ids [][]int32
	if err := json.Unmarshal([]byte(out), &ids); err != nil {
		t.Fatalf("tokenize printed %q: %v", out, err)
	}
	for i, seq := range ids {
		if len(seq) == 0 || int(seq[0]) != cfg.BOS {
			t.Errorf("text %d: ids %v do not start with BOS %d", i, seq, cfg.BOS)
		}
	}
	back, _ := json.Marshal(ids)
	out, err = run(t, string(back), "tokenize", "--tokenizer", tok, "--decode", "--no-special")
	if err != nil {
		t.Fatal(err)
	}
	var decoded []string
	if err := json.Unmarshal([]byte(out), &decoded); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(decoded, texts) {
		t.Errorf("decode(encode(x)) = %q, want %q", decoded, texts)
	}
}

// TestTokenizeReference checks the command against Hugging Face's own
// output for the Llama 3 tokenizer in ../shared (skipped without it).
func TestTokenizeReference(t *testing.T) {
	shared := filepath.Join("..", "..", "..", "shared", "tokenizers")
	if s := os.Getenv("TANDEM_SHARED"); s != "" {
		shared = filepath.Join(s, "tokenizers")
	}
	data, err := os.ReadFile(filepath.Join(shared, "reference.json"))
	if err != nil {
		t.Skipf("no shared tokenizer reference (%v): skipping", err)
	}
	var ref struct {
		Tokenizers map[string][]struct {
			Text               string  `json:"text"`
			IDs                []int32 `json:"ids"`
			IDsNoSpecial       []int32 `json:"ids_no_special"`
			Decoded            string  `json:"decoded"`
			DecodedSkipSpecial string  `json:"decoded_skip_special"`
		} `json:"tokenizers"`
	}
	if err := json.Unmarshal(data, &ref); err != nil {
		t.Fatal(err)
	}
	cases := ref.Tokenizers["llama3"][:50]
	var texts []string
	for _, c := range cases {
		texts = append(texts, c.Text)
	}
	// tokenize runs tandemctl tokenize on in (as JSON) with the llama3 file
	// and flags, decodes its output into out and returns it raw.
	tokenize := func(in any, noSpecial bool, out any, flags ...string) string {
		t.Helper()
		stdin, _ := json.Marshal(in)
		args := append([]string{"tokenize", "--tokenizer", filepath.Join(shared, "llama3.json")}, flags...)
		if noSpecial {
			args = append(args, "--no-special")
		}
		raw, err := run(t, string(stdin), args...)
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal([]byte(raw), out); err != nil {
			t.Fatal(err)
		}
		return raw
	}
	for _, noSpecial := range []bool{false, true} {
		var ids [][]int32
		tokenize(texts, noSpecial, &ids)
		for i, c := range cases {
			want := c.IDs
			if noSpecial {
				want = c.IDsNoSpecial
			}
			if !slices.Equal(ids[i], want) {
				t.Errorf("case %d (no-special %v): %v, want %v", i, noSpecial, ids[i], want)
			}
		}
	}
	// --decode turns the reference ids back into the reference texts, with
	// special tokens spelled out (and not HTML-escaped) or skipped.
	var seqs [][]int32
	for _, c := range cases {
		seqs = append(seqs, c.IDs)
	}
	for _, noSpecial := range []bool{false, true} {
		var decoded []string
		out := tokenize(seqs, noSpecial, &decoded, "--decode")
		if !noSpecial && (strings.Contains(out, `\u003c`) || !strings.Contains(out, "<|")) {
			t.Errorf("decoded texts do not show special tokens such as <|eot_id|> as they are: %.200s", out)
		}
		for i, c := range cases {
			want := c.Decoded
			if noSpecial {
				want = c.DecodedSkipSpecial
			}
			if decoded[i] != want {
				t.Errorf("decode case %d (no-special %v): %q, want %q", i, noSpecial, decoded[i], want)
			}
		}
	}
}

func TestTokenizeBadInput(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "m")
	if _, err := run(t, "", "model", "init", "--out", dir); err != nil {
		t.Fatal(err)
	}
	tok := filepath.Join(dir, "tokenizer.json")
	for _, tc := range []struct{ stdin, want string }{
		{`{"not": "an array"}`, "want a JSON array of strings"},
		{`[[1, 99999]]`, "outside the vocabulary"},
		{`["a"] ["b"]`, "more input after the JSON array"},
		{`[[1]] x`, "more input after the JSON array"},
	} {
		args := []string{"tokenize", "--tokenizer", tok}
		if strings.HasPrefix(tc.stdin, "[[") {
			args = append(args, "--decode")
		}
		if _, err := run(t, tc.stdin, args...); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("stdin %s: error %v, want %q", tc.stdin, err, tc.want)
		}
	}
	if _, err := run(t, "[]", "tokenize", "--tokenizer", filepath.Join(dir, "missing.json")); err == nil || !strings.Contains(err.Error(), "missing.json") {
		t.Errorf("missing tokenizer file: error %v, want one naming the file", err)
	}
}

// TestAddrHelp: --addr's help names its default once: the environment,
// else the built-in address (pflag added its own "(default ...)" beside
// ours).
func TestAddrHelp(t *testing.T) {
	t.Setenv(addrEnv, "10.1.2.3:7400")
	out, err := run(t, "", "status", "--help")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(out, "\n") {
		if strings.Contains(line, "--addr") && (strings.Count(line, "default") != 1 || !strings.Contains(line, "$TANDEM_ADDR, else 127.0.0.1:7400")) {
			t.Errorf("--addr help: %q, want one default naming $TANDEM_ADDR and 127.0.0.1:7400", line)
		}
	}
}
