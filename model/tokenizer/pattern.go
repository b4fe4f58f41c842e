package tokenizer

import (
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/dlclark/regexp2"
)

// span is a byte range of a string and whether a pattern matched it.
type span struct {
	start, end int
	match      bool
}

// matcher finds the occurrences of a pattern in a string.
type matcher interface {
	// find calls yield, in order, with spans that cover s: the matches and
	// the stretches between them. An empty s yields one empty unmatched span.
	find(s string, yield func(span))
}

// The split expressions of the tokenizers that ship most often. They are
// matched by hand-written scanners (scanner.go); any other expression runs
// on regexp2.
const (
	// llama3Pattern is the split of Llama 3 (and of tiktoken's cl100k).
	llama3Pattern = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// qwen2Pattern is llama3Pattern with single digits (Qwen2, Qwen3).
	qwen2Pattern = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// gpt2Pattern is the split of the ByteLevel pre-tokenizer's use_regex.
	gpt2Pattern = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
)

// newRegexMatcher returns the matcher of a regular expression from a
// tokenizer file.
func newRegexMatcher(expr string) (matcher, error) {
	switch expr {
	case llama3Pattern:
		return scanMatcher{llama3Scanner{maxDigits: 3}}, nil
	case qwen2Pattern:
		return scanMatcher{llama3Scanner{maxDigits: 1}}, nil
	case gpt2Pattern:
		return scanMatcher{gpt2Scanner{}}, nil
	}
	re, err := regexp2.Compile(expr, regexp2.None)
	if err != nil {
		return nil, fmt.Errorf("compile regex %q: %w", expr, err)
	}
	return regexMatcher{re}, nil
}

// newStringMatcher returns the matcher of a literal string.
func newStringMatcher(lit string) (matcher, error) {
	if lit == "" {
		return nil, fmt.Errorf("empty string pattern")
	}
	return literalMatcher{lit}, nil
}

// literalMatcher matches every non-overlapping occurrence of a string.
type literalMatcher struct{ lit string }

func (m literalMatcher) find(s string, yield func(span)) {
	if s == "" {
		yield(span{})
		return
	}
	prev := 0
	for prev < len(s) {
		k := strings.Index(s[prev:], m.lit)
		if k < 0 {
			break
		}
		start := prev + k
		if start > prev {
			yield(span{prev, start, false})
		}
		prev = start + len(m.lit)
		yield(span{start, prev, true})
	}
	if prev < len(s) {
		yield(span{prev, len(s), false})
	}
}

// regexMatcher runs a backtracking regular expression (lookahead included).
type regexMatcher struct{ re *regexp2.Regexp }

func (m regexMatcher) find(s string, yield func(span)) {
	if s == "" {
		yield(span{})
		return
	}
	runes := []rune(s)
	// regexp2 reports rune positions; byteAt maps them to byte offsets.
	byteAt := make([]int, len(runes)+1)
	off := 0
	for i, r := range runes {
		byteAt[i] = off
		off += utf8.RuneLen(r)
	}
	byteAt[len(runes)] = off
	prev := 0
	// Matching fails only on a timeout, and none is set: err stays nil.
	mt, _ := m.re.FindRunesMatch(runes)
	for mt != nil {
		start, end := byteAt[mt.Index], byteAt[mt.Index+mt.Length]
		if start > prev {
			yield(span{prev, start, false})
		}
		yield(span{start, end, true})
		prev = end
		mt, _ = m.re.FindNextMatch(mt)
	}
	if prev < len(s) {
		yield(span{prev, len(s), false})
	}
}

// scanner is a hand-written equivalent of one split expression whose
// alternatives together match every character, so matches tile the input.
type scanner interface {
	// next returns the end of the match that starts at byte i < len(s).
	next(s string, i int) int
}

type scanMatcher struct{ sc scanner }

func (m scanMatcher) find(s string, yield func(span)) {
	if s == "" {
		yield(span{})
		return
	}
	for i := 0; i < len(s); {
		e := m.sc.next(s, i)
		yield(span{i, e, true})
		i = e
	}
}

func isL(r rune) bool { return unicode.IsLetter(r) }
func isN(r rune) bool { return unicode.IsNumber(r) }

// isS is the regex class \s: Unicode White_Space.
func isS(r rune) bool { return unicode.IsSpace(r) }

// isOther is the class [^\s\p{L}\p{N}].
func isOther(r rune) bool { return !isS(r) && !isL(r) && !isN(r) }

func runeAt(s string, i int) (rune, int) {
	if i >= len(s) {
		return -1, 0
	}
	if c := s[i]; c < utf8.RuneSelf {
		return rune(c), 1
	}
	return utf8.DecodeRuneInString(s[i:])
}

// skipWhile returns the end of the run of characters satisfying f from i.
func skipWhile(s string, i int, f func(rune) bool) int {
	for i < len(s) {
		r, n := runeAt(s, i)
		if !f(r) {
			break
		}
		i += n
	}
	return i
}

// contraction returns the end of an English contraction ('s, 't, 're, 've,
// 'm, 'll, 'd) at i, or i when there is none. With fold, letters compare
// under Unicode simple case folding, as (?i) does in Oniguruma, where the
// long s (U+017F) folds to s.
func contraction(s string, i int, fold bool) int {
	if i >= len(s) || s[i] != '\'' {
		return i
	}
	eq := func(j int, want byte) (int, bool) {
		r, n := runeAt(s, j)
		if r == rune(want) {
			return j + n, true
		}
		if !fold {
			return j, false
		}
		if r == rune(want-'a'+'A') || (want == 's' && r == 'ſ') {
			return j + n, true
		}
		return j, false
	}
	j := i + 1
	for _, one := range []byte{'s', 't', 'm', 'd'} {
		if e, ok := eq(j, one); ok {
			return e
		}
	}
	for _, two := range [][2]byte{{'r', 'e'}, {'v', 'e'}, {'l', 'l'}} {
		if e, ok := eq(j, two[0]); ok {
			if e2, ok := eq(e, two[1]); ok {
				return e2
			}
		}
	}
	return i
}

// spaceRun handles the trailing alternatives shared by both expressions,
// \s+(?!\S)|\s+, for a whitespace run starting at i: the whole run when it
// ends the input or is one character long, else all but its last character.
func spaceRun(s string, i int) int {
	e := skipWhile(s, i, isS)
	if e == len(s) {
		return e
	}
	_, last := utf8.DecodeLastRuneInString(s[:e])
	if e-last > i {
		return e - last
	}
	return e
}

// llama3Scanner implements llama3Pattern (maxDigits 3) and qwen2Pattern
// (maxDigits 1).
type llama3Scanner struct{ maxDigits int }

func (sc llama3Scanner) next(s string, i int) int {
	if e := contraction(s, i, true); e > i {
		return e
	}
	r, n := runeAt(s, i)
	// [^\r\n\p{L}\p{N}]?\p{L}+
	if isL(r) {
		return skipWhile(s, i+n, isL)
	}
	if r != '\r' && r != '\n' && !isN(r) {
		if r2, n2 := runeAt(s, i+n); r2 >= 0 && isL(r2) {
			return skipWhile(s, i+n+n2, isL)
		}
	}
	// \p{N}{1,digits}
	if isN(r) {
		e := i + n
		for k := 1; k < sc.maxDigits; k++ {
			r2, n2 := runeAt(s, e)
			if r2 < 0 || !isN(r2) {
				break
			}
			e += n2
		}
		return e
	}
	//  ?[^\s\p{L}\p{N}]+[\r\n]*
	j := i
	if r == ' ' {
		j += n
	}
	if r2, _ := runeAt(s, j); r2 >= 0 && isOther(r2) {
		e := skipWhile(s, j, isOther)
		return skipWhile(s, e, func(r rune) bool { return r == '\r' || r == '\n' })
	}
	// \s*[\r\n]+: through the last line break of the whitespace run.
	e := skipWhile(s, i, isS)
	if k := strings.LastIndexAny(s[i:e], "\r\n"); k >= 0 {
		return i + k + 1
	}
	return spaceRun(s, i)
}

// gpt2Scanner implements gpt2Pattern.
type gpt2Scanner struct{}

func (gpt2Scanner) next(s string, i int) int {
	if e := contraction(s, i, false); e > i {
		return e
	}
	r, n := runeAt(s, i)
	j := i
	if r == ' ' {
		j += n
		r, _ = runeAt(s, j)
	}
	switch {
	case r < 0:
	case isL(r):
		return skipWhile(s, j, isL)
	case isN(r):
		return skipWhile(s, j, isN)
	case isOther(r):
		return skipWhile(s, j, isOther)
	}
	return spaceRun(s, i)
}
