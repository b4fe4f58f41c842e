package chat

import (
	"slices"

	"github.com/tandem-llm/tandem/model/tokenizer"
)

// PromptTokens is the one place that decides which special tokens a prompt
// gets when it is tokenised.
//
// A prompt rendered by a chat template (rendered true) already holds every
// special token the model expects, since the template writes them
// (bos_token ...): it is encoded without the tokenizer's post-processor, as
// Hugging Face's apply_chat_template and vLLM's chat endpoint do, so a BOS
// is never added twice.
//
// A raw prompt (a completion) gets the post-processor's special tokens, as
// Hugging Face's tokenizer(text) does, except those the text already spells
// at its start or end: a prompt that begins with the BOS text keeps one BOS.
func PromptTokens(tok *tokenizer.Tokenizer, text string, rendered bool) []int32 {
	plain := tok.Encode(text, false)
	if rendered {
		return plain
	}
	framed := tok.Encode(text, true)
	// The post-processor adds tokens around the text's own: find where
	// they sit, then drop an added prefix (suffix) the text begins (ends)
	// with.
	at := -1
	for i := 0; i+len(plain) <= len(framed); i++ {
		if slices.Equal(framed[i:i+len(plain)], plain) {
			at = i
			break
		}
	}
	if at < 0 {
		return framed // the post-processor does more than frame the text
	}
	pre, post := framed[:at], framed[at+len(plain):]
	if len(pre) > 0 && len(plain) >= len(pre) && slices.Equal(plain[:len(pre)], pre) {
		pre = nil
	}
	if len(post) > 0 && len(plain) >= len(post) && slices.Equal(plain[len(plain)-len(post):], post) {
		post = nil
	}
	return slices.Concat(pre, plain, post)
}
