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
	// preTokenize appends the pieces of seg to dst, dropping empty ones.
	preTokenize(dst []segment, seg segment) []segment
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
// behavior says, and appends the non-empty pieces to dst.
func splitBy(dst []segment, seg segment, m matcher, behavior splitBehavior, invert bool) []segment {
	var buf [64]span
	spans := m.find(buf[:0], seg.text)
	if invert {
		for i := range spans {
			spans[i].match = !spans[i].match
		}
	}
	// keep reports whether a span survives; removed spans are dropped.
	type piece struct {
		start, end int
		drop       bool
	}
	var pbuf [64]piece
	pieces := pbuf[:0]
	switch behavior {
	case splitIsolated:
		for _, sp := range spans {
			pieces = append(pieces, piece{sp.start, sp.end, false})
		}
	case splitRemoved:
		for _, sp := range spans {
			pieces = append(pieces, piece{sp.start, sp.end, sp.match})
		}
	case splitContiguous:
		prev := false
		for i, sp := range spans {
			if i > 0 && sp.match == prev {
				pieces[len(pieces)-1].end = sp.end
			} else {
				pieces = append(pieces, piece{sp.start, sp.end, false})
			}
			prev = sp.match
		}
	case splitMergedWithPrevious:
		prev := false
		for i, sp := range spans {
			if i > 0 && sp.match && !prev {
				pieces[len(pieces)-1].end = sp.end
			} else {
				pieces = append(pieces, piece{sp.start, sp.end, false})
			}
			prev = sp.match
		}
	case splitMergedWithNext:
		prev := false
		for i := len(spans) - 1; i >= 0; i-- {
			sp := spans[i]
			if i < len(spans)-1 && sp.match && !prev {
				pieces[len(pieces)-1].start = sp.start
			} else {
				pieces = append(pieces, piece{sp.start, sp.end, false})
			}
			prev = sp.match
		}
		for a, b := 0, len(pieces)-1; a < b; a, b = a+1, b-1 {
			pieces[a], pieces[b] = pieces[b], pieces[a]
		}
	}
	for _, p := range pieces {
		if p.drop || p.end == p.start {
			continue
		}
		dst = append(dst, segment{seg.text[p.start:p.end], seg.first && p.start == 0})
	}
	return dst
}

// sequencePre runs pre-tokenizers one after the other.
type sequencePre []preTokenizer

func (q sequencePre) preTokenize(dst []segment, seg segment) []segment {
	cur := []segment{seg}
	var next []segment
	for _, p := range q {
		next = next[:0]
		for _, s := range cur {
			next = p.preTokenize(next, s)
		}
		cur, next = next, cur
	}
	return append(dst, cur...)
}

// splitPre is the Split pre-tokenizer.
type splitPre struct {
	m        matcher
	behavior splitBehavior
	invert   bool
}

func (p splitPre) preTokenize(dst []segment, seg segment) []segment {
	return splitBy(dst, seg, p.m, p.behavior, p.invert)
}

// byteLevelPre is the ByteLevel pre-tokenizer: an optional leading space,
// an optional GPT-2 split, then every byte spelled as its byte-level
// character.
type byteLevelPre struct {
	addPrefixSpace bool
	// split is the GPT-2 matcher when use_regex is set, else nil.
	split matcher
}

func (p byteLevelPre) preTokenize(dst []segment, seg segment) []segment {
	if seg.text == "" {
		return dst
	}
	if p.addPrefixSpace && !strings.HasPrefix(seg.text, " ") {
		seg.text = " " + seg.text
	}
	start := len(dst)
	if p.split != nil {
		dst = splitBy(dst, seg, p.split, splitIsolated, false)
	} else {
		dst = append(dst, seg)
	}
	for i := start; i < len(dst); i++ {
		dst[i].text = string(appendByteLevel(make([]byte, 0, 2*len(dst[i].text)), dst[i].text))
	}
	return dst
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

func (p metaspacePre) preTokenize(dst []segment, seg segment) []segment {
	if seg.text == "" {
		return dst
	}
	seg.text = strings.ReplaceAll(seg.text, " ", p.replacement)
	if !strings.HasPrefix(seg.text, p.replacement) &&
		(p.scheme == prependAlways || (p.scheme == prependFirst && seg.first)) {
		seg.text = p.replacement + seg.text
	}
	if !p.split {
		return append(dst, seg)
	}
	return splitBy(dst, seg, literalMatcher{p.replacement}, splitMergedWithNext, false)
}
