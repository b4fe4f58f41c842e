package tokenizer

import (
	"strings"
	"unicode/utf8"
)

// decoder turns token strings back into text. Like the reference, it maps
// a list of strings to a list of strings; the results are concatenated.
type decoder interface {
	decodeChain(tokens []string) []string
}

// sequenceDec runs decoders one after the other.
type sequenceDec []decoder

func (q sequenceDec) decodeChain(tokens []string) []string {
	for _, d := range q {
		tokens = d.decodeChain(tokens)
	}
	return tokens
}

// byteLevelDec maps byte-level characters back to bytes and reads all the
// bytes as one UTF-8 text, substituting U+FFFD for ill-formed sequences.
type byteLevelDec struct{}

func (byteLevelDec) decodeChain(tokens []string) []string {
	var b []byte
	for _, t := range tokens {
		b = appendByteLevelBytes(b, t)
	}
	if utf8.Valid(b) {
		return []string{string(b)}
	}
	return []string{string(appendLossy(make([]byte, 0, len(b)+8), b))}
}

// replaceDec replaces a pattern in every token.
type replaceDec struct {
	m       matcher
	content string
}

func (d replaceDec) decodeChain(tokens []string) []string {
	out := make([]string, len(tokens))
	for i, t := range tokens {
		out[i] = replaceAll(d.m, t, d.content)
	}
	return out
}

// byteFallbackDec turns runs of <0xXX> tokens into the text their bytes
// spell; a run that is not valid UTF-8 becomes one U+FFFD per byte.
type byteFallbackDec struct{}

func (byteFallbackDec) decodeChain(tokens []string) []string {
	out := make([]string, 0, len(tokens))
	var run []byte
	flush := func() {
		if len(run) == 0 {
			return
		}
		if utf8.Valid(run) {
			out = append(out, string(run))
		} else {
			for range run {
				out = append(out, "\uFFFD")
			}
		}
		run = run[:0]
	}
	for _, t := range tokens {
		if b, ok := byteToken(t); ok {
			run = append(run, b)
			continue
		}
		flush()
		out = append(out, t)
	}
	flush()
	return out
}

// byteToken parses a byte-fallback token "<0xXX>". The two characters are
// read as Rust's u8::from_str_radix reads them, which allows a leading '+'.
func byteToken(t string) (byte, bool) {
	if len(t) != 6 || !strings.HasPrefix(t, "<0x") || t[5] != '>' {
		return 0, false
	}
	digits := t[3:5]
	if digits[0] == '+' {
		digits = digits[1:]
	}
	var v byte
	for i := 0; i < len(digits); i++ {
		d, ok := hexDigit(digits[i])
		if !ok {
			return 0, false
		}
		v = v<<4 | d
	}
	return v, true
}

func hexDigit(c byte) (byte, bool) {
	switch {
	case c >= '0' && c <= '9':
		return c - '0', true
	case c >= 'a' && c <= 'f':
		return c - 'a' + 10, true
	case c >= 'A' && c <= 'F':
		return c - 'A' + 10, true
	}
	return 0, false
}

// fuseDec joins all tokens into one.
type fuseDec struct{}

func (fuseDec) decodeChain(tokens []string) []string {
	return []string{strings.Join(tokens, "")}
}

// stripDec removes up to start leading and stop trailing occurrences of a
// character from every token.
type stripDec struct {
	content     rune
	start, stop int
}

func (d stripDec) decodeChain(tokens []string) []string {
	out := make([]string, len(tokens))
	for i, t := range tokens {
		s := t
		for k := 0; k < d.start; k++ {
			r, n := utf8.DecodeRuneInString(s)
			if n == 0 || r != d.content {
				break
			}
			s = s[n:]
		}
		for k := 0; k < d.stop; k++ {
			r, n := utf8.DecodeLastRuneInString(s)
			if n == 0 || r != d.content {
				break
			}
			s = s[:len(s)-n]
		}
		out[i] = s
	}
	return out
}

// metaspaceDec turns the replacement character back into spaces; in the
// first token it is dropped unless the scheme never prepends one.
type metaspaceDec struct {
	replacement rune
	scheme      prependScheme
}

func (d metaspaceDec) decodeChain(tokens []string) []string {
	out := make([]string, len(tokens))
	for i, t := range tokens {
		with := " "
		if i == 0 && d.scheme != prependNever {
			with = ""
		}
		out[i] = strings.ReplaceAll(t, string(d.replacement), with)
	}
	return out
}
