package tokenizer

import "strings"

// Stream decodes a sequence of ids one id at a time, returning text as soon
// as it is final. The concatenation of every Add and the closing Flush
// equals Decode of all the ids.
//
// It decodes a short window of tokens rather than the whole sequence: the
// tokens of the last text it returned stay in the window as context, so
// decoder rules that depend on neighbours (the SentencePiece leading-space
// strip, byte fallback runs, multi-byte UTF-8 characters split over byte
// tokens) see the same surroundings as a full decode.
type Stream struct {
	t           *Tokenizer
	skipSpecial bool
	// window holds the context tokens followed by the pending ones.
	window []string
	// ctx is the number of context tokens; ctxText is their decoded text.
	ctx     int
	ctxText string
}

// NewStream starts decoding a new sequence. With skipSpecial, special tokens
// are left out, as Decode does.
func (t *Tokenizer) NewStream(skipSpecial bool) *Stream {
	return &Stream{t: t, skipSpecial: skipSpecial}
}

// Add appends id to the sequence and returns the text it completes, which
// may be empty: text is held back while it could still change, for example
// while the bytes of a character are incomplete. The result is always valid
// UTF-8.
//
// Text that ends in a replacement character is final once maxHeld more
// tokens have come (a character spans at most 4 bytes): then all but the
// last maxHeld pending tokens are released. Without that bound a run of
// invalid bytes was held to the end, each Add decoding it all again: 3,600
// of them took 1.4 s to stream.
func (s *Stream) Add(id int32) string {
	w := s.t.tokenStrings(s.window, []int32{id}, s.skipSpecial)
	if len(w) == len(s.window) {
		return ""
	}
	s.window = w
	if s.t.holdBytes {
		// The decoder turns a whole run of byte tokens into replacement
		// characters when its bytes are not valid UTF-8, so none of a
		// run's text is final before the run ends.
		if _, ok := byteToken(w[len(w)-1]); ok {
			return ""
		}
	}
	text := s.t.decodeStrings(w)
	if len(text) <= len(s.ctxText) || strings.HasSuffix(text, "\uFFFD") {
		return s.release(text)
	}
	out := text[len(s.ctxText):]
	// The tokens just decoded become the context, unless their text alone
	// is empty: an empty context would leave the window start exposed to
	// rules that only apply at the start of a sequence.
	pending := w[s.ctx:]
	if t := s.t.decodeStrings(pending); t != "" {
		s.window = append(s.window[:0], pending...)
		s.ctxText = t
	} else {
		s.ctxText = text
	}
	s.ctx = len(s.window)
	return out
}

// maxHeld is how many pending tokens may hold text back: a UTF-8
// character is at most 4 bytes, so once more tokens than its other 3
// bytes need have followed a byte, the byte's text no longer changes.
const maxHeld = 3

// release returns the text of all but the last maxHeld pending tokens
// when more are pending and their text is final: each of the last maxHeld
// has text of its own (so bytes), the window's text begins with it, and so
// does the text of the window from the first pending token, which becomes
// the context. text is the window's text. It returns "" otherwise.
func (s *Stream) release(text string) string {
	cut := len(s.window) - maxHeld
	if cut <= s.ctx {
		return ""
	}
	for _, tok := range s.window[cut:] {
		if s.t.decodeStrings([]string{tok}) == "" {
			return "" // a token of no text may carry no byte either
		}
	}
	head := s.t.decodeStrings(s.window[:cut])
	if len(head) <= len(s.ctxText) || !strings.HasPrefix(text, head) {
		return ""
	}
	ctx := s.window[s.ctx:cut]
	ctxText := s.t.decodeStrings(ctx)
	if ctxText == "" || !strings.HasPrefix(s.t.decodeStrings(s.window[s.ctx:]), ctxText) {
		return ""
	}
	out := head[len(s.ctxText):]
	s.window = append(s.window[:0], s.window[s.ctx:]...)
	s.ctx, s.ctxText = len(ctx), ctxText
	return out
}

// Flush returns the text still held back and resets the Stream, so the next
// Add starts a new sequence.
func (s *Stream) Flush() string {
	var out string
	if len(s.window) > s.ctx {
		out = strings.TrimPrefix(s.t.decodeStrings(s.window), s.ctxText)
	}
	s.window, s.ctx, s.ctxText = s.window[:0], 0, ""
	return out
}
