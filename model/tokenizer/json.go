package tokenizer

import (
	"bytes"
	"encoding/json"
	"fmt"
	"sync"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// fileJSON is the layout of a Hugging Face tokenizer.json.
type fileJSON struct {
	AddedTokens   []addedTokenJSON
	Normalizer    json.RawMessage
	PreTokenizer  json.RawMessage
	Model         json.RawMessage
	PostProcessor json.RawMessage
	Decoder       json.RawMessage
}

// readFile splits a tokenizer.json into its sections. The model section is
// returned unchecked, for parseModel to read in full; everything else is
// checked to be valid JSON.
func readFile(data []byte) (fileJSON, error) {
	var f fileJSON
	r := &jsonReader{data: data}
	err := r.readObject(func(key string) error {
		if key == "model" {
			var err error
			f.Model, err = r.rawValue()
			return err
		}
		raw, err := r.skipValue()
		if err != nil {
			return fmt.Errorf("%s: %w", key, err)
		}
		switch key {
		case "added_tokens":
			if err := json.Unmarshal(raw, &f.AddedTokens); err != nil {
				return fmt.Errorf("added_tokens: %w", err)
			}
		case "normalizer":
			f.Normalizer = raw
		case "pre_tokenizer":
			f.PreTokenizer = raw
		case "post_processor":
			f.PostProcessor = raw
		case "decoder":
			f.Decoder = raw
		}
		return nil
	})
	return f, err
}

type addedTokenJSON struct {
	ID         *int32  `json:"id"`
	Content    *string `json:"content"`
	SingleWord bool    `json:"single_word"`
	LStrip     bool    `json:"lstrip"`
	RStrip     bool    `json:"rstrip"`
	// Normalized defaults to true, as in the reference.
	Normalized *bool `json:"normalized"`
	Special    bool  `json:"special"`
}

// isNull reports whether a component is absent or JSON null.
func isNull(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	return len(raw) == 0 || string(raw) == "null"
}

// componentType reads the "type" field of a component.
func componentType(raw json.RawMessage) (string, error) {
	var c struct {
		Type string `json:"type"`
	}
	if err := json.Unmarshal(raw, &c); err != nil {
		return "", err
	}
	return c.Type, nil
}

// patternJSON is a Split or Replace pattern: exactly one of the two is set.
type patternJSON struct {
	String *string `json:"String"`
	Regex  *string `json:"Regex"`
}

func (p patternJSON) matcher() (matcher, error) {
	switch {
	case p.String != nil && p.Regex == nil:
		return newStringMatcher(*p.String)
	case p.Regex != nil && p.String == nil:
		return newRegexMatcher(*p.Regex)
	}
	return nil, fmt.Errorf("pattern must have exactly one of String and Regex")
}

// parseReplace reads a Replace component, normalizer or decoder alike: its
// pattern's matcher and the content that replaces each match.
func parseReplace(raw json.RawMessage) (matcher, string, error) {
	var c struct {
		Pattern patternJSON `json:"pattern"`
		Content string      `json:"content"`
	}
	if err := decodeInto(raw, "Replace", &c); err != nil {
		return nil, "", err
	}
	m, err := c.Pattern.matcher()
	if err != nil {
		return nil, "", fmt.Errorf("Replace: %w", err)
	}
	return m, c.Content, nil
}

// decodeInto unmarshals a component's fields, naming the component on error.
func decodeInto(raw json.RawMessage, typ string, v any) error {
	if err := json.Unmarshal(raw, v); err != nil {
		return fmt.Errorf("%s: %w", typ, err)
	}
	return nil
}

// parseSequence reads a Sequence component: the list under key, each item
// read by parse.
func parseSequence[T any](raw json.RawMessage, key string, parse func(json.RawMessage) (T, error)) ([]T, error) {
	var c map[string]json.RawMessage
	if err := decodeInto(raw, "Sequence", &c); err != nil {
		return nil, err
	}
	var items []json.RawMessage
	if list, ok := c[key]; ok {
		if err := decodeInto(list, "Sequence "+key, &items); err != nil {
			return nil, err
		}
	}
	seq := make([]T, 0, len(items))
	for i, r := range items {
		v, err := parse(r)
		if err != nil {
			return nil, fmt.Errorf("Sequence item %d: %w", i, err)
		}
		seq = append(seq, v)
	}
	return seq, nil
}

func parseNormalizer(raw json.RawMessage) (normalizer, error) {
	typ, err := componentType(raw)
	if err != nil {
		return nil, err
	}
	switch typ {
	case "NFC":
		return unicodeNorm{norm.NFC}, nil
	case "NFD":
		return unicodeNorm{norm.NFD}, nil
	case "NFKC":
		return unicodeNorm{norm.NFKC}, nil
	case "NFKD":
		return unicodeNorm{norm.NFKD}, nil
	case "Lowercase":
		return lowercaseNorm{}, nil
	case "Sequence":
		seq, err := parseSequence(raw, "normalizers", parseNormalizer)
		return sequenceNorm(seq), err
	case "Prepend":
		var c struct {
			Prepend string `json:"prepend"`
		}
		if err := decodeInto(raw, typ, &c); err != nil {
			return nil, err
		}
		return prependNorm{c.Prepend}, nil
	case "Replace":
		m, content, err := parseReplace(raw)
		if err != nil {
			return nil, err
		}
		return replaceNorm{m, content}, nil
	case "Strip":
		var c struct {
			Left  bool `json:"strip_left"`
			Right bool `json:"strip_right"`
		}
		if err := decodeInto(raw, typ, &c); err != nil {
			return nil, err
		}
		return stripNorm{c.Left, c.Right}, nil
	}
	return nil, fmt.Errorf("unsupported normalizer type %q", typ)
}

// metaspaceJSON holds the fields shared by the Metaspace pre-tokenizer and
// decoder, with the reference's reading of the legacy add_prefix_space.
type metaspaceJSON struct {
	Replacement    string  `json:"replacement"`
	PrependScheme  *string `json:"prepend_scheme"`
	Split          *bool   `json:"split"`
	AddPrefixSpace *bool   `json:"add_prefix_space"`
}

func (c metaspaceJSON) resolve() (rune, prependScheme, bool, error) {
	r, n := utf8.DecodeRuneInString(c.Replacement)
	if n == 0 || n != len(c.Replacement) {
		return 0, 0, false, fmt.Errorf("Metaspace replacement %q is not one character", c.Replacement)
	}
	scheme := prependAlways
	if c.PrependScheme != nil {
		switch *c.PrependScheme {
		case "always":
			scheme = prependAlways
		case "first":
			scheme = prependFirst
		case "never":
			scheme = prependNever
		default:
			return 0, 0, false, fmt.Errorf("Metaspace prepend_scheme %q is not always, first or never", *c.PrependScheme)
		}
	}
	if c.AddPrefixSpace != nil && !*c.AddPrefixSpace {
		if c.PrependScheme != nil && scheme != prependNever {
			return 0, 0, false, fmt.Errorf("Metaspace add_prefix_space false contradicts prepend_scheme %q", *c.PrependScheme)
		}
		scheme = prependNever
	}
	split := c.Split == nil || *c.Split
	return r, scheme, split, nil
}

func parsePreTokenizer(raw json.RawMessage) (preTokenizer, error) {
	typ, err := componentType(raw)
	if err != nil {
		return nil, err
	}
	switch typ {
	case "Sequence":
		seq, err := parseSequence(raw, "pretokenizers", parsePreTokenizer)
		return sequencePre(seq), err
	case "Split":
		var c struct {
			Pattern  patternJSON `json:"pattern"`
			Behavior string      `json:"behavior"`
			Invert   bool        `json:"invert"`
		}
		if err := decodeInto(raw, typ, &c); err != nil {
			return nil, err
		}
		m, err := c.Pattern.matcher()
		if err != nil {
			return nil, fmt.Errorf("Split: %w", err)
		}
		b, ok := splitBehaviors[c.Behavior]
		if !ok {
			return nil, fmt.Errorf("Split: unsupported behavior %q", c.Behavior)
		}
		return splitPre{m, b, c.Invert}, nil
	case "ByteLevel":
		c := struct {
			AddPrefixSpace bool `json:"add_prefix_space"`
			UseRegex       bool `json:"use_regex"`
		}{true, true}
		if err := decodeInto(raw, typ, &c); err != nil {
			return nil, err
		}
		p := byteLevelPre{addPrefixSpace: c.AddPrefixSpace}
		if c.UseRegex {
			p.split = scanMatcher{gpt2Scanner{}}
		}
		return p, nil
	case "Metaspace":
		var c metaspaceJSON
		if err := decodeInto(raw, typ, &c); err != nil {
			return nil, err
		}
		r, scheme, split, err := c.resolve()
		if err != nil {
			return nil, err
		}
		return metaspacePre{string(r), scheme, split}, nil
	}
	return nil, fmt.Errorf("unsupported pre_tokenizer type %q", typ)
}

func parseDecoder(raw json.RawMessage) (decoder, error) {
	typ, err := componentType(raw)
	if err != nil {
		return nil, err
	}
	switch typ {
	case "ByteLevel":
		return byteLevelDec{}, nil
	case "ByteFallback":
		return byteFallbackDec{}, nil
	case "Fuse":
		return fuseDec{}, nil
	case "Sequence":
		seq, err := parseSequence(raw, "decoders", parseDecoder)
		return sequenceDec(seq), err
	case "Replace":
		m, content, err := parseReplace(raw)
		if err != nil {
			return nil, err
		}
		return replaceDec{m, content}, nil
	case "Strip":
		var c struct {
			Content string `json:"content"`
			Start   int    `json:"start"`
			Stop    int    `json:"stop"`
		}
		if err := decodeInto(raw, typ, &c); err != nil {
			return nil, err
		}
		r, n := utf8.DecodeRuneInString(c.Content)
		if n == 0 || n != len(c.Content) {
			return nil, fmt.Errorf("Strip content %q is not one character", c.Content)
		}
		if c.Start < 0 || c.Stop < 0 {
			return nil, fmt.Errorf("Strip start %d, stop %d: negative", c.Start, c.Stop)
		}
		return stripDec{r, c.Start, c.Stop}, nil
	case "Metaspace":
		var c metaspaceJSON
		if err := decodeInto(raw, typ, &c); err != nil {
			return nil, err
		}
		r, scheme, _, err := c.resolve()
		if err != nil {
			return nil, err
		}
		return metaspaceDec{r, scheme}, nil
	}
	return nil, fmt.Errorf("unsupported decoder type %q", typ)
}

func parsePostProcessor(raw json.RawMessage) (postProcessor, error) {
	typ, err := componentType(raw)
	if err != nil {
		return nil, err
	}
	switch typ {
	case "ByteLevel":
		return identityPost{}, nil
	case "Sequence":
		var c struct {
			Processors []json.RawMessage `json:"processors"`
		}
		if err := decodeInto(raw, typ, &c); err != nil {
			return nil, err
		}
		seq := make(sequencePost, 0, len(c.Processors))
		for i, r := range c.Processors {
			p, err := parsePostProcessor(r)
			if err != nil {
				return nil, fmt.Errorf("Sequence item %d: %w", i, err)
			}
			seq = append(seq, p)
		}
		return seq, nil
	case "TemplateProcessing":
		return parseTemplate(raw)
	case "RobertaProcessing", "BertProcessing":
		var c struct {
			Sep *tokenRefJSON `json:"sep"`
			Cls *tokenRefJSON `json:"cls"`
		}
		if err := decodeInto(raw, typ, &c); err != nil {
			return nil, err
		}
		if c.Sep == nil || c.Cls == nil {
			return nil, fmt.Errorf("%s: sep and cls are required", typ)
		}
		return templatePost{before: []int32{c.Cls.id}, after: []int32{c.Sep.id}}, nil
	}
	return nil, fmt.Errorf("unsupported post_processor type %q", typ)
}

// tokenRefJSON is a [token, id] pair.
type tokenRefJSON struct {
	token string
	id    int32
}

func (r *tokenRefJSON) UnmarshalJSON(data []byte) error {
	var pair []json.RawMessage
	if err := json.Unmarshal(data, &pair); err != nil {
		return err
	}
	if len(pair) != 2 {
		return fmt.Errorf("want [token, id], got %d items", len(pair))
	}
	if err := json.Unmarshal(pair[0], &r.token); err != nil {
		return err
	}
	return json.Unmarshal(pair[1], &r.id)
}

// parseTemplate reads the single-sequence template of TemplateProcessing.
func parseTemplate(raw json.RawMessage) (postProcessor, error) {
	var c struct {
		Single []struct {
			SpecialToken *struct {
				ID string `json:"id"`
			} `json:"SpecialToken"`
			Sequence *struct {
				ID string `json:"id"`
			} `json:"Sequence"`
		} `json:"single"`
		SpecialTokens map[string]struct {
			IDs []int32 `json:"ids"`
		} `json:"special_tokens"`
	}
	if err := decodeInto(raw, "TemplateProcessing", &c); err != nil {
		return nil, err
	}
	var p templatePost
	seen := false
	for i, piece := range c.Single {
		switch {
		case piece.Sequence != nil && piece.SpecialToken == nil:
			if piece.Sequence.ID != "A" || seen {
				return nil, fmt.Errorf("TemplateProcessing single item %d: want one sequence A, got %q", i, piece.Sequence.ID)
			}
			seen = true
		case piece.SpecialToken != nil && piece.Sequence == nil:
			st, ok := c.SpecialTokens[piece.SpecialToken.ID]
			if !ok {
				return nil, fmt.Errorf("TemplateProcessing single item %d: special token %q is not in special_tokens", i, piece.SpecialToken.ID)
			}
			if seen {
				p.after = append(p.after, st.IDs...)
			} else {
				p.before = append(p.before, st.IDs...)
			}
		default:
			return nil, fmt.Errorf("TemplateProcessing single item %d: want SpecialToken or Sequence", i)
		}
	}
	if !seen {
		return nil, fmt.Errorf("TemplateProcessing single template has no sequence")
	}
	return p, nil
}

// bpeJSON is the BPE model section apart from the vocabulary and merges.
type bpeJSON struct {
	Type                    string   `json:"type"`
	Dropout                 *float64 `json:"dropout"`
	UnkToken                *string  `json:"unk_token"`
	ContinuingSubwordPrefix *string  `json:"continuing_subword_prefix"`
	EndOfWordSuffix         *string  `json:"end_of_word_suffix"`
	FuseUnk                 bool     `json:"fuse_unk"`
	ByteFallback            bool     `json:"byte_fallback"`
	IgnoreMerges            bool     `json:"ignore_merges"`
}

// parseModel reads the model section: the vocabulary and merges with
// readVocab and readMerges, the other fields with encoding/json.
func parseModel(raw json.RawMessage) (*bpe, error) {
	var vocabRaw, mergesRaw []byte
	rest := map[string]json.RawMessage{}
	r := &jsonReader{data: raw}
	err := r.readObject(func(key string) error {
		var err error
		switch key {
		case "vocab":
			vocabRaw, err = r.rawValue()
		case "merges":
			mergesRaw, err = r.rawValue()
		default:
			rest[key], err = r.skipValue()
		}
		if err != nil {
			return fmt.Errorf("%s: %w", key, err)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	// rest holds valid JSON values, so it marshals.
	others, _ := json.Marshal(rest)
	var c bpeJSON
	if err := json.Unmarshal(others, &c); err != nil {
		return nil, err
	}
	if c.Type != "BPE" && !(c.Type == "" && mergesRaw != nil) {
		return nil, fmt.Errorf("unsupported model type %q", c.Type)
	}
	if c.Dropout != nil && *c.Dropout != 0 {
		return nil, fmt.Errorf("BPE dropout %v: unsupported (encoding would be random)", *c.Dropout)
	}
	// The two largest sections parse side by side.
	var merges [][2]string
	var mergesErr error
	var wg sync.WaitGroup
	wg.Go(func() { merges, mergesErr = readMerges(mergesRaw) })
	vocab, err := readVocab(vocabRaw)
	wg.Wait()
	if err != nil {
		return nil, fmt.Errorf("BPE vocab: %w", err)
	}
	if mergesErr != nil {
		return nil, fmt.Errorf("BPE merges: %w", mergesErr)
	}
	var prefix, suffix string
	if c.ContinuingSubwordPrefix != nil {
		prefix = *c.ContinuingSubwordPrefix
	}
	if c.EndOfWordSuffix != nil {
		suffix = *c.EndOfWordSuffix
	}
	m, err := newBPE(vocab, merges, c.UnkToken, prefix, suffix)
	if err != nil {
		return nil, fmt.Errorf("BPE: %w", err)
	}
	m.fuseUnk, m.byteFallback, m.ignoreMerges = c.FuseUnk, c.ByteFallback, c.IgnoreMerges
	return m, nil
}
