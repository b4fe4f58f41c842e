package randinit

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/dlclark/regexp2"
)

// tokenizerFile is the part of tokenizer.json the tests read.
type tokenizerFile struct {
	AddedTokens []struct {
		ID      int    `json:"id"`
		Content string `json:"content"`
		Special bool   `json:"special"`
	} `json:"added_tokens"`
	PreTokenizer struct {
		Type           string `json:"type"`
		AddPrefixSpace bool   `json:"add_prefix_space"`
		UseRegex       bool   `json:"use_regex"`
	} `json:"pre_tokenizer"`
	PostProcessor struct {
		Type   string `json:"type"`
		Single []struct {
			SpecialToken *struct{ ID string } `json:"SpecialToken"`
			Sequence     *struct{ ID string } `json:"Sequence"`
		} `json:"single"`
		SpecialTokens map[string]struct {
			IDs []int `json:"ids"`
		} `json:"special_tokens"`
	} `json:"post_processor"`
	Decoder struct {
		Type string `json:"type"`
	} `json:"decoder"`
	Model struct {
		Type   string         `json:"type"`
		Vocab  map[string]int `json:"vocab"`
		Merges []string       `json:"merges"`
	} `json:"model"`
}

func readTokenizer(t *testing.T, dir string) *tokenizerFile {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		t.Fatal(err)
	}
	var tf tokenizerFile
	if err := json.Unmarshal(data, &tf); err != nil {
		t.Fatal(err)
	}
	return &tf
}

// gpt2Bytes is GPT-2's byte-to-unicode table, built here the way the GPT-2
// encoder describes it: the 188 printable bytes keep their code point, the
// other 68 take 256, 257, ... in byte order.
func gpt2Bytes() map[byte]string {
	m := map[byte]string{}
	for _, r := range [][2]int{{'!', '~'}, {0xa1, 0xac}, {0xae, 0xff}} {
		for b := r[0]; b <= r[1]; b++ {
			m[byte(b)] = string(rune(b))
		}
	}
	n := 0
	for b := 0; b < 256; b++ {
		if _, ok := m[byte(b)]; !ok {
			m[byte(b)] = string(rune(256 + n))
			n++
		}
	}
	return m
}

// refBPE encodes text with the classic GPT-2 algorithm (merge the
// lowest-ranked adjacent pair until none applies), read from tokenizer.json.
type refBPE struct {
	vocab map[string]int
	ranks map[[2]string]int
	bytes map[byte]string
	split *regexp2.Regexp
}

func newRefBPE(t *testing.T, tf *tokenizerFile) *refBPE {
	r := &refBPE{
		vocab: tf.Model.Vocab,
		ranks: map[[2]string]int{},
		bytes: gpt2Bytes(),
		split: regexp2.MustCompile(`'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`, regexp2.Unicode),
	}
	for i, m := range tf.Model.Merges {
		parts := strings.Split(m, " ")
		if len(parts) != 2 {
			t.Fatalf("merge %d %q is not two tokens", i, m)
		}
		r.ranks[[2]string{parts[0], parts[1]}] = i
	}
	return r
}

func (r *refBPE) encode(t *testing.T, text string) []int {
	var ids []int
	m, err := r.split.FindStringMatch(text)
	for ; m != nil && err == nil; m, err = r.split.FindNextMatch(m) {
		var syms []string
		for _, b := range []byte(m.String()) {
			syms = append(syms, r.bytes[b])
		}
		for {
			best, at := -1, -1
			for i := 0; i+1 < len(syms); i++ {
				if rank, ok := r.ranks[[2]string{syms[i], syms[i+1]}]; ok && (best < 0 || rank < best) {
					best, at = rank, i
				}
			}
			if at < 0 {
				break
			}
			syms = append(syms[:at], append([]string{syms[at] + syms[at+1]}, syms[at+2:]...)...)
		}
		for _, s := range syms {
			id, ok := r.vocab[s]
			if !ok {
				t.Fatalf("symbol %q of %q not in the vocabulary", s, m.String())
			}
			ids = append(ids, id)
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

func (r *refBPE) decode(ids []int) string {
	tokens := map[int]string{}
	for s, id := range r.vocab {
		tokens[id] = s
	}
	unbyte := map[rune]byte{}
	for b, s := range r.bytes {
		unbyte[[]rune(s)[0]] = b
	}
	var out []byte
	for _, id := range ids {
		for _, c := range tokens[id] {
			out = append(out, unbyte[c])
		}
	}
	return string(out)
}

func TestTokenizerFile(t *testing.T) {
	o := DefaultOptions()
	tf := readTokenizer(t, writeDir(t, o))
	if tf.Model.Type != "BPE" || tf.PreTokenizer.Type != "ByteLevel" || !tf.PreTokenizer.UseRegex ||
		tf.PreTokenizer.AddPrefixSpace || tf.Decoder.Type != "ByteLevel" || tf.PostProcessor.Type != "TemplateProcessing" {
		t.Fatalf("structure %+v %+v %+v", tf.PreTokenizer, tf.Decoder, tf.PostProcessor.Type)
	}
	// Ids 0..509 in the BPE vocabulary, 510 and 511 BOS and EOS.
	seen := make([]bool, o.Vocab)
	for tok, id := range tf.Model.Vocab {
		if id < 0 || id >= o.Vocab-2 || seen[id] {
			t.Fatalf("token %q has id %d", tok, id)
		}
		seen[id] = true
	}
	if len(tf.Model.Vocab) != o.Vocab-2 || len(tf.AddedTokens) != 2 {
		t.Fatalf("%d BPE tokens, %d added", len(tf.Model.Vocab), len(tf.AddedTokens))
	}
	if a := tf.AddedTokens; a[0].ID != 510 || a[0].Content != "<|begin_of_text|>" || !a[0].Special ||
		a[1].ID != 511 || a[1].Content != "<|end_of_text|>" || !a[1].Special {
		t.Errorf("added tokens %+v", a)
	}
	// The post-processor prepends BOS.
	pp := tf.PostProcessor
	if len(pp.Single) != 2 || pp.Single[0].SpecialToken == nil || pp.Single[0].SpecialToken.ID != BOSToken ||
		pp.Single[1].Sequence == nil || pp.Single[1].Sequence.ID != "A" {
		t.Errorf("single template %+v", pp.Single)
	}
	if ids := pp.SpecialTokens[BOSToken].IDs; len(ids) != 1 || ids[0] != 510 {
		t.Errorf("BOS ids %v", ids)
	}
	// Byte tokens have the byte's id, in GPT-2's alphabet.
	for b, s := range gpt2Bytes() {
		if tf.Model.Vocab[s] != int(b) {
			t.Fatalf("byte %#x is token %q with id %d", b, s, tf.Model.Vocab[s])
		}
	}
	for s, b := range map[string]int{"Ġ": ' ', "Ċ": '\n', "Ń": 0xad, "A": 'A', "Ā": 0} {
		if tf.Model.Vocab[s] != b {
			t.Errorf("%q has id %d, want %d", s, tf.Model.Vocab[s], b)
		}
	}
	// Every merge joins two tokens that exist by then into a token of the
	// vocabulary.
	have := map[string]bool{}
	for b := 0; b < 256; b++ {
		have[gpt2Bytes()[byte(b)]] = true
	}
	for i, m := range tf.Model.Merges {
		a, b, _ := strings.Cut(m, " ")
		if !have[a] || !have[b] {
			t.Fatalf("merge %d %q uses a token not yet made", i, m)
		}
		if _, ok := tf.Model.Vocab[a+b]; !ok {
			t.Fatalf("merge %d %q makes %q, not in the vocabulary", i, m, a+b)
		}
		have[a+b] = true
	}
	if len(have) != len(tf.Model.Vocab) {
		t.Errorf("merges make %d tokens, the vocabulary has %d", len(have), len(tf.Model.Vocab))
	}

	ref := newRefBPE(t, tf)
	if ids := ref.encode(t, " the"); len(ids) != 1 {
		t.Errorf(`" the" encodes to %v, want one token`, ids)
	}
	for _, text := range []string{
		corpus[:500],
		"The keeper's lamp won't go out.\n\n  Twice   before   morning, 1883!",
		"naïve café — 東京 🚢\t\r\n",
	} {
		ids := ref.encode(t, text)
		if got := ref.decode(ids); got != text {
			t.Errorf("round trip of %q gave %q", text, got)
		}
	}
	if n := len(ref.encode(t, corpus)); n > len(corpus)/2 {
		t.Errorf("the corpus encodes to %d tokens for %d bytes: merges barely compress", n, len(corpus))
	}
}

func TestTokenizerSizes(t *testing.T) {
	for _, vocab := range []int{MinVocab, 3000} {
		t.Run(fmt.Sprint(vocab), func(t *testing.T) {
			o := DefaultOptions()
			o.Vocab = vocab
			o.Layers = 1
			tf := readTokenizer(t, writeDir(t, o))
			n := len(tf.Model.Vocab)
			if n+len(tf.AddedTokens) != vocab {
				t.Fatalf("%d BPE + %d added tokens, want %d", n, len(tf.AddedTokens), vocab)
			}
			for i, a := range tf.AddedTokens {
				want := fmt.Sprintf("<|reserved_special_token_%d|>", i)
				switch i {
				case len(tf.AddedTokens) - 2:
					want = BOSToken
				case len(tf.AddedTokens) - 1:
					want = EOSToken
				}
				if a.ID != n+i || a.Content != want || !a.Special {
					t.Fatalf("added token %d: %+v, want id %d %q", i, a, n+i, want)
				}
			}
			if vocab == MinVocab && (n != 256 || len(tf.Model.Merges) != 0) {
				t.Errorf("minimum vocabulary: %d tokens, %d merges", n, len(tf.Model.Merges))
			}
			if vocab == 3000 && len(tf.AddedTokens) == 2 {
				t.Errorf("the corpus gave %d merges: the reserved-token path is not exercised", len(tf.Model.Merges))
			}
		})
	}
}

func TestOptionsErrors(t *testing.T) {
	tests := []struct {
		change func(*Options)
		want   string
	}{
		{func(o *Options) { o.Arch = "mistral" }, `arch "mistral"`},
		{func(o *Options) { o.DType = "f8" }, `dtype "f8"`},
		{func(o *Options) { o.Layers = 0 }, "layers: 0 is not positive"},
		{func(o *Options) { o.Hidden = -1 }, "hidden"},
		{func(o *Options) { o.KVHeads = 3 }, "kv heads: 3 does not divide heads 4"},
		{func(o *Options) { o.Hidden = 66 }, "hidden 66 is not a multiple of heads 4"},
		{func(o *Options) { o.HeadDim = 15 }, "head dim: 15"},
		{func(o *Options) { o.Vocab = 257 }, "vocab: 257 is below the minimum 258"},
		{func(o *Options) { o.Intermediate = 0 }, "intermediate"},
		{func(o *Options) { o.MaxPositions = 0 }, "max positions"},
		{func(o *Options) { o.ShardBytes = -1 }, "shard bytes"},
	}
	for _, tt := range tests {
		o := DefaultOptions()
		tt.change(&o)
		dir := t.TempDir()
		err := Write(dir, o)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("error %v, want one containing %q", err, tt.want)
		}
		if entries, _ := os.ReadDir(dir); len(entries) != 0 {
			t.Errorf("invalid options wrote %d files", len(entries))
		}
	}
}
