package cuda

import (
	"fmt"

	"github.com/tandem-llm/tandem/gpu"
)

// Reset forgets every sequence the stage holds and, on a first stage, the
// tokens recorded for hand-off slots, keeping its weights, workspace and
// CUDA graphs: the stage is as newly built for the next pipeline of a node
// whose layers did not change, where the leader prefills every request
// again from position 0.
func (s *Stage) Reset() error {
	if s.closed {
		return fmt.Errorf("cuda stage [%d,%d): reset after close", s.lo, s.hi)
	}
	if s.launched > 0 {
		return fmt.Errorf("cuda stage [%d,%d): reset while %d batches are launched", s.lo, s.hi, s.launched)
	}
	clear(s.pl.kv.length)
	if !s.first {
		return nil
	}
	err := s.dev.Do(func() error {
		if err := gpu.MemsetD32Async(s.ho.tokens, 0xffffffff, s.pl.lay.maxSeqs, s.stream); err != nil {
			return err
		}
		return s.stream.Synchronize()
	})
	if err != nil {
		return fmt.Errorf("cuda stage [%d,%d): reset: clear the hand-off slots: %w", s.lo, s.hi, err)
	}
	return nil
}
