package tokenizer

import "strings"

// segment is a stretch of normalized input on its way to the model.
type segment struct {
	text string
	// first is set when the segment starts at the beginning of the input.
	first bool
}

// preTokenizer cuts segments into the words the model encodes one by one.
type preTokenizer interface {
	// preTokenize calls emit with the non-empty pieces of seg, in order.
	preTokenize(seg segment, emit func(segment))
}

// splitBehavior says what a split does with the pattern's matches.
type splitBehavior int

const (
	splitRemoved splitBehavior = iota
	splitIsolated
	splitMergedWithPrevious
	splitMergedWithNext
	splitContiguous
)

var splitBehaviors = map[string]splitBehavior{
	"Removed":            splitRemoved,
	"Isolated":           splitIsolated,
	"MergedWithPrevious": splitMergedWithPrevious,
	"MergedWithNext":     splitMergedWithNext,
	"Contiguous":         splitContiguous,
}

// splitBy cuts seg at the spans m finds, treating the matched spans as
// behavior says, and emits the non-empty pieces:
//   - Removed drops the matches;
//   - Isolated keeps each match as a piece of its own;
//   - MergedWithPrevious appends a match to the piece before it;
//   - MergedWithNext prepends a match to the piece after it;
//   - Contiguous joins neighbouring spans that both match or both do not.
func splitBy(seg segment, m matcher, behavior splitBehavior, invert bool, emit func(segment)) {
	out := func(start, end int) {
		if end > start {
			emit(segment{seg.text[start:end], seg.first && start == 0})
		}
	}
	// pend is a piece that the next span may still extend.
	var pend span
	havePend, prevMatch := false, false
	m.find(seg.text, func(sp span) {
		if invert {
			sp.match = !sp.match
		}
		switch behavior {
		case splitIsolated:
			out(sp.start, sp.end)
		case splitRemoved:
			if !sp.match {
				out(sp.start, sp.end)
			}
		case splitContiguous, splitMergedWithPrevious:
			extend := sp.match == prevMatch
			if behavior == splitMergedWithPrevious {
				extend = sp.match && !prevMatch
			}
			if havePend && extend {
				pend.end = sp.end
				break
			}
			if havePend {
				out(pend.start, pend.end)
			}
			pend, havePend = sp, true
		case splitMergedWithNext:
			if havePend && pend.match && !sp.match {
				out(pend.start, sp.end)
				havePend = false
				break
			}
			if havePend {
				out(pend.start, pend.end)
			}
			pend, havePend = sp, true
		}
		prevMatch = sp.match
	})
	if havePend {
		out(pend.start, pend.end)
	}
}

// sequencePre runs pre-tokenizers one after the other.
type sequencePre []preTokenizer

func (q sequencePre) preTokenize(seg segment, emit func(segment)) {
	// Chain the stages once: stage i emits into stage i+1.
	next := emit
	for i := len(q) - 1; i > 0; i-- {
		p, into := q[i], next
		next = func(s segment) { p.preTokenize(s, into) }
	}
	if len(q) == 0 {
		emit(seg)
		return
	}
	q[0].preTokenize(seg, next)
}

// splitPre is the Split pre-tokenizer.
type splitPre struct {
	m        matcher
	behavior splitBehavior
	invert   bool
}

func (p splitPre) preTokenize(seg segment, emit func(segment)) {
	splitBy(seg, p.m, p.behavior, p.invert, emit)
}

// byteLevelPre is the ByteLevel pre-tokenizer: an optional leading space,
// an optional GPT-2 split, then every byte spelled as its byte-level
// character.
type byteLevelPre struct {
	addPrefixSpace bool
	// split is the GPT-2 matcher when use_regex is set, else nil.
	split matcher
}

func (p byteLevelPre) preTokenize(seg segment, emit func(segment)) {
	if seg.text == "" {
		return
	}
	if p.addPrefixSpace && !strings.HasPrefix(seg.text, " ") {
		seg.text = " " + seg.text
	}
	if p.split != nil {
		splitBy(seg, p.split, splitIsolated, false, func(s segment) { emit(spellByteLevel(s)) })
	} else {
		emit(spellByteLevel(seg))
	}
}

// spellByteLevel replaces every byte of the segment with its byte-level
// character.
func spellByteLevel(s segment) segment {
	var buf [128]byte
	s.text = string(appendByteLevel(buf[:0], s.text))
	return s
}

// prependScheme says when Metaspace puts a replacement character in front.
type prependScheme int

const (
	prependAlways prependScheme = iota
	prependFirst
	prependNever
)

// metaspacePre is the Metaspace pre-tokenizer (SentencePiece style): spaces
// become the replacement character, which optionally starts the segment,
// and words optionally split before each replacement character.
type metaspacePre struct {
	replacement string
	scheme      prependScheme
	split       bool
}

func (p metaspacePre) preTokenize(seg segment, emit func(segment)) {
	if seg.text == "" {
		return
	}
	seg.text = strings.ReplaceAll(seg.text, " ", p.replacement)
	if !strings.HasPrefix(seg.text, p.replacement) &&
		(p.scheme == prependAlways || (p.scheme == prependFirst && seg.first)) {
		seg.text = p.replacement + seg.text
	}
	if !p.split {
		emit(seg)
		return
	}
	splitBy(seg, literalMatcher{p.replacement}, splitMergedWithNext, false, emit)
}
