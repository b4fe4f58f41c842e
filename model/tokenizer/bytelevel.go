package tokenizer

import "unicode/utf8"

// byteLevelChars is one past the largest character of the byte-level table.
const byteLevelChars = 256 + 68

// The GPT-2 byte-to-character table: printable Latin-1 bytes stand for
// themselves, the other 68 bytes are given the characters from U+0100 up, in
// byte order. Byte-level BPE vocabularies are written in these characters.
var (
	byteChar [256]rune
	// charByte inverts byteChar; -1 marks characters outside the table.
	charByte [byteLevelChars]int16
	// byteUTF8 holds each byte's character UTF-8 encoded (1 or 2 bytes).
	byteUTF8 [256][]byte
)

func init() {
	for i := range charByte {
		charByte[i] = -1
	}
	next := rune(256)
	for b := 0; b < 256; b++ {
		printable := (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF)
		if printable {
			byteChar[b] = rune(b)
		} else {
			byteChar[b] = next
			next++
		}
		charByte[byteChar[b]] = int16(b)
		byteUTF8[b] = utf8.AppendRune(nil, byteChar[b])
	}
}

// appendByteLevel appends the byte-level characters of every byte of s.
func appendByteLevel(dst []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		dst = append(dst, byteUTF8[s[i]]...)
	}
	return dst
}

// appendByteLevelBytes appends the bytes that token's characters stand for;
// a token holding any character outside the table contributes its own UTF-8
// bytes instead.
func appendByteLevelBytes(dst []byte, token string) []byte {
	start := len(dst)
	for _, r := range token {
		if r >= byteLevelChars || charByte[r] < 0 {
			return append(dst[:start], token...)
		}
		dst = append(dst, byte(charByte[r]))
	}
	return dst
}
