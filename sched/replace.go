package sched

import (
	"cmp"
	"fmt"
	"slices"
)

// Replace moves the scheduler onto a new pipeline configured by cfg (its
// KV capacity, steps in flight and hand-off may differ from the old one's):
// the steps in flight are abandoned, and their results must never reach
// Complete; every running request goes back to waiting by recompute, to
// prefill its prompt and the tokens generated so far on the new pipeline,
// whose KV cache starts empty with cfg.NumBlocks blocks; the new stages
// are told to free nothing. Requests keep their arrival order and the
// index of their next sample, so their outputs continue exactly where they
// stopped, with no token repeated or skipped, and seeded sampling gives
// the tokens of an uninterrupted run. A request that no longer fits
// (longer than cfg.MaxModelLen or than the whole new KV capacity) ends: its
// id is returned for the caller to fail. An invalid cfg changes nothing.
func (sc *Scheduler) Replace(cfg Config) (dropped []uint64, err error) {
	cfg, err = cfg.withDefaults()
	if err != nil {
		return nil, fmt.Errorf("scheduler config: %w", err)
	}
	sc.cfg = cfg
	live := make([]*seq, 0, len(sc.seqs))
	for _, s := range sc.seqs {
		live = append(live, s)
	}
	slices.SortFunc(live, func(a, b *seq) int { return cmp.Compare(a.arrival, b.arrival) })
	sc.running, sc.waiting = sc.running[:0], sc.waiting[:0]
	for _, s := range live {
		if s.state == running {
			sc.stats.Reprefilled++
			sc.stats.ReprefilledTokens += uint64(s.computed)
			sc.cfg.Counters.reprefilled.Add(1)
			sc.cfg.Counters.reprefilledTokens.Add(uint64(s.computed))
		}
		// Steps in flight alias the old block tables: drop them, never
		// reuse them.
		s.blocks, s.slot = nil, -1
		s.computed, s.pending, s.inflight, s.handoff = 0, 0, 0, 0
		s.epoch++
		s.started = false // the new stages hold nothing of it
		if err := sc.cfg.check(&s.req); err != nil {
			s.state = ended
			delete(sc.seqs, s.req.ID)
			dropped = append(dropped, s.req.ID)
			continue
		}
		s.state = waiting
		sc.waiting = append(sc.waiting, s)
	}
	// The steps in flight are abandoned with their slices, which the old
	// pipeline may still read.
	sc.flights, sc.toFree = nil, nil
	sc.handoffs, sc.handoffsDone = 0, 0
	sc.emptyCache()
	return dropped, nil
}

// Fail ends a request at once, as Cancel does, for a reason of the
// caller's (no pipeline could serve it in time); Stats counts it as
// failed. It reports whether the request was live.
func (sc *Scheduler) Fail(id uint64) bool {
	s := sc.seqs[id]
	if s == nil {
		return false
	}
	sc.end(s)
	sc.stats.Failed++
	sc.cfg.Counters.failed.Add(1)
	return true
}
