package frontend

import (
	"strings"

	"github.com/tandem-llm/tandem/model/tokenizer"
)

// textStream turns a request's tokens into text deltas and applies its stop
// strings: text that may begin a stop string is held back until it is known
// not to, and the text ends before the first stop string found.
type textStream struct {
	dec     *tokenizer.Stream
	stop    []string
	pending string // decoded, not yet released
	stopped bool
}

func newTextStream(tok *tokenizer.Tokenizer, stop []string) *textStream {
	return &textStream{dec: tok.NewStream(true), stop: stop}
}

// add decodes one more token and returns the text that can be released.
func (t *textStream) add(id int32) string { return t.release(t.dec.Add(id), false) }

// flush returns the rest of the text at the end of the completion.
func (t *textStream) flush() string { return t.release(t.dec.Flush(), true) }

func (t *textStream) release(s string, final bool) string {
	if t.stopped {
		return ""
	}
	t.pending += s
	if i := firstStop(t.pending, t.stop); i >= 0 {
		out := t.pending[:i]
		t.pending, t.stopped = "", true
		return out
	}
	keep := 0
	if !final {
		keep = heldBack(t.pending, t.stop)
	}
	out := t.pending[:len(t.pending)-keep]
	t.pending = t.pending[len(t.pending)-keep:]
	return out
}

// firstStop is the index in s of the earliest occurrence of any stop
// string, or -1.
func firstStop(s string, stop []string) int {
	first := -1
	for _, st := range stop {
		if i := strings.Index(s, st); i >= 0 && (first < 0 || i < first) {
			first = i
		}
	}
	return first
}

// heldBack is the length of the longest suffix of s that is a proper prefix
// of a stop string: text that a later token may turn into a stop string.
func heldBack(s string, stop []string) int {
	keep := 0
	for _, st := range stop {
		for n := min(len(st)-1, len(s)); n > keep; n-- {
			if strings.HasSuffix(s, st[:n]) {
				keep = n
				break
			}
		}
	}
	return keep
}
