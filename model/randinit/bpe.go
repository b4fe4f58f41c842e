package randinit

import (
	"fmt"
	"sort"

	"github.com/dlclark/regexp2"
)

// gpt2Split is the pre-tokenization pattern of the ByteLevel pre-tokenizer
// with use_regex: contractions, runs of letters, digits or other symbols
// with an optional leading space, and whitespace.
var gpt2Split = regexp2.MustCompile(`'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`, regexp2.Unicode)

// byteSymbols maps each byte to the printable rune GPT-2's byte-level
// alphabet gives it: printable Latin-1 bytes stand for themselves, the
// others (controls, space, 0x7f-0xa0, 0xad) for 256, 257, ... in byte order.
var byteSymbols = func() [256]rune {
	var m [256]rune
	next := rune(256)
	for b := 0; b < 256; b++ {
		if b >= '!' && b <= '~' || b >= 0xa1 && b <= 0xac || b >= 0xae {
			m[b] = rune(b)
		} else {
			m[b] = next
			next++
		}
	}
	return m
}()

// byteLevel spells bytes in the byte-level alphabet.
func byteLevel(b []byte) string {
	rs := make([]rune, len(b))
	for i, c := range b {
		rs[i] = byteSymbols[c]
	}
	return string(rs)
}

// pretokenize splits text as the ByteLevel pre-tokenizer does.
func pretokenize(text string) ([]string, error) {
	var pieces []string
	m, err := gpt2Split.FindStringMatch(text)
	for ; err == nil && m != nil; m, err = gpt2Split.FindNextMatch(m) {
		pieces = append(pieces, m.String())
	}
	if err != nil {
		return nil, fmt.Errorf("pre-tokenize: %w", err)
	}
	return pieces, nil
}

// bpe is a byte-level BPE vocabulary: tokens[id] is a token in the
// byte-level alphabet, merges in rank order.
type bpe struct {
	tokens []string
	merges [][2]int
}

// trainBPE learns merges on text until the vocabulary has size tokens or no
// pair of adjacent tokens is left to merge. Each step merges the most
// frequent adjacent pair, ties going to the pair with the smaller ids, so
// training is deterministic.
func trainBPE(text string, size int) (*bpe, error) {
	pieces, err := pretokenize(text)
	if err != nil {
		return nil, err
	}
	counts := map[string]int{}
	for _, p := range pieces {
		counts[p]++
	}
	keys := make([]string, 0, len(counts))
	for k := range counts {
		keys = append(keys, k)
	}
	sort.Strings(keys)

	b := &bpe{}
	ids := map[string]int{}
	for c := 0; c < 256; c++ {
		s := byteLevel([]byte{byte(c)})
		ids[s] = len(b.tokens)
		b.tokens = append(b.tokens, s)
	}
	type word struct {
		syms  []int
		count int
	}
	words := make([]word, len(keys))
	for i, k := range keys {
		syms := make([]int, len(k))
		for j := 0; j < len(k); j++ {
			syms[j] = int(k[j])
		}
		words[i] = word{syms, counts[k]}
	}

	for len(b.tokens) < size {
		pairs := map[[2]int]int{}
		for _, w := range words {
			for j := 0; j+1 < len(w.syms); j++ {
				pairs[[2]int{w.syms[j], w.syms[j+1]}] += w.count
			}
		}
		if len(pairs) == 0 {
			break
		}
		var best [2]int
		bestCount := 0
		for p, n := range pairs {
			if n > bestCount || n == bestCount && (p[0] < best[0] || p[0] == best[0] && p[1] < best[1]) {
				best, bestCount = p, n
			}
		}
		merged := b.tokens[best[0]] + b.tokens[best[1]]
		id, ok := ids[merged]
		if !ok {
			id = len(b.tokens)
			ids[merged] = id
			b.tokens = append(b.tokens, merged)
		}
		b.merges = append(b.merges, best)
		for i := range words {
			syms := words[i].syms
			out := syms[:0]
			for j := 0; j < len(syms); j++ {
				if j+1 < len(syms) && syms[j] == best[0] && syms[j+1] == best[1] {
					out = append(out, id)
					j++
				} else {
					out = append(out, syms[j])
				}
			}
			words[i].syms = out
		}
	}
	return b, nil
}
