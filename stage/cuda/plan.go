package cuda

import (
	"errors"
	"fmt"
	"math"

	"github.com/tandem-llm/tandem/stage"
)

// layout places the parts of the packed batch description, one int32 array
// uploaded with a single copy per Forward. Every part has a fixed offset
// sized for the stage's maxima, so kernels always read the same addresses;
// the block tables come last, so that a copy of the used part covers them.
type layout struct {
	maxTokens, maxSeqs, maxLogitRows int
	// maxBlocks is the most block-table entries of one sequence.
	maxBlocks int
}

// Word offsets of each part: per token row its token (or placeholder),
// position, KV cache row and the offset of its sequence's block table
// within the tables; the logits rows; the sampling parameters; the block
// tables, word 0 of which is the scratch block that padding reads; then,
// for eager steps with whole prefill tiles (prefillLists), the tiles and
// the rows left to the per-row attention kernel, uploaded only by those
// steps.
func (l layout) tokens() int    { return 0 }
func (l layout) pos() int       { return l.maxTokens }
func (l layout) cacheRow() int  { return 2 * l.maxTokens }
func (l layout) tableOff() int  { return 3 * l.maxTokens }
func (l layout) logitRows() int { return 4 * l.maxTokens }
func (l layout) sample() int    { return 4*l.maxTokens + l.maxLogitRows }
func (l layout) tables() int    { return l.sample() + sampleParams*l.maxSeqs }
func (l layout) tileList() int  { return (l.tables() + 1 + l.maxSeqs*l.maxBlocks + 3) &^ 3 } // 16-byte aligned (copy_words)
func (l layout) rowList() int   { return l.tileList() + 2*(l.maxTokens/prefillMinRows) }
func (l layout) words() int     { return l.rowList() + 2*l.maxTokens }

// pagedKV is what the stage knows of its paged KV cache: the geometry and
// each sequence's cached length. The blocks themselves are the leader's.
// Cache row of position p of a sequence with block table tab:
// tab[p/blockSize]·blockSize + p%blockSize. Row blocks·blockSize, past
// every block, is the scratch row: padding rows of a replayed graph write
// their keys and values there and attend to it alone.
type pagedKV struct {
	blocks, blockSize int
	maxLen            int // positions one sequence may fill
	length            map[uint64]int
}

func newPagedKV(blocks, blockSize, maxLen int) *pagedKV {
	return &pagedKV{blocks: blocks, blockSize: blockSize, maxLen: maxLen, length: map[uint64]int{}}
}

// scratch is the scratch row.
func (k *pagedKV) scratch() int { return k.blocks * k.blockSize }

// release forgets a sequence's cached length; unknown sequences are
// ignored.
func (k *pagedKV) release(seq uint64) { delete(k.length, seq) }

// planner turns a stage.Batch into the packed description, after
// validating all of it: a batch that fails validation changes nothing.
type planner struct {
	lay         layout
	first, last bool
	vocab       int
	maxPos      int
	kv          *pagedKV
	seen        map[uint64]bool // scratch of build: sequences
	slotSeq     map[int]uint64  // scratch of build: hand-off slots of sampled sequences
}

// plan is one validated batch.
type plan struct {
	words    []int32 // the packed description (a persistent buffer)
	tokens   int     // rows in the batch
	rows     int     // logits rows to compute (last stage)
	nSampled int
	// tableWords is how many words of the block tables are in use, the
	// scratch block's included.
	tableWords int
	// placeholders says a token row is a placeholder (first stage).
	placeholders bool
	// Per Seq with Logits: its first row in the logits buffer and its
	// number of rows.
	logitStart, logitCount []int
}

// uploadWords is how much of the description a step uploads: everything
// up to the block tables in use.
func (p *plan) uploadWords(lay layout) int { return lay.tables() + p.tableWords }

// reset empties p.
func (p *plan) reset() {
	p.tokens, p.rows, p.nSampled, p.tableWords, p.placeholders = 0, 0, 0, 1, false
	p.logitStart, p.logitCount = p.logitStart[:0], p.logitCount[:0]
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
	p.reset()
	if pl.seen == nil {
		pl.seen, pl.slotSeq = map[uint64]bool{}, map[int]uint64{}
	}
	clear(pl.seen)
	clear(pl.slotSeq)
	for i := range b.Seqs {
		s := &b.Seqs[i]
		if pl.seen[s.ID] {
			return fmt.Errorf("batch %d: seq %d appears twice", b.ID, s.ID)
		}
		pl.seen[s.ID] = true
		if err := pl.addSeq(b, s, p); err != nil {
			return fmt.Errorf("batch %d: seq %d: %w", b.ID, s.ID, err)
		}
	}
	return nil
}

// addSeq validates s and lays it out from row p.tokens on.
func (pl *planner) addSeq(b *stage.Batch, s *stage.Seq, p *plan) error {
	lay, kv := pl.lay, pl.kv
	n := len(s.Tokens)
	switch cached := kv.length[s.ID]; {
	case n == 0:
		return errors.New("no tokens")
	case s.Pos < 0 || s.Pos+n > pl.maxPos:
		return fmt.Errorf("positions %d..%d outside the model's %d", s.Pos, s.Pos+n-1, pl.maxPos)
	case s.Pos+n > kv.maxLen:
		return fmt.Errorf("positions %d..%d exceed the stage's %d per sequence", s.Pos, s.Pos+n-1, kv.maxLen)
	case s.Pos != cached && cached == 0:
		return fmt.Errorf("chunk starts at position %d but nothing is cached", s.Pos)
	case s.Pos != cached:
		return fmt.Errorf("chunk starts at position %d but %d positions are cached", s.Pos, cached)
	case s.Slot < 0 || s.Slot >= lay.maxSeqs:
		return fmt.Errorf("hand-off slot %d outside [0, %d)", s.Slot, lay.maxSeqs)
	}
	if b.Handoff && s.Sample {
		if o, ok := pl.slotSeq[s.Slot]; ok {
			return fmt.Errorf("hand-off slot %d is seq %d's too", s.Slot, o)
		}
		pl.slotSeq[s.Slot] = s.ID
	}
	bs := kv.blockSize
	need := (s.Pos + n + bs - 1) / bs
	if len(s.Blocks) < need {
		return fmt.Errorf("block table of %d blocks does not cover positions [0, %d) in blocks of %d", len(s.Blocks), s.Pos+n, bs)
	}
	for i, blk := range s.Blocks[:need] {
		if blk < 0 || int(blk) >= kv.blocks {
			return fmt.Errorf("block %d of the table is %d, outside the stage's [0, %d)", i, blk, kv.blocks)
		}
	}
	w := p.words
	if pl.first {
		for j, tok := range s.Tokens {
			switch {
			case tok == stage.Placeholder:
				w[lay.tokens()+p.tokens+j] = -1 - int32(s.Slot)
				p.placeholders = true
			case tok < 0 || int(tok) >= pl.vocab:
				return fmt.Errorf("token %d outside the vocabulary [0, %d)", tok, pl.vocab)
			default:
				w[lay.tokens()+p.tokens+j] = tok
			}
		}
	}
	off := p.tableWords
	copy(w[lay.tables()+off:], s.Blocks[:need])
	for j := 0; j < n; j++ {
		r, pos := p.tokens+j, s.Pos+j
		w[lay.pos()+r] = int32(pos)
		w[lay.cacheRow()+r] = s.Blocks[pos/bs]*int32(bs) + int32(pos%bs)
		w[lay.tableOff()+r] = int32(off)
	}
	if pl.last {
		if err := pl.addOutputs(s, p); err != nil {
			return err
		}
	}
	p.tableWords += need
	p.tokens += n
	return nil
}

// addOutputs assigns logits rows and sampling parameters to s, whose first
// batch row is p.tokens.
func (pl *planner) addOutputs(s *stage.Seq, p *plan) error {
	lay := pl.lay
	n := len(s.Tokens)
	if s.Logits {
		if p.rows+n > lay.maxLogitRows {
			return fmt.Errorf("logits of %d more rows exceed the stage's %d", n, lay.maxLogitRows)
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
	if err := sp.Validate(MaxLogprobs); err != nil {
		return err
	}
	if s.Index < 0 {
		return fmt.Errorf("sample index %d", s.Index)
	}
	row := p.rows - 1 // the chunk's last row, already listed when Logits is set
	if !s.Logits {
		if p.rows+1 > lay.maxLogitRows {
			return fmt.Errorf("logits rows exceed the stage's %d", lay.maxLogitRows)
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
	q[8] = int32(s.Slot)
	q[sampleApply] = 0 // set by applyOwn
	p.nSampled++
	return nil
}

// shape is what a step's kernels are launched for: token rows, logits rows
// and sampled sequences. An eager step has the batch's own; a replayed
// graph has those it was captured for, which the batch's are padded to.
// With tiles (prefill), attention follows the description's lists
// (prefillLists): the prefill kernel takes the tiles, the per-row kernel
// the rows left (eager steps with whole tiles only: a captured shape has
// none, and its per-row kernel takes every row). decode says every token
// row is the one token of its sequence (an eager batch of such, or a
// uniform decode key of query length 1), so attention may rotate and cache
// this step's keys itself (Stage.ropeInAttention).
type shape struct {
	tokens, rows, sampled int
	tiles, rowsLeft       int // prefillLists's counts (eager steps with whole tiles)
	decode                bool
}

// prefill reports whether attention follows the description's lists.
func (sh shape) prefill() bool { return sh.tiles > 0 }

// prefillLists plans attention for the first T rows of description w:
// the whole prefill tiles, for attention_prefill_d*, and the rows left to
// the per-row kernel. A tile is the rows of one sequence at consecutive
// positions that share a block of prefillTile positions, wherever they lie
// in the step; a whole one has at least prefillMinRows rows. It writes
// the whole tiles as (first row, last row) pairs at w[tileList()] and the
// other rows as (row, its sequence's first position in the step) pairs at
// w[rowList()], and returns how many of each.
func (l layout) prefillLists(w []int32, T int) (tiles, rows int) {
	off, pos := w[l.tableOff():l.tableOff()+T], w[l.pos():l.pos()+T]
	tl, rl := w[l.tileList():l.rowList()], w[l.rowList():l.words()]
	chunk := 0 // the first row of the current sequence
	for t0 := 0; t0 < T; {
		if off[t0] != off[chunk] {
			chunk = t0
		}
		t1 := t0
		for t1+1 < T && off[t1+1] == off[t0] && pos[t1+1] == pos[t1]+1 && pos[t1+1]/prefillTile == pos[t0]/prefillTile {
			t1++
		}
		if t1-t0+1 >= prefillMinRows {
			tl[2*tiles], tl[2*tiles+1] = int32(t0), int32(t1)
			tiles++
		} else {
			for r := t0; r <= t1; r++ {
				rl[2*rows], rl[2*rows+1] = int32(r), pos[chunk]
				rows++
			}
		}
		t0 = t1 + 1
	}
	return tiles, rows
}

// applyOwn has the sampler record each sampled token under its sequence's
// hand-off slot (sample.cu, [9]): a stage that is first and last applies
// its own hand-off rows in the step, with no kernel after it.
func (pl *planner) applyOwn(p *plan) {
	for i := range p.nSampled {
		p.words[pl.lay.sample()+sampleParams*i+sampleApply] = 1
	}
}

// pad fills the description past the batch's own rows up to sh, so that
// the padding of a replayed graph is harmless: token rows read token 0 at
// position 0 and write and attend to the scratch KV row (through block
// table word 0, the scratch block), logits rows normalise token row 0, and
// sampled entries sample logits row 0 greedily with no alternatives,
// reporting hand-off slot 0 in rows past the batch's. Their results are
// never read.
func (pl *planner) pad(p *plan, sh shape) {
	lay := pl.lay
	w := p.words
	scr := int32(pl.kv.scratch())
	for r := p.tokens; r < sh.tokens; r++ {
		w[lay.tokens()+r] = 0
		w[lay.pos()+r] = 0
		w[lay.cacheRow()+r] = scr
		w[lay.tableOff()+r] = 0
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
	p.reset()
	pl.pad(p, sh)
}

// commit records a batch that ran: every sequence's cached length grows by
// its chunk.
func (pl *planner) commit(b *stage.Batch) {
	for i := range b.Seqs {
		s := &b.Seqs[i]
		pl.kv.length[s.ID] = s.Pos + len(s.Tokens)
	}
}
