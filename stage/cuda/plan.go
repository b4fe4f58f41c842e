package cuda

import (
	"fmt"
	"math"

	"github.com/tandem-llm/tandem/stage"
)

// layout places the parts of the packed batch description, one int32 array
// uploaded with a single copy per Forward. Every part has a fixed offset
// sized for the stage's maxima, so kernels always read the same addresses.
type layout struct {
	maxTokens, maxSeqs, maxLogitRows int
}

// Word offsets of each part.
func (l layout) tokens() int    { return 0 }
func (l layout) pos() int       { return l.maxTokens }
func (l layout) cacheRow() int  { return 2 * l.maxTokens }
func (l layout) kvBase() int    { return 3 * l.maxTokens }
func (l layout) logitRows() int { return 4 * l.maxTokens }
func (l layout) sample() int    { return 4*l.maxTokens + l.maxLogitRows }
func (l layout) words() int     { return l.sample() + sampleParams*l.maxSeqs }

// kvSlots maps sequences to slots of the contiguous KV cache and tracks how
// many positions of each slot are filled. Cache row of position p of the
// sequence in slot s: s*maxLen + p.
type kvSlots struct {
	maxLen int
	slot   map[uint64]int
	length []int
	free   []int // a stack; the lowest slot on top
}

func newKVSlots(slots, maxLen int) *kvSlots {
	k := &kvSlots{maxLen: maxLen, slot: map[uint64]int{}, length: make([]int, slots)}
	for s := slots - 1; s >= 0; s-- {
		k.free = append(k.free, s)
	}
	return k
}

// scratch is the cache row past every slot's rows: padding rows of a
// replayed graph write their keys and values there and attend to it alone.
func (k *kvSlots) scratch() int { return len(k.length) * k.maxLen }

// release drops a sequence's slot; unknown sequences are ignored.
func (k *kvSlots) release(seq uint64) {
	s, ok := k.slot[seq]
	if !ok {
		return
	}
	delete(k.slot, seq)
	k.length[s] = 0
	k.free = append(k.free, s)
}

// planner turns a stage.Batch into the packed description, after
// validating all of it: a batch that fails validation changes nothing.
type planner struct {
	lay         layout
	first, last bool
	vocab       int
	maxPos      int
	kv          *kvSlots
}

// plan is one validated batch.
type plan struct {
	words    []int32 // the packed description (a persistent buffer)
	tokens   int     // rows in the batch
	rows     int     // logits rows to compute (last stage)
	nSampled int
	slots    []int // slot of each Seq, in batch order
	fresh    int   // how many of slots are newly taken from the free list
	// Per Seq with Logits: its first row in the logits buffer and its
	// number of rows.
	logitStart, logitCount []int
}

// build validates b and fills p (whose slices it reuses).
func (pl *planner) build(b *stage.Batch, p *plan) error {
	lay := pl.lay
	if len(b.Seqs) == 0 {
		return fmt.Errorf("batch %d: no sequences", b.ID)
	}
	if len(b.Seqs) > lay.maxSeqs {
		return fmt.Errorf("batch %d: %d sequences; the stage takes at most %d", b.ID, len(b.Seqs), lay.maxSeqs)
	}
	if n := b.NumTokens(); n > lay.maxTokens {
		return fmt.Errorf("batch %d: %d tokens; the stage takes at most %d", b.ID, n, lay.maxTokens)
	}
	p.tokens, p.rows, p.nSampled, p.fresh = 0, 0, 0, 0
	p.slots = p.slots[:0]
	p.logitStart, p.logitCount = p.logitStart[:0], p.logitCount[:0]
	w := p.words
	kv := pl.kv
	seen := make(map[uint64]bool, len(b.Seqs))
	for i := range b.Seqs {
		s := &b.Seqs[i]
		n := len(s.Tokens)
		if seen[s.ID] {
			return fmt.Errorf("batch %d: seq %d appears twice", b.ID, s.ID)
		}
		seen[s.ID] = true
		if n == 0 {
			return fmt.Errorf("batch %d: seq %d has no tokens", b.ID, s.ID)
		}
		if s.Pos < 0 || s.Pos+n > pl.maxPos {
			return fmt.Errorf("batch %d: seq %d: positions %d..%d outside the model's %d", b.ID, s.ID, s.Pos, s.Pos+n-1, pl.maxPos)
		}
		if s.Pos+n > kv.maxLen {
			return fmt.Errorf("batch %d: seq %d: positions %d..%d exceed the KV cache's %d per sequence", b.ID, s.ID, s.Pos, s.Pos+n-1, kv.maxLen)
		}
		slot, known := kv.slot[s.ID]
		switch {
		case known && kv.length[slot] != s.Pos:
			return fmt.Errorf("batch %d: seq %d: chunk starts at position %d but %d positions are cached", b.ID, s.ID, s.Pos, kv.length[slot])
		case !known && s.Pos != 0:
			return fmt.Errorf("batch %d: seq %d: chunk starts at position %d but nothing is cached", b.ID, s.ID, s.Pos)
		case !known:
			if p.fresh == len(kv.free) {
				return fmt.Errorf("batch %d: seq %d: all %d KV slots are in use", b.ID, s.ID, len(kv.length))
			}
			slot = kv.free[len(kv.free)-1-p.fresh]
			p.fresh++
		}
		p.slots = append(p.slots, slot)
		if pl.first {
			for _, tok := range s.Tokens {
				if tok < 0 || int(tok) >= pl.vocab {
					return fmt.Errorf("batch %d: seq %d: token %d outside the vocabulary [0, %d)", b.ID, s.ID, tok, pl.vocab)
				}
			}
		}
		base := slot * kv.maxLen
		for j := 0; j < n; j++ {
			r := p.tokens + j
			w[lay.tokens()+r] = s.Tokens[j]
			w[lay.pos()+r] = int32(s.Pos + j)
			w[lay.cacheRow()+r] = int32(base + s.Pos + j)
			w[lay.kvBase()+r] = int32(base)
		}
		if pl.last {
			if err := pl.addOutputs(b, s, p); err != nil {
				return err
			}
		}
		p.tokens += n
	}
	return nil
}

// addOutputs assigns logits rows and sampling parameters to s, whose first
// batch row is p.tokens.
func (pl *planner) addOutputs(b *stage.Batch, s *stage.Seq, p *plan) error {
	lay := pl.lay
	n := len(s.Tokens)
	if s.Logits {
		if p.rows+n > lay.maxLogitRows {
			return fmt.Errorf("batch %d: seq %d: logits of %d more rows exceed the stage's %d", b.ID, s.ID, n, lay.maxLogitRows)
		}
		p.logitStart = append(p.logitStart, p.rows)
		p.logitCount = append(p.logitCount, n)
		for j := 0; j < n; j++ {
			p.words[lay.logitRows()+p.rows] = int32(p.tokens + j)
			p.rows++
		}
	}
	if !s.Sample {
		return nil
	}
	sp := s.Sampling
	switch {
	case !(sp.Temperature >= 0) || math.IsInf(float64(sp.Temperature), 0):
		return fmt.Errorf("batch %d: seq %d: temperature %v", b.ID, s.ID, sp.Temperature)
	case sp.TopK < 0:
		return fmt.Errorf("batch %d: seq %d: top-k %d", b.ID, s.ID, sp.TopK)
	case !(sp.TopP >= 0 && sp.TopP <= 1):
		return fmt.Errorf("batch %d: seq %d: top-p %v outside [0, 1]", b.ID, s.ID, sp.TopP)
	case sp.Logprobs < 0 || sp.Logprobs > MaxLogprobs:
		return fmt.Errorf("batch %d: seq %d: %d logprobs; at most %d", b.ID, s.ID, sp.Logprobs, MaxLogprobs)
	case s.Index < 0:
		return fmt.Errorf("batch %d: seq %d: sample index %d", b.ID, s.ID, s.Index)
	}
	row := p.rows - 1 // the chunk's last row, already listed when Logits is set
	if !s.Logits {
		if p.rows+1 > lay.maxLogitRows {
			return fmt.Errorf("batch %d: seq %d: logits rows exceed the stage's %d", b.ID, s.ID, lay.maxLogitRows)
		}
		row = p.rows
		p.words[lay.logitRows()+row] = int32(p.tokens + n - 1)
		p.rows++
	}
	q := p.words[lay.sample()+sampleParams*p.nSampled:]
	q[0] = int32(row)
	q[1] = int32(math.Float32bits(sp.Temperature))
	q[2] = int32(sp.TopK)
	q[3] = int32(math.Float32bits(sp.TopP))
	q[4] = int32(uint32(sp.Seed))
	q[5] = int32(uint32(sp.Seed >> 32))
	q[6] = int32(s.Index)
	q[7] = int32(sp.Logprobs)
	p.nSampled++
	return nil
}

// shape is what a step's kernels are launched for: token rows, logits rows
// and sampled sequences. An eager step has the batch's own; a replayed
// graph has those it was captured for, which the batch's are padded to.
type shape struct{ tokens, rows, sampled int }

// pad fills the description past the batch's own rows up to sh, so that
// the padding of a replayed graph is harmless: token rows read token 0 at
// position 0 and write and attend to the scratch KV row, logits rows
// normalise token row 0, and sampled entries sample logits row 0 greedily
// with no alternatives. Their results are never read.
func (pl *planner) pad(p *plan, sh shape) {
	lay := pl.lay
	w := p.words
	scr := int32(pl.kv.scratch())
	for r := p.tokens; r < sh.tokens; r++ {
		w[lay.tokens()+r] = 0
		w[lay.pos()+r] = 0
		w[lay.cacheRow()+r] = scr
		w[lay.kvBase()+r] = scr
	}
	for r := p.rows; r < sh.rows; r++ {
		w[lay.logitRows()+r] = 0
	}
	for i := p.nSampled; i < sh.sampled; i++ {
		clear(w[lay.sample()+sampleParams*i : lay.sample()+sampleParams*(i+1)])
	}
}

// padding makes p a batch of padding alone, of shape sh: what Capture's
// eager warm-up runs.
func (pl *planner) padding(p *plan, sh shape) {
	p.tokens, p.rows, p.nSampled, p.fresh = 0, 0, 0, 0
	p.slots, p.logitStart, p.logitCount = p.slots[:0], p.logitStart[:0], p.logitCount[:0]
	pl.pad(p, sh)
}

// commit records a batch that ran: new sequences take their slots and
// every sequence's cached length grows by its chunk.
func (pl *planner) commit(b *stage.Batch, p *plan) {
	kv := pl.kv
	kv.free = kv.free[:len(kv.free)-p.fresh]
	for i := range b.Seqs {
		s := &b.Seqs[i]
		kv.slot[s.ID] = p.slots[i]
		kv.length[p.slots[i]] = s.Pos + len(s.Tokens)
	}
}
