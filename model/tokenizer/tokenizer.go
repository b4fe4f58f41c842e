package tokenizer

import (
	"fmt"
	"os"
	"strings"
	"unicode/utf8"
)

// Tokenizer encodes text to token ids and decodes ids to text exactly as the
// Hugging Face tokenizers library does with the same tokenizer.json.
type Tokenizer struct {
	// rawAdded matches the added tokens that are looked for in the raw
	// input, normAdded those looked for in normalized input.
	rawAdded, normAdded *trie
	norm                normalizer   // nil: none
	pre                 preTokenizer // nil: none
	model               *bpe
	post                postProcessor // nil: none
	dec                 decoder       // nil: tokens joined by spaces

	// tokens[id] is the string of token id; known[id] says whether id
	// exists at all.
	tokens []string
	known  []bool
	// added maps the content of every added token to its id.
	added map[string]int32
	// special holds the content of the special tokens, which decoding may
	// skip.
	special map[string]bool
	// holdBytes is set when the decoder joins byte-fallback tokens, so a
	// stream must not emit text while such a run may still grow.
	holdBytes bool
	// maxTokenBytes is the longest token string, in bytes (MaxTextBytes).
	maxTokenBytes int
}

// Load reads and parses a tokenizer.json file.
func Load(path string) (*Tokenizer, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("load tokenizer: %w", err)
	}
	t, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("load tokenizer %s: %w", path, err)
	}
	return t, nil
}

// Parse builds a Tokenizer from the contents of a tokenizer.json. Any
// component it does not implement is an error naming that component.
func Parse(data []byte) (*Tokenizer, error) {
	f, err := readFile(data)
	if err != nil {
		return nil, fmt.Errorf("parse tokenizer.json: %w", err)
	}
	t := &Tokenizer{
		rawAdded:  newTrie(),
		normAdded: newTrie(),
		added:     map[string]int32{},
		special:   map[string]bool{},
	}
	if isNull(f.Model) {
		return nil, fmt.Errorf("parse tokenizer.json: no model")
	}
	if t.model, err = parseModel(f.Model); err != nil {
		return nil, fmt.Errorf("parse model: %w", err)
	}
	if !isNull(f.Normalizer) {
		if t.norm, err = parseNormalizer(f.Normalizer); err != nil {
			return nil, fmt.Errorf("parse normalizer: %w", err)
		}
	}
	if !isNull(f.PreTokenizer) {
		if t.pre, err = parsePreTokenizer(f.PreTokenizer); err != nil {
			return nil, fmt.Errorf("parse pre_tokenizer: %w", err)
		}
	}
	if !isNull(f.PostProcessor) {
		if t.post, err = parsePostProcessor(f.PostProcessor); err != nil {
			return nil, fmt.Errorf("parse post_processor: %w", err)
		}
	}
	if !isNull(f.Decoder) {
		if t.dec, err = parseDecoder(f.Decoder); err != nil {
			return nil, fmt.Errorf("parse decoder: %w", err)
		}
		t.holdBytes = hasByteFallback(t.dec)
	}
	if err := t.addTokens(f.AddedTokens); err != nil {
		return nil, fmt.Errorf("parse added_tokens: %w", err)
	}
	t.indexTokens()
	return t, nil
}

// addTokens registers the added tokens. Ids follow the reference's rule: a
// token already in the model vocabulary keeps that id, others are numbered
// after the vocabulary in file order. A file that disagrees is rejected.
func (t *Tokenizer) addTokens(list []addedTokenJSON) error {
	next := int32(len(t.model.vocab))
	for i, a := range list {
		if a.ID == nil || a.Content == nil {
			return fmt.Errorf("added token %d: id and content are required", i)
		}
		if *a.Content == "" {
			continue
		}
		want, ok := t.added[*a.Content]
		if !ok {
			if want, ok = t.model.vocab[*a.Content]; !ok {
				want = next
				next++
			}
		}
		if *a.ID != want {
			return fmt.Errorf("added token %q has id %d, but the vocabulary gives it id %d", *a.Content, *a.ID, want)
		}
		tok := &addedToken{
			id:         want,
			content:    *a.Content,
			singleWord: a.SingleWord,
			lstrip:     a.LStrip,
			rstrip:     a.RStrip,
			normalized: a.Normalized == nil || *a.Normalized,
			special:    a.Special,
		}
		t.added[tok.content] = tok.id
		if tok.special {
			t.special[tok.content] = true
		}
		if tok.normalized {
			pattern := tok.content
			if t.norm != nil {
				pattern = t.norm.normalize(pattern)
			}
			t.normAdded.insert(pattern, tok)
		} else {
			t.rawAdded.insert(tok.content, tok)
		}
	}
	return nil
}

// indexTokens builds the id-to-string table.
func (t *Tokenizer) indexTokens() {
	n := int32(0)
	for _, id := range t.model.vocab {
		n = max(n, id+1)
	}
	for _, id := range t.added {
		n = max(n, id+1)
	}
	t.tokens = make([]string, n)
	t.known = make([]bool, n)
	for s, id := range t.model.vocab {
		t.tokens[id], t.known[id] = s, true
	}
	for s, id := range t.added {
		t.tokens[id], t.known[id] = s, true
	}
	for _, s := range t.tokens {
		t.maxTokenBytes = max(t.maxTokenBytes, len(s))
	}
}

func hasByteFallback(d decoder) bool {
	switch d := d.(type) {
	case byteFallbackDec:
		return true
	case sequenceDec:
		for _, x := range d {
			if hasByteFallback(x) {
				return true
			}
		}
	}
	return false
}

// VocabSize returns one more than the largest token id: every id is in
// [0, VocabSize()).
func (t *Tokenizer) VocabSize() int { return len(t.tokens) }

// TokenID returns the id of a token string (an added token or a vocabulary
// entry, spelled as in the file).
func (t *Tokenizer) TokenID(s string) (int32, bool) {
	if id, ok := t.added[s]; ok {
		return id, true
	}
	id, ok := t.model.vocab[s]
	return id, ok
}

// Token returns the string of token id, as spelled in the file.
func (t *Tokenizer) Token(id int32) (string, bool) {
	if id < 0 || int(id) >= len(t.tokens) || !t.known[id] {
		return "", false
	}
	return t.tokens[id], true
}

// IsSpecial reports whether id is a special token, one that Decode drops
// when asked to skip special tokens.
func (t *Tokenizer) IsSpecial(id int32) bool {
	s, ok := t.Token(id)
	return ok && t.special[s]
}

// normShrink bounds how much a normalizer shrinks text (NFC composes at
// most three code points into one); MaxTextBytes allows for it whenever
// the tokenizer normalizes.
const normShrink = 4

// MaxTextBytes bounds the text that encodes to at most n tokens: text of
// more bytes encodes to more than n tokens (the post-processor's framing
// aside), so a caller can refuse it before encoding it. No token stands
// for more bytes of text than its own string holds (byte-level and
// SentencePiece alphabets spell every byte of text with one byte or
// more), allowing normShrink for a normalizer; one that strips long runs
// of text (Strip, Replace by a shorter string) may see text refused that
// would have encoded to fewer tokens.
func (t *Tokenizer) MaxTextBytes(n int) int {
	m := n * max(t.maxTokenBytes, 1)
	if t.norm != nil {
		m *= normShrink
	}
	return m
}

// Encode returns the token ids of text. With addSpecial the file's
// post-processor frames them (for example with a beginning-of-text token).
// Added tokens are recognized in text, special ones included. Text that is
// not valid UTF-8 is read with U+FFFD for each ill-formed sequence.
func (t *Tokenizer) Encode(text string, addSpecial bool) []int32 {
	if !utf8.ValidString(text) {
		text = string(appendLossy(nil, []byte(text)))
	}
	ids := make([]int32, 0, len(text)/3+4)
	encodeWord := func(s segment) { ids = t.model.encode(ids, s.text) }
	splitAdded(t.rawAdded, text, func(piece string, tok *addedToken, rawStart int) {
		if tok != nil {
			ids = append(ids, tok.id)
			return
		}
		if t.norm != nil {
			piece = t.norm.normalize(piece)
		}
		splitAdded(t.normAdded, piece, func(word string, tok *addedToken, start int) {
			switch {
			case tok != nil:
				ids = append(ids, tok.id)
			case word == "":
			case t.pre == nil:
				ids = t.model.encode(ids, word)
			default:
				t.pre.preTokenize(segment{word, rawStart == 0 && start == 0}, encodeWord)
			}
		})
	})
	if t.post != nil {
		ids = t.post.process(ids, addSpecial)
	}
	return ids
}

// tokenStrings appends the strings of ids to dst, leaving out unknown ids
// and, with skipSpecial, special tokens.
func (t *Tokenizer) tokenStrings(dst []string, ids []int32, skipSpecial bool) []string {
	for _, id := range ids {
		s, ok := t.Token(id)
		if !ok || (skipSpecial && t.special[s]) {
			continue
		}
		dst = append(dst, s)
	}
	return dst
}

// decodeStrings runs the decoder over token strings.
func (t *Tokenizer) decodeStrings(tokens []string) string {
	if t.dec == nil {
		return strings.Join(tokens, " ")
	}
	return strings.Join(t.dec.decodeChain(tokens), "")
}

// Decode returns the text of ids through the file's decoder. Unknown ids
// are left out; with skipSpecial, so are special tokens.
func (t *Tokenizer) Decode(ids []int32, skipSpecial bool) string {
	return t.decodeStrings(t.tokenStrings(make([]string, 0, len(ids)), ids, skipSpecial))
}
