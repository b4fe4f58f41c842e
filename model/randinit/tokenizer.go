package randinit

import (
	"bytes"
	_ "embed"
	"encoding/json"
	"fmt"
	"strconv"
)

// corpus is the English prose the tokenizer's merges are learned on.
//
//go:embed corpus.txt
var corpus string

// Special tokens, the last two ids of the vocabulary.
const (
	BOSToken = "<|begin_of_text|>"
	EOSToken = "<|end_of_text|>"
)

// reservedToken names the filler special tokens that pad the vocabulary
// when the corpus runs out of merges before it reaches the requested size.
func reservedToken(i int) string { return fmt.Sprintf("<|reserved_special_token_%d|>", i) }

// tokenizer is a trained vocabulary: the BPE part (ids 0..len(tokens)-1)
// and added special tokens after it, BOS and EOS last.
type tokenizer struct {
	bpe   *bpe
	added []string
}

// newTokenizer trains a byte-level BPE of vocab ids in all.
func newTokenizer(vocab int) (*tokenizer, error) {
	b, err := trainBPE(corpus, vocab-2)
	if err != nil {
		return nil, fmt.Errorf("train tokenizer: %w", err)
	}
	t := &tokenizer{bpe: b}
	for i := 0; len(b.tokens)+len(t.added) < vocab-2; i++ {
		t.added = append(t.added, reservedToken(i))
	}
	t.added = append(t.added, BOSToken, EOSToken)
	return t, nil
}

func (t *tokenizer) bos() int { return t.id(len(t.added) - 2) }
func (t *tokenizer) eos() int { return t.id(len(t.added) - 1) }

// id is the token id of added token i.
func (t *tokenizer) id(i int) int { return len(t.bpe.tokens) + i }

// orderedVocab marshals the BPE vocabulary as a JSON object in id order, as
// the Hugging Face tokenizers library writes it.
type orderedVocab []string

func (v orderedVocab) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	for id, tok := range v {
		if id > 0 {
			b.WriteByte(',')
		}
		k, err := marshal(tok)
		if err != nil {
			return nil, err
		}
		b.Write(k)
		b.WriteByte(':')
		b.WriteString(strconv.Itoa(id))
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

// marshal is json.Marshal without HTML escaping.
func marshal(v any) ([]byte, error) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(b.Bytes(), []byte("\n")), nil
}

// marshalIndent is json.MarshalIndent with two spaces, without HTML
// escaping, ending in a newline.
func marshalIndent(v any) ([]byte, error) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

type addedToken struct {
	ID         int    `json:"id"`
	Content    string `json:"content"`
	SingleWord bool   `json:"single_word"`
	LStrip     bool   `json:"lstrip"`
	RStrip     bool   `json:"rstrip"`
	Normalized bool   `json:"normalized"`
	Special    bool   `json:"special"`
}

func (t *tokenizer) addedTokens() []addedToken {
	out := make([]addedToken, len(t.added))
	for i, s := range t.added {
		out[i] = addedToken{ID: t.id(i), Content: s, Special: true}
	}
	return out
}

// tokenizerJSON is tokenizer.json: a byte-level BPE in the layout of the
// Hugging Face tokenizers library, with a post-processor that prepends BOS.
func (t *tokenizer) tokenizerJSON() ([]byte, error) {
	merges := make([]string, len(t.bpe.merges))
	for i, m := range t.bpe.merges {
		merges[i] = t.bpe.tokens[m[0]] + " " + t.bpe.tokens[m[1]]
	}
	type kv = map[string]any
	seq := func(id string, typeID int) kv { return kv{"Sequence": kv{"id": id, "type_id": typeID}} }
	special := func(typeID int) kv { return kv{"SpecialToken": kv{"id": BOSToken, "type_id": typeID}} }
	doc := kv{
		"version":      "1.0",
		"truncation":   nil,
		"padding":      nil,
		"added_tokens": t.addedTokens(),
		"normalizer":   nil,
		"pre_tokenizer": kv{
			"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true,
		},
		"post_processor": kv{
			"type":   "TemplateProcessing",
			"single": []kv{special(0), seq("A", 0)},
			"pair":   []kv{special(0), seq("A", 0), special(1), seq("B", 1)},
			"special_tokens": kv{
				BOSToken: kv{"id": BOSToken, "ids": []int{t.bos()}, "tokens": []string{BOSToken}},
			},
		},
		"decoder": kv{
			"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true,
		},
		"model": kv{
			"type":                      "BPE",
			"dropout":                   nil,
			"unk_token":                 nil,
			"continuing_subword_prefix": nil,
			"end_of_word_suffix":        nil,
			"fuse_unk":                  false,
			"byte_fallback":             false,
			"ignore_merges":             false,
			"vocab":                     orderedVocab(t.bpe.tokens),
			"merges":                    merges,
		},
	}
	return marshalIndent(doc)
}

// ChatTemplate is the chat template of the checkpoints Write makes: a turn
// is "### ROLE", a newline, the content and EOS; the prompt starts with BOS;
// add_generation_prompt opens the assistant's turn. Content must be a
// string (raise_exception otherwise), as most models' templates want.
const ChatTemplate = `{{- bos_token }}
{%- for message in messages %}
    {%- if message['content'] is not string %}
        {{- raise_exception('message content must be a string') }}
    {%- endif %}
    {{- '### ' + message['role'] + '\n' + message['content'] | trim + eos_token + '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '### assistant\n' }}
{%- endif %}
`

// tokenizerConfigJSON is a minimal tokenizer_config.json with a chat
// template.
func (t *tokenizer) tokenizerConfigJSON(maxPositions int) ([]byte, error) {
	decoder := map[string]any{}
	for _, a := range t.addedTokens() {
		decoder[strconv.Itoa(a.ID)] = map[string]any{
			"content": a.Content, "lstrip": a.LStrip, "normalized": a.Normalized,
			"rstrip": a.RStrip, "single_word": a.SingleWord, "special": a.Special,
		}
	}
	return marshalIndent(map[string]any{
		"added_tokens_decoder":         decoder,
		"bos_token":                    BOSToken,
		"chat_template":                ChatTemplate,
		"eos_token":                    EOSToken,
		"clean_up_tokenization_spaces": false,
		"model_max_length":             maxPositions,
		"tokenizer_class":              "PreTrainedTokenizerFast",
	})
}
