package cuda

import (
	"context"
	"fmt"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/stage"
)

// HandoffInput implements stage.HandoffReceiver: a device buffer (a
// gpu.Mem) of MaxSeqs rows of (slot, token) int32 on the first stage, nil
// on the others. On a stage that is both first and last it is
// Output.Handoff itself, so the stage's own rows are applied with no copy.
func (s *Stage) HandoffInput() collective.Buffer {
	if !s.first || s.closed {
		return nil
	}
	return s.ho.in
}

// ApplyHandoff implements stage.HandoffReceiver: one kernel records the
// token of each of the first rows of HandoffInput under its slot in the
// device's slot table, where the embedding of a later Forward reads
// placeholders from; the tokens never visit the host. A slot's token stays
// until a later row overwrites it. Rows naming a slot outside [0, MaxSeqs),
// a token outside the vocabulary or a slot twice are refused, and then none
// is recorded. ApplyHandoff waits for the kernel, so HandoffInput may be
// overwritten as soon as it returns.
func (s *Stage) ApplyHandoff(ctx context.Context, rows int) error {
	if err := s.checkHandoff(ctx, rows); err != nil || rows == 0 {
		return err
	}
	err := s.dev.Do(func() error {
		if err := s.handoffKernel(rows); err != nil {
			return err
		}
		return s.readStatus()
	})
	if err == nil {
		err = s.statusError(s.ho.host, nil)
	}
	if err != nil {
		return fmt.Errorf("cuda stage [%d,%d): apply hand-off of %d rows: %w", s.lo, s.hi, rows, err)
	}
	return nil
}

// QueueHandoff implements stage.LinkedLauncher: ApplyHandoff's kernel,
// ordered on the stage's stream and not waited for. The kernel records a
// refused row in the status array, which the next batch launched that
// reads placeholders reads back and fails on.
func (s *Stage) QueueHandoff(ctx context.Context, rows int) error {
	if err := s.checkHandoff(ctx, rows); err != nil || rows == 0 {
		return err
	}
	if err := s.dev.Do(func() error { return s.handoffKernel(rows) }); err != nil {
		return fmt.Errorf("cuda stage [%d,%d): queue the hand-off of %d rows: %w", s.lo, s.hi, rows, err)
	}
	return nil
}

// checkHandoff checks a hand-off of rows rows before its kernel is ordered.
func (s *Stage) checkHandoff(ctx context.Context, rows int) error {
	switch {
	case s.closed:
		return fmt.Errorf("cuda stage [%d,%d): apply hand-off after close", s.lo, s.hi)
	case !s.first:
		return fmt.Errorf("cuda stage [%d,%d): apply hand-off: not the first stage", s.lo, s.hi)
	case rows < 0 || rows > s.pl.lay.maxSeqs:
		return fmt.Errorf("cuda stage [%d,%d): apply hand-off: %d rows, outside [0, %d]", s.lo, s.hi, rows, s.pl.lay.maxSeqs)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("cuda stage [%d,%d): apply hand-off: %w", s.lo, s.hi, err)
	}
	return nil
}

// handoffKernel orders the kernel that records the first rows of the
// hand-off input under their slots. Device goroutine only.
func (s *Stage) handoffKernel(rows int) error {
	a := s.args.Reset().Ptr(s.ho.in.Ptr()).Int32(int32(rows)).Ptr(s.ho.tokens).Int32(int32(s.pl.lay.maxSeqs)).
		Int32(int32(s.m.VocabSize)).Ptr(s.ho.status)
	return s.launch("handoff", kHandoff, gpu.Dim3{X: 1}, gpu.Dim3{X: handoffThreads}, a)
}

// readStatus copies the status array into ho.host and waits for the
// stream. Device goroutine only.
func (s *Stage) readStatus() error {
	if err := gpu.CopyDtoHAsync(gpu.AsBytes(s.ho.host), s.ho.status, s.stream); err != nil {
		return fmt.Errorf("read hand-off status: %w", err)
	}
	if err := s.stream.Synchronize(); err != nil {
		return fmt.Errorf("read hand-off status: %w", err)
	}
	return nil
}

// statusError reports the error the kernels recorded in the status array,
// as read back into st, naming the sequence of b (nil: none ran) at fault,
// and clears it on the device; nil when there is none.
func (s *Stage) statusError(st []int32, b *stage.Batch) error {
	if st[0] == 0 {
		return nil
	}
	code, a, slot, tok := st[0], st[1], st[2], st[3]
	clear(st)
	if err := s.dev.Do(func() error {
		if err := gpu.MemsetD32Async(s.ho.status, 0, statusWords, s.stream); err != nil {
			return err
		}
		return s.stream.Synchronize()
	}); err != nil {
		return fmt.Errorf("clear hand-off status: %w", err)
	}
	switch code {
	case statusNoToken:
		if b == nil {
			return fmt.Errorf("token row %d: placeholder, but no token is recorded for hand-off slot %d", a, slot)
		}
		row, id, pos := int(a), uint64(0), 0
		for i := range b.Seqs {
			q := &b.Seqs[i]
			if row < len(q.Tokens) {
				id, pos = q.ID, q.Pos+row
				break
			}
			row -= len(q.Tokens)
		}
		return fmt.Errorf("seq %d: placeholder at position %d, but no token is recorded for hand-off slot %d", id, pos, slot)
	case statusBadRow:
		why := fmt.Sprintf("slot %d appears twice", slot)
		switch {
		case slot < 0 || int(slot) >= s.pl.lay.maxSeqs:
			why = fmt.Sprintf("slot %d outside [0, %d)", slot, s.pl.lay.maxSeqs)
		case tok < 0 || int(tok) >= s.m.VocabSize:
			why = fmt.Sprintf("token %d outside the vocabulary [0, %d)", tok, s.m.VocabSize)
		}
		return fmt.Errorf("hand-off row %d refused (%s): nothing recorded", a, why)
	}
	return fmt.Errorf("unknown hand-off status %d", code)
}

var _ stage.HandoffReceiver = (*Stage)(nil)
