package tokenizer

import "unicode/utf8"

// appendLossy appends b to dst as valid UTF-8, replacing each maximal
// ill-formed subsequence with one U+FFFD (the Unicode "substitution of
// maximal subparts" practice, which is what the reference decoder does).
// Go's own conversions differ: they replace byte by byte.
func appendLossy(dst []byte, b []byte) []byte {
	for i := 0; i < len(b); {
		c := b[i]
		if c < utf8.RuneSelf {
			dst = append(dst, c)
			i++
			continue
		}
		n, lo, hi := utf8SeqBounds(c)
		if n == 0 {
			dst = append(dst, "\uFFFD"...)
			i++
			continue
		}
		j := i + 1
		for k := 1; k < n && j < len(b); k++ {
			x := b[j]
			if k > 1 {
				lo, hi = 0x80, 0xBF
			}
			if x < lo || x > hi {
				break
			}
			j++
		}
		if j-i == n {
			dst = append(dst, b[i:j]...)
		} else {
			dst = append(dst, "\uFFFD"...)
		}
		i = j
	}
	return dst
}

// utf8SeqBounds gives the length of the UTF-8 sequence that lead byte c
// starts and the allowed range of its second byte; n is 0 when c cannot
// start a sequence.
func utf8SeqBounds(c byte) (n int, lo, hi byte) {
	switch {
	case c >= 0xC2 && c <= 0xDF:
		return 2, 0x80, 0xBF
	case c == 0xE0:
		return 3, 0xA0, 0xBF
	case c == 0xED:
		return 3, 0x80, 0x9F
	case c >= 0xE1 && c <= 0xEF:
		return 3, 0x80, 0xBF
	case c == 0xF0:
		return 4, 0x90, 0xBF
	case c >= 0xF1 && c <= 0xF3:
		return 4, 0x80, 0xBF
	case c == 0xF4:
		return 4, 0x80, 0x8F
	}
	return 0, 0, 0
}
