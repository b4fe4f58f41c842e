package stagetest

import (
	"fmt"
	"math/rand/v2"

	"github.com/tandem-llm/tandem/stage"
)

// BlockTables hands out KV blocks to the sequences of batches built by
// hand, as a leader would, for tests of stages with a paged KV cache. The
// blocks come in a scrambled order, so that tables are not ranges of
// consecutive ids, and blocks freed are handed out again first.
type BlockTables struct {
	blockSize int
	free      []int32 // next out last
	tables    map[uint64][]int32
}

// NewBlockTables hands out numBlocks blocks of blockSize positions,
// scrambled by seed.
func NewBlockTables(numBlocks, blockSize int, seed uint64) *BlockTables {
	bt := &BlockTables{blockSize: blockSize, free: make([]int32, numBlocks), tables: map[uint64][]int32{}}
	for i := range bt.free {
		bt.free[i] = int32(i)
	}
	rand.New(rand.NewPCG(seed, 5)).Shuffle(numBlocks, func(i, j int) { bt.free[i], bt.free[j] = bt.free[j], bt.free[i] })
	return bt
}

// TablesFor returns the block tables to use for the stages of a pipeline:
// their block size and least capacity, or, when none has a paged cache,
// tables they will ignore.
func TablesFor(stages []stage.Stage, seed uint64) *BlockTables {
	blocks, size := 0, 0
	for _, st := range stages {
		if info := st.Info(); info.KVBlocks > 0 {
			if blocks == 0 || info.KVBlocks < blocks {
				blocks = info.KVBlocks
			}
			size = info.BlockSize
		}
	}
	if blocks == 0 {
		blocks, size = 1<<12, 16
	}
	return NewBlockTables(blocks, size, seed)
}

// Fill extends the block table of every sequence of b to cover its chunk
// and sets Seq.Blocks to it. It fails when the blocks run out.
func (bt *BlockTables) Fill(b *stage.Batch) error {
	for i := range b.Seqs {
		q := &b.Seqs[i]
		t := bt.tables[q.ID]
		need := (q.Pos + len(q.Tokens) + bt.blockSize - 1) / bt.blockSize
		for len(t) < need {
			if len(bt.free) == 0 {
				return fmt.Errorf("block tables: out of blocks for seq %d at position %d", q.ID, q.Pos+len(q.Tokens))
			}
			t = append(t, bt.free[len(bt.free)-1])
			bt.free = bt.free[:len(bt.free)-1]
		}
		bt.tables[q.ID] = t
		q.Blocks = t[:need:need]
	}
	return nil
}

// Free returns a sequence's blocks.
func (bt *BlockTables) Free(seq uint64) {
	t := bt.tables[seq]
	for i := len(t) - 1; i >= 0; i-- {
		bt.free = append(bt.free, t[i])
	}
	delete(bt.tables, seq)
}
