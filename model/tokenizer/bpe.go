package tokenizer

import (
	"fmt"
	"hash/maphash"
	"runtime"
	"strings"
	"sync"
	"unicode/utf8"
)

// bpe is the byte-pair-encoding model: a word starts as its characters'
// tokens and the lowest-ranked merge of two neighbours is applied until none
// applies (leftmost first among equal ranks).
type bpe struct {
	vocab  map[string]int32
	merges map[uint64]mergeRule
	// unk is the id of the unknown token, or -1.
	unk          int32
	fuseUnk      bool
	byteFallback bool
	ignoreMerges bool
	// prefix goes before every character but the first, suffix after the
	// last, when the word is split into its characters.
	prefix, suffix string
	// byteIDs are the ids of the <0xXX> tokens used by byte fallback, -1
	// where the vocabulary lacks one.
	byteIDs [256]int32
	cache   wordCache
	scratch sync.Pool
}

// mergeRule is what a pair of neighbouring tokens merges into.
type mergeRule struct {
	rank int32
	id   int32
}

func pairKey(a, b int32) uint64 { return uint64(uint32(a))<<32 | uint64(uint32(b)) }

// newBPE checks the vocabulary and merges against each other and builds the
// model. merges are (left, right) token pairs in rank order.
func newBPE(vocab map[string]int32, merges [][2]string, unk *string, prefix, suffix string) (*bpe, error) {
	m := &bpe{
		vocab:  vocab,
		merges: make(map[uint64]mergeRule, len(merges)),
		unk:    -1,
		prefix: prefix,
		suffix: suffix,
	}
	// Ids index a table, so they must be dense enough: a file with ids far
	// beyond its number of tokens is rejected rather than allocated for.
	limit := 2*len(vocab) + 1024
	for tok, id := range vocab {
		if id < 0 || int(id) >= limit {
			return nil, fmt.Errorf("token %q has id %d, outside [0, %d) for a vocabulary of %d tokens", tok, id, limit, len(vocab))
		}
	}
	if unk != nil {
		id, ok := vocab[*unk]
		if !ok {
			return nil, fmt.Errorf("unk_token %q is not in the vocabulary", *unk)
		}
		m.unk = id
	}
	keys, err := resolveMerges(vocab, merges, prefix)
	if err != nil {
		return nil, err
	}
	for i, k := range keys {
		// A pair listed twice keeps its last rank, as the reference does.
		m.merges[k.pair] = mergeRule{rank: int32(i), id: k.id}
	}
	for b := range m.byteIDs {
		id, ok := vocab[fmt.Sprintf("<0x%02X>", b)]
		if !ok {
			id = -1
		}
		m.byteIDs[b] = id
	}
	m.cache.init()
	m.scratch.New = func() any { return new(bpeWord) }
	return m, nil
}

// resolvedMerge is a merge's pair of token ids and the id of their join.
type resolvedMerge struct {
	pair uint64
	id   int32
}

// resolveMerges looks up the tokens of every merge, spreading the lookups
// (most of the cost of loading a large vocabulary) over the CPUs.
func resolveMerges(vocab map[string]int32, merges [][2]string, prefix string) ([]resolvedMerge, error) {
	out := make([]resolvedMerge, len(merges))
	workers := min(runtime.GOMAXPROCS(0), 1+len(merges)/20000)
	chunk := (len(merges) + workers - 1) / max(workers, 1)
	errs := make([]error, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			var joined []byte
			for i := w * chunk; i < min(len(merges), (w+1)*chunk); i++ {
				mg := merges[i]
				a, ok := vocab[mg[0]]
				if !ok {
					errs[w] = fmt.Errorf("merge %d (%q %q): %q is not in the vocabulary", i, mg[0], mg[1], mg[0])
					return
				}
				b, ok := vocab[mg[1]]
				if !ok {
					errs[w] = fmt.Errorf("merge %d (%q %q): %q is not in the vocabulary", i, mg[0], mg[1], mg[1])
					return
				}
				if len(mg[1]) < len(prefix) {
					errs[w] = fmt.Errorf("merge %d (%q %q): right side is shorter than the subword prefix %q", i, mg[0], mg[1], prefix)
					return
				}
				joined = append(append(joined[:0], mg[0]...), mg[1][len(prefix):]...)
				id, ok := vocab[string(joined)]
				if !ok {
					errs[w] = fmt.Errorf("merge %d (%q %q): result %q is not in the vocabulary", i, mg[0], mg[1], joined)
					return
				}
				out[i] = resolvedMerge{pairKey(a, b), id}
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return nil, err
		}
	}
	return out, nil
}

// maxCachedWord is the longest word (in bytes) kept in the cache.
const maxCachedWord = 256

// encode appends the tokens of word w to dst.
func (m *bpe) encode(dst []int32, w string) []int32 {
	if w == "" {
		return dst
	}
	if m.ignoreMerges {
		if id, ok := m.vocab[w]; ok {
			return append(dst, id)
		}
	}
	if ids, ok := m.cache.get(w); ok {
		return append(dst, ids...)
	}
	wd := m.scratch.Get().(*bpeWord)
	m.split(wd, w)
	m.mergeAll(wd)
	start := len(dst)
	// A word may have no tokens at all: characters outside the vocabulary
	// are dropped when there is neither byte fallback nor an unknown token.
	for i := 0; i < len(wd.id) && i >= 0; i = int(wd.next[i]) {
		dst = append(dst, wd.id[i])
	}
	m.scratch.Put(wd)
	if len(w) <= maxCachedWord {
		m.cache.put(strings.Clone(w), append([]int32(nil), dst[start:]...))
	}
	return dst
}

// bpeWord is a word as a doubly linked list of tokens; a merge links the
// right token out.
type bpeWord struct {
	id         []int32
	prev, next []int32
	heap       []mergeAt
}

func (wd *bpeWord) add(id int32) {
	n := int32(len(wd.id))
	wd.id = append(wd.id, id)
	wd.prev = append(wd.prev, n-1)
	wd.next = append(wd.next, -1)
	if n > 0 {
		wd.next[n-1] = n
	}
}

// split turns w into its characters' tokens, falling back to byte tokens or
// the unknown token for characters outside the vocabulary.
func (m *bpe) split(wd *bpeWord, w string) {
	wd.id, wd.prev, wd.next = wd.id[:0], wd.prev[:0], wd.next[:0]
	pendingUnk := false
	for i, end := 0, 0; i < len(w); i = end {
		_, n := utf8.DecodeRuneInString(w[i:])
		end = i + n
		s := w[i:end]
		if m.prefix != "" && i > 0 {
			s = m.prefix + s
		}
		if m.suffix != "" && end == len(w) {
			s += m.suffix
		}
		if id, ok := m.vocab[s]; ok {
			if pendingUnk {
				wd.add(m.unk)
				pendingUnk = false
			}
			wd.add(id)
			continue
		}
		if m.byteFallback && m.hasBytes(s) {
			for k := 0; k < len(s); k++ {
				wd.add(m.byteIDs[s[k]])
			}
			continue
		}
		if m.unk >= 0 {
			if pendingUnk && !m.fuseUnk {
				wd.add(m.unk)
			}
			pendingUnk = true
		}
	}
	if pendingUnk {
		wd.add(m.unk)
	}
}

func (m *bpe) hasBytes(s string) bool {
	for k := 0; k < len(s); k++ {
		if m.byteIDs[s[k]] < 0 {
			return false
		}
	}
	return true
}

// mergeAt is a candidate merge of the token at pos with its right neighbour.
type mergeAt struct {
	rank, pos, id int32
}

func (a mergeAt) less(b mergeAt) bool {
	return a.rank < b.rank || (a.rank == b.rank && a.pos < b.pos)
}

// mergeAll applies merges lowest rank first, leftmost first among equals.
// Removed tokens are unlinked; wd.next then walks the result from 0.
func (m *bpe) mergeAll(wd *bpeWord) {
	h := wd.heap[:0]
	for i := 0; i+1 < len(wd.id); i++ {
		if r, ok := m.merges[pairKey(wd.id[i], wd.id[i+1])]; ok {
			h = heapPush(h, mergeAt{r.rank, int32(i), r.id})
		}
	}
	removed := func(i int32) bool { return wd.id[i] < 0 }
	for len(h) > 0 {
		var top mergeAt
		top, h = heapPop(h)
		if removed(top.pos) {
			continue
		}
		right := wd.next[top.pos]
		if right < 0 {
			continue
		}
		// Skip entries made stale by an earlier merge at either side.
		r, ok := m.merges[pairKey(wd.id[top.pos], wd.id[right])]
		if !ok || r.id != top.id {
			continue
		}
		wd.id[top.pos] = top.id
		wd.id[right] = -1
		after := wd.next[right]
		wd.next[top.pos] = after
		if after >= 0 {
			wd.prev[after] = top.pos
		}
		if p := wd.prev[top.pos]; p >= 0 {
			if r, ok := m.merges[pairKey(wd.id[p], top.id)]; ok {
				h = heapPush(h, mergeAt{r.rank, p, r.id})
			}
		}
		if after >= 0 {
			if r, ok := m.merges[pairKey(top.id, wd.id[after])]; ok {
				h = heapPush(h, mergeAt{r.rank, top.pos, r.id})
			}
		}
	}
	wd.heap = h
}

func heapPush(h []mergeAt, x mergeAt) []mergeAt {
	h = append(h, x)
	for i := len(h) - 1; i > 0; {
		p := (i - 1) / 2
		if !h[i].less(h[p]) {
			break
		}
		h[i], h[p] = h[p], h[i]
		i = p
	}
	return h
}

func heapPop(h []mergeAt) (mergeAt, []mergeAt) {
	top := h[0]
	n := len(h) - 1
	h[0] = h[n]
	h = h[:n]
	for i := 0; ; {
		l, r, min := 2*i+1, 2*i+2, i
		if l < n && h[l].less(h[min]) {
			min = l
		}
		if r < n && h[r].less(h[min]) {
			min = r
		}
		if min == i {
			break
		}
		h[i], h[min] = h[min], h[i]
		i = min
	}
	return top, h
}

// wordCache maps words to their tokens for concurrent readers and writers.
// It is sharded to spread lock traffic; a full shard is emptied rather than
// evicting entry by entry.
type wordCache struct {
	seed   maphash.Seed
	shards [cacheShards]cacheShard
}

const (
	cacheShards   = 16
	cacheShardCap = 4096
)

type cacheShard struct {
	mu sync.RWMutex
	m  map[string][]int32
}

func (c *wordCache) init() {
	c.seed = maphash.MakeSeed()
	for i := range c.shards {
		c.shards[i].m = make(map[string][]int32)
	}
}

func (c *wordCache) shard(w string) *cacheShard {
	return &c.shards[maphash.String(c.seed, w)%cacheShards]
}

func (c *wordCache) get(w string) ([]int32, bool) {
	s := c.shard(w)
	s.mu.RLock()
	ids, ok := s.m[w]
	s.mu.RUnlock()
	return ids, ok
}

func (c *wordCache) put(w string, ids []int32) {
	s := c.shard(w)
	s.mu.Lock()
	if len(s.m) >= cacheShardCap {
		clear(s.m)
	}
	s.m[w] = ids
	s.mu.Unlock()
}
