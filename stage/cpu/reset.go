package cpu

import "fmt"

// Reset forgets every sequence the stage holds and, on a first stage, the
// tokens recorded for hand-off slots, keeping its weights: the stage is as
// newly built for the next pipeline of a node whose layers did not change,
// where the leader prefills every request again from position 0.
func (s *Stage) Reset() error {
	if s.closed {
		return fmt.Errorf("reset: cpu stage [%d,%d) is closed", s.lo, s.hi)
	}
	clear(s.seqs)
	for i := range s.ho.tokens {
		s.ho.tokens[i] = -1
	}
	return nil
}
