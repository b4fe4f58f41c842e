package tokenizer

import (
	"strings"
	"unicode"

	"golang.org/x/text/unicode/norm"
)

// normalizer rewrites a stretch of input before pre-tokenization.
type normalizer interface {
	normalize(s string) string
}

// unicodeNorm is one of the NFC, NFD, NFKC and NFKD normalizers.
type unicodeNorm struct{ form norm.Form }

func (n unicodeNorm) normalize(s string) string { return n.form.String(s) }

// sequenceNorm runs normalizers one after the other.
type sequenceNorm []normalizer

func (q sequenceNorm) normalize(s string) string {
	for _, n := range q {
		s = n.normalize(s)
	}
	return s
}

// prependNorm puts a string in front of any non-empty input.
type prependNorm struct{ prefix string }

func (n prependNorm) normalize(s string) string {
	if s == "" {
		return s
	}
	return n.prefix + s
}

// replaceNorm replaces every match of a pattern with a fixed string.
type replaceNorm struct {
	m       matcher
	content string
}

func (n replaceNorm) normalize(s string) string {
	return replaceAll(n.m, s, n.content)
}

// replaceAll replaces every match of m in s with content.
func replaceAll(m matcher, s, content string) string {
	var b strings.Builder
	m.find(s, func(sp span) {
		if sp.match {
			b.WriteString(content)
		} else {
			b.WriteString(s[sp.start:sp.end])
		}
	})
	return b.String()
}

// lowercaseNorm maps every character to its lower case, character by
// character (no context rules such as the final sigma).
type lowercaseNorm struct{}

func (lowercaseNorm) normalize(s string) string {
	var b strings.Builder
	b.Grow(len(s))
	for _, r := range s {
		if r == 'İ' {
			// The one character whose full lower-case mapping is two
			// characters long; unicode.ToLower gives the simple mapping.
			b.WriteString("i\u0307")
			continue
		}
		b.WriteRune(unicode.ToLower(r))
	}
	return b.String()
}

// stripNorm removes whitespace from either end.
type stripNorm struct{ left, right bool }

func (n stripNorm) normalize(s string) string {
	if n.left {
		s = strings.TrimLeftFunc(s, unicode.IsSpace)
	}
	if n.right {
		s = strings.TrimRightFunc(s, unicode.IsSpace)
	}
	return s
}
