package tokenizer

import (
	"strings"
	"unicode"
	"unicode/utf8"
)

// addedToken is an entry of the file's added_tokens: a string matched in
// the input before any other processing and given a fixed id.
type addedToken struct {
	id         int32
	content    string
	singleWord bool
	lstrip     bool
	rstrip     bool
	normalized bool
	special    bool
}

// trie finds the longest added token starting at a position. It is the
// leftmost-longest search of the reference (Aho-Corasick), done position by
// position.
type trie struct {
	nodes []trieNode
	// firsts marks the bytes that start some token.
	firsts [256]bool
}

type trieNode struct {
	next map[byte]int32
	tok  *addedToken
}

func newTrie() *trie { return &trie{nodes: []trieNode{{}}} }

// insert adds pattern for tok; the first token inserted for a pattern keeps it.
func (t *trie) insert(pattern string, tok *addedToken) {
	if pattern == "" {
		return
	}
	t.firsts[pattern[0]] = true
	n := int32(0)
	for i := 0; i < len(pattern); i++ {
		c := pattern[i]
		nx, ok := t.nodes[n].next[c]
		if !ok {
			nx = int32(len(t.nodes))
			t.nodes = append(t.nodes, trieNode{})
			if t.nodes[n].next == nil {
				t.nodes[n].next = make(map[byte]int32)
			}
			t.nodes[n].next[c] = nx
		}
		n = nx
	}
	if t.nodes[n].tok == nil {
		t.nodes[n].tok = tok
	}
}

// longest returns the longest token matching s at i and the end of the match.
func (t *trie) longest(s string, i int) (*addedToken, int) {
	var best *addedToken
	end := i
	n := int32(0)
	for j := i; j < len(s); j++ {
		nx, ok := t.nodes[n].next[s[j]]
		if !ok {
			break
		}
		n = nx
		if tok := t.nodes[n].tok; tok != nil {
			best, end = tok, j+1
		}
	}
	return best, end
}

func (t *trie) empty() bool { return len(t.nodes) == 1 }

// splitAdded cuts s at the added tokens t finds, honouring each token's
// single_word, lstrip and rstrip, and calls emit for every piece in order:
// with the token for matches, nil for the text between them. start is the
// piece's byte offset in s.
func splitAdded(t *trie, s string, emit func(text string, tok *addedToken, start int)) {
	if t.empty() {
		emit(s, nil, 0)
		return
	}
	offset := 0
	for i := 0; i < len(s); {
		if !t.firsts[s[i]] {
			i++
			continue
		}
		tok, end := t.longest(s, i)
		if tok == nil {
			i++
			continue
		}
		start, stop := i, end
		i = end
		if tok.singleWord {
			startOK := start == 0 || !endsWithWord(s[:start])
			stopOK := stop == len(s) || !startsWithWord(s[stop:])
			if !startOK || !stopOK {
				continue
			}
		}
		if tok.lstrip {
			start = max(len(strings.TrimRightFunc(s[:start], unicode.IsSpace)), offset)
		}
		if tok.rstrip {
			stop = len(s) - len(strings.TrimLeftFunc(s[stop:], unicode.IsSpace))
		}
		if offset < start {
			emit(s[offset:start], nil, offset)
		}
		emit(s[start:stop], tok, start)
		offset = stop
	}
	if offset != len(s) {
		emit(s[offset:], nil, offset)
	}
}

// isWordChar is the Unicode regex class \w: alphabetic, marks, decimal
// digits, connector punctuation and join controls.
func isWordChar(r rune) bool {
	return unicode.IsLetter(r) || unicode.IsMark(r) ||
		unicode.In(r, unicode.Nl, unicode.Nd, unicode.Pc, unicode.Other_Alphabetic, unicode.Join_Control)
}

func endsWithWord(s string) bool {
	r, n := utf8.DecodeLastRuneInString(s)
	return n > 0 && isWordChar(r)
}

func startsWithWord(s string) bool {
	r, _ := runeAt(s, 0)
	return r >= 0 && isWordChar(r)
}
