package cpu

import (
	"context"
	"fmt"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/stage"
)

// HandoffInput implements stage.HandoffReceiver: MaxSeqs rows of (slot,
// token) int32 in host byte order on the first stage, nil on the others.
// On a stage that is both first and last it is Output.Handoff itself, so
// the stage's own rows are applied with no copy.
func (s *Stage) HandoffInput() collective.Buffer {
	if !s.first || s.closed {
		return nil
	}
	return s.ho.inBuf
}

// ApplyHandoff implements stage.HandoffReceiver: it records the token of
// each of the first rows of HandoffInput under its slot, where a later
// Forward fills placeholders from. A slot's token stays until a later row
// overwrites it. Rows naming a slot outside [0, MaxSeqs), a token outside
// the vocabulary or a slot twice are refused, and then none is recorded.
func (s *Stage) ApplyHandoff(ctx context.Context, rows int) error {
	switch {
	case s.closed:
		return fmt.Errorf("apply hand-off: cpu stage [%d,%d) is closed", s.lo, s.hi)
	case !s.first:
		return fmt.Errorf("apply hand-off: cpu stage [%d,%d) is not the first stage", s.lo, s.hi)
	case rows < 0 || rows > s.maxSeqs:
		return fmt.Errorf("apply hand-off: %d rows, outside [0,%d]", rows, s.maxSeqs)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("apply hand-off: %w", err)
	}
	ho := &s.ho
	in := ho.in[:rows*stage.HandoffCols]
	err := s.checkHandoff(in)
	for i := 0; i < len(in); i += stage.HandoffCols {
		if slot := in[i]; slot >= 0 && int(slot) < s.maxSeqs {
			ho.seen[slot] = false
		}
	}
	if err != nil {
		return fmt.Errorf("apply hand-off: %w", err)
	}
	for i := 0; i < len(in); i += stage.HandoffCols {
		ho.tokens[in[i]] = in[i+1]
	}
	return nil
}

// checkHandoff validates hand-off rows, marking their slots in ho.seen
// (which the caller clears).
func (s *Stage) checkHandoff(in []int32) error {
	for i := 0; i < len(in); i += stage.HandoffCols {
		slot, tok := in[i], in[i+1]
		row := i / stage.HandoffCols
		switch {
		case slot < 0 || int(slot) >= s.maxSeqs:
			return fmt.Errorf("row %d: slot %d outside [0,%d)", row, slot, s.maxSeqs)
		case tok < 0 || int(tok) >= s.m.VocabSize:
			return fmt.Errorf("row %d: token %d for slot %d outside the vocabulary [0,%d)", row, tok, slot, s.m.VocabSize)
		case s.ho.seen[slot]:
			return fmt.Errorf("row %d: slot %d appears twice", row, slot)
		}
		s.ho.seen[slot] = true
	}
	return nil
}

// reportHandoff fills out.Handoff with one (slot, token) row per sampled
// sequence of b, in batch order (last stage, after sampling).
func (s *Stage) reportHandoff(b *stage.Batch, out *stage.Output) {
	k := 0
	for i := range b.Seqs {
		q := &b.Seqs[i]
		if !q.Sample {
			continue
		}
		s.ho.out[k*stage.HandoffCols] = int32(q.Slot)
		s.ho.out[k*stage.HandoffCols+1] = out.Sampled[k].Token
		k++
	}
	out.HandoffHeader = collective.Header{Batch: b.ID, Rows: k, Cols: stage.HandoffCols, DType: collective.I32}
	out.Handoff = s.ho.outBuf
}
