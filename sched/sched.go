package sched

import (
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/tandem-llm/tandem/pipeline"
	"github.com/tandem-llm/tandem/stage"
)

// Scheduler is the synchronous core: it decides what each step carries and
// turns results into outputs. It starts no goroutines and reads time only
// through the clock it was given.
type Scheduler struct {
	cfg   Config
	clock func() time.Time

	seqs    map[uint64]*seq // live requests
	running []*seq          // admitted, by arrival
	waiting []*seq          // not admitted or preempted, by arrival
	free    []int32         // free KV blocks, reused last freed first
	flights []*flight       // steps in flight, oldest first
	spare   []*flight       // completed steps, their slices reused
	outs    []Output        // Complete's result
	toFree  []uint64        // sequences the stages drop with the next step
	// slots are the free hand-off slots (OnDeviceHandoff only): a stack,
	// lowest on top at first.
	slots []int
	// handoffs counts the steps scheduled with Batch.Handoff set;
	// handoffsDone those among them whose result has come back.
	handoffs, handoffsDone int

	// lengthRatio is a moving average, over finished requests, of the
	// fraction of their MaxTokens they generated (1 at first): admission
	// expects a request to generate that fraction of its MaxTokens.
	lengthRatio float64

	arrivals  uint64 // requests added so far
	lastBatch uint64 // id of the last step handed out
	stats     Stats
}

type state uint8

const (
	waiting state = iota
	running
	ended // finished or cancelled
)

// seq is one request's state.
type seq struct {
	req     Request
	arrival uint64
	state   state
	// tokens are the prompt, then the generated tokens known so far.
	tokens []int32
	// computed is the number of positions fed to the pipeline, steps in
	// flight included; blocks cover exactly those positions.
	computed int
	blocks   []int32
	// pending counts samples in flight whose token is not known yet: the
	// sequence's placeholders.
	pending int
	// inflight counts steps in flight that carry the sequence.
	inflight int
	// epoch changes whenever what is in flight for the sequence must be
	// dropped on its return (preemption, cancellation, finish).
	epoch uint64
	// batch is the last step the sequence was placed in.
	batch uint64
	// started is set once stages may hold state for the sequence;
	// scheduled is when that happened.
	started   bool
	scheduled time.Time
	// slot is the sequence's hand-off slot while it runs with
	// OnDeviceHandoff (-1: none).
	slot int
	// handoff is the number of hand-off steps up to and including the last
	// one that samples for the sequence: the first stage has the token a
	// placeholder of the sequence stands for once it has applied that many.
	handoff int
	// preempted counts the sequence's preemptions.
	preempted int
}

func (s *seq) generated() int { return len(s.tokens) - len(s.req.Prompt) }

// flight is a step in flight.
type flight struct {
	batch uint64
	// handoff is the step's number among the hand-off steps (0: not one).
	handoff int
	start   time.Time
	seqs    []stage.Seq // the step's sequences
	entries []entry     // one per sequence
}

type entry struct {
	s      *seq
	epoch  uint64
	sample bool
}

// New returns a scheduler with an empty KV cache of cfg.NumBlocks blocks.
// clock is read when a step is scheduled and when its result arrives (nil:
// time.Now).
func New(cfg Config, clock func() time.Time) (*Scheduler, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, fmt.Errorf("scheduler config: %w", err)
	}
	if clock == nil {
		clock = time.Now
	}
	sc := &Scheduler{cfg: cfg, clock: clock, seqs: make(map[uint64]*seq), lengthRatio: 1}
	sc.emptyCache()
	return sc, nil
}

// emptyCache makes every KV block and hand-off slot of the configuration
// free.
func (sc *Scheduler) emptyCache() {
	// Hand out low ids first: the stack pops from the end.
	sc.free = make([]int32, sc.cfg.NumBlocks)
	for i := range sc.free {
		sc.free[i] = int32(sc.cfg.NumBlocks - 1 - i)
	}
	sc.slots = nil
	if sc.cfg.OnDeviceHandoff {
		// At most HandoffSlots requests run with hand-off.
		sc.slots = make([]int, sc.cfg.HandoffSlots)
		for i := range sc.slots {
			sc.slots[i] = sc.cfg.HandoffSlots - 1 - i
		}
	}
}

// Config is the configuration in use, defaults filled in.
func (sc *Scheduler) Config() Config { return sc.cfg }

// Add queues a request. It fails, changing nothing, for an empty prompt,
// MaxTokens below 1, a request longer than MaxModelLen or than the whole KV
// capacity, or the id of a live request; and with an error wrapping
// ErrQueueFull when MaxNumWaiting requests wait already.
func (sc *Scheduler) Add(r Request) error {
	if sc.seqs[r.ID] != nil {
		return fmt.Errorf("request %d: id already in use", r.ID)
	}
	if err := sc.cfg.check(&r); err != nil {
		return fmt.Errorf("request %d: %w", r.ID, err)
	}
	if n := sc.cfg.MaxNumWaiting; n >= 0 && len(sc.waiting) >= n {
		sc.stats.Refused++
		sc.cfg.Counters.refused.Add(1)
		return fmt.Errorf("request %d: %w: %d wait for admission, the most the leader queues (%d run)", r.ID, ErrQueueFull, len(sc.waiting), len(sc.running))
	}
	// Room for the tokens to generate, up to a bound, saves regrowing.
	tokens := make([]int32, len(r.Prompt), len(r.Prompt)+min(r.MaxTokens, 1024))
	copy(tokens, r.Prompt)
	s := &seq{req: r, arrival: sc.arrivals, tokens: tokens, slot: -1}
	sc.arrivals++
	sc.seqs[r.ID] = s
	sc.waiting = append(sc.waiting, s)
	return nil
}

// Cancel ends a request at once, freeing its KV blocks; whatever it has in
// flight is dropped on its return. It reports whether the request was live.
func (sc *Scheduler) Cancel(id uint64) bool {
	s := sc.seqs[id]
	if s == nil {
		return false
	}
	sc.end(s)
	sc.stats.Cancelled++
	return true
}

// plan is the step being built.
type plan struct {
	id     uint64
	budget int // tokens left
	seqCap int // most sequences
	// window: with hand-off, a sequence's next placeholder decode goes at
	// least window steps after its last one.
	window  int
	seqs    []stage.Seq
	entries []entry
	inputs  []int32 // placeholder inputs of the step
	// await is the number of hand-off steps the first stage must have
	// applied before it runs the step.
	await  int
	sample bool // some sequence samples
}

func (p *plan) full() bool { return p.budget == 0 || len(p.seqs) >= p.seqCap }

// Schedule plans the next step: decodes first, then prefill chunks of
// running requests, then newly admitted requests, oldest first in each
// group, within the token budget and MaxNumSeqs. A request that needs a KV
// block when none is free preempts the newest running request not already
// in the step (itself if it is the newest). It returns false when
// MaxConcurrentBatches steps are in flight or there is nothing to send. A
// step with no sequences only frees sequences on the stages: it produces no
// result and is not in flight. The step's slices alias the scheduler's
// state, which never changes what they show while the step is in flight:
// stages must not modify them, and the step's Seqs are reused once
// Complete has taken its result, so whoever runs the step must be done
// with it by then.
func (sc *Scheduler) Schedule() (*pipeline.Step, bool) {
	if len(sc.flights) >= sc.cfg.MaxConcurrentBatches {
		return nil, false
	}
	p := plan{id: sc.lastBatch + 1, budget: sc.cfg.MaxNumBatchedTokens, seqCap: sc.cfg.MaxNumSeqs, window: 1}
	// The requests that may run at once, and of them those that will: the
	// steps in flight are shared among them, never among requests that
	// wait for room (all in one step, they would leave the others empty).
	maxRunning := sc.cfg.MaxNumSeqs
	switch mcb := sc.cfg.MaxConcurrentBatches; {
	case sc.cfg.OnDeviceHandoff:
		maxRunning = sc.cfg.HandoffSlots
	case mcb > 1:
		maxRunning *= mcb
	}
	// The waiting requests will run unless admission holds the first
	// back.
	active := len(sc.running)
	if len(sc.waiting) > 0 {
		if h := sc.waiting[0]; h.inflight == 0 && sc.admissible(h, min(len(h.tokens)-h.computed, sc.cfg.MaxNumBatchedTokens)) {
			active += len(sc.waiting)
		}
	}
	active = min(active, max(maxRunning, len(sc.running)))
	switch mcb := sc.cfg.MaxConcurrentBatches; {
	case !sc.cfg.OnDeviceHandoff && mcb > 1:
		// Disjoint steps in flight: spread the requests evenly over them,
		// and admit as many as they can carry together.
		p.seqCap = min(p.seqCap, (active+mcb-1)/mcb)
	case sc.cfg.OnDeviceHandoff && mcb > 2 && active > 1:
		// With hand-off, one step more than the stages is in flight: spread
		// the requests over mcb-1 groups that take turns, so that a
		// group's next step waits on the first stage while the stages run
		// the other groups' steps, not on the group's own last step.
		groups := min(mcb-1, active)
		p.seqCap = min(p.seqCap, (active+groups-1)/groups)
		p.window = groups
	}
	// now reads the clock once, when a step needs the time.
	var t time.Time
	now := func() time.Time {
		if t.IsZero() {
			t = sc.clock()
		}
		return t
	}
	f := sc.spareFlight(min(p.seqCap, len(sc.running)+len(sc.waiting)))
	p.seqs, p.entries = f.seqs, f.entries
	for _, decodes := range []bool{true, false} {
		for i := 0; i < len(sc.running) && !p.full(); {
			s := sc.running[i]
			n, ok := sc.chunk(s, &p)
			if !ok || s.batch == p.id || (n == 1 && s.computed+1 >= len(s.tokens)) != decodes {
				i++
				continue
			}
			sc.place(&p, s, n, true)
			if s.state == running {
				i++
			} // else s preempted itself: running[i] is the next one
		}
	}
	for i := 0; i < len(sc.waiting) && len(sc.running) < maxRunning && !p.full(); {
		s := sc.waiting[i]
		if s.inflight > 0 { // preempted with work in flight
			i++
			continue
		}
		n, ok := sc.chunk(s, &p)
		if !ok || !sc.admissible(s, n) || !sc.place(&p, s, n, false) {
			break
		}
		sc.waiting = slices.Delete(sc.waiting, i, i+1)
		s.state = running
		if !s.started {
			s.started, s.scheduled = true, now()
		}
		sc.running = insertByArrival(sc.running, s)
	}
	if len(p.seqs) == 0 {
		sc.spare = append(sc.spare, f)
		if len(sc.toFree) == 0 {
			return nil, false
		}
	}
	sc.lastBatch = p.id
	st := &pipeline.Step{Batch: stage.Batch{ID: p.id, Seqs: p.seqs}, Free: sc.toFree}
	sc.toFree = nil
	if len(p.seqs) > 0 {
		f.batch, f.start, f.seqs, f.entries, f.handoff = p.id, now(), p.seqs, p.entries, 0
		if sc.cfg.OnDeviceHandoff {
			// The first stage also takes every hand-off the leader has seen
			// come back, so that no more than MaxConcurrentBatches wait on
			// the ring link.
			st.AwaitHandoff = max(p.await, sc.handoffsDone)
			if p.sample {
				sc.handoffs++
				st.Batch.Handoff, f.handoff = true, sc.handoffs
			}
		}
		sc.flights = append(sc.flights, f)
	}
	return st, true
}

// spareFlight returns a flight record with room for n sequences, reusing
// the slices of a completed step if one is spare.
func (sc *Scheduler) spareFlight(n int) *flight {
	if k := len(sc.spare); k > 0 {
		f := sc.spare[k-1]
		sc.spare = sc.spare[:k-1]
		if cap(f.seqs) >= n {
			return f
		}
	}
	return &flight{seqs: make([]stage.Seq, 0, n), entries: make([]entry, 0, n)}
}

// chunk is how many positions s can feed in step p (false: none now). A
// chunk that reaches the end of the known tokens, or a placeholder decode,
// samples.
func (sc *Scheduler) chunk(s *seq, p *plan) (int, bool) {
	budget := p.budget
	if budget == 0 {
		return 0, false
	}
	if s.computed < len(s.tokens) {
		if s.inflight > 0 && !sc.cfg.OnDeviceHandoff {
			return 0, false
		}
		return min(len(s.tokens)-s.computed, budget), true
	}
	// Everything known is fed: with hand-off, feed the last placeholder,
	// unless its sample would pass MaxTokens or it is not the sequence's
	// group's turn.
	if sc.cfg.OnDeviceHandoff && s.pending > 0 && s.generated()+s.pending < s.req.MaxTokens && s.batch+uint64(p.window) <= p.id {
		return 1, true
	}
	return 0, false
}

// place adds n positions of s to the step, allocating the blocks they need;
// when blocks run short it preempts (if allowed) or gives up. It reports
// whether s was placed.
func (sc *Scheduler) place(p *plan, s *seq, n int, preempt bool) bool {
	nb := blocksFor(s.computed+n, sc.cfg.BlockSize)
	for nb-len(s.blocks) > len(sc.free) {
		if !preempt {
			return false
		}
		v := sc.victim(p.id)
		sc.preempt(v)
		if v == s {
			return false
		}
	}
	for len(s.blocks) < nb {
		last := len(sc.free) - 1
		s.blocks = append(s.blocks, sc.free[last])
		sc.free = sc.free[:last]
	}
	if sc.cfg.OnDeviceHandoff && s.slot < 0 {
		last := len(sc.slots) - 1
		s.slot = sc.slots[last]
		sc.slots = sc.slots[:last]
	}
	q := stage.Seq{
		ID:       s.req.ID,
		Pos:      s.computed,
		Blocks:   s.blocks[:nb:nb],
		Sampling: s.req.Sampling,
		Index:    s.generated() + s.pending,
		Slot:     max(s.slot, 0),
	}
	if s.computed < len(s.tokens) {
		end := s.computed + n
		q.Tokens = s.tokens[s.computed:end:end]
		q.Sample = end == len(s.tokens)
	} else {
		if p.inputs == nil {
			p.inputs = make([]int32, 0, len(sc.running))
		}
		p.inputs = append(p.inputs, stage.Placeholder)
		k := len(p.inputs)
		q.Tokens = p.inputs[k-1 : k : k]
		q.Sample = true
		// The placeholder stands for the sequence's last sample.
		p.await = max(p.await, s.handoff)
	}
	if q.Sample && sc.cfg.OnDeviceHandoff {
		p.sample = true
		s.handoff = sc.handoffs + 1 // this step's number among hand-off steps
	}
	p.seqs = append(p.seqs, q)
	p.entries = append(p.entries, entry{s: s, epoch: s.epoch, sample: q.Sample})
	p.budget -= n
	s.computed += n
	if q.Sample {
		s.pending++
	}
	s.inflight++
	s.batch = p.id
	return true
}

// admissible reports whether waiting request s, starting with a chunk of n
// positions, leaves the KV room the running requests are expected to grow
// into, so that admitting it does not soon preempt another. A request
// never preempted is admitted if s and every running request can grow to
// their expected lengths (expected); one that was preempted only if they
// can all grow to their last positions, so that it runs on to its end.
// Alone, a request is always admissible (Add checked that it fits the
// capacity).
func (sc *Scheduler) admissible(s *seq, n int) bool {
	if len(sc.running) == 0 {
		return true
	}
	full := s.preempted > 0
	need := blocksFor(s.computed+n, sc.cfg.BlockSize) - len(s.blocks) + sc.growth(s, s.computed+n, full)
	for _, r := range sc.running {
		need += sc.growth(r, r.computed, full)
		if need > len(sc.free) {
			return false
		}
	}
	return need <= len(sc.free)
}

// growth is the blocks s is expected to need past those covering its first
// at positions: up to its last position (full), else up to its expected
// end, the prompt plus its MaxTokens scaled by the fraction of MaxTokens
// finished requests generated (lengthRatio), but at least GrowthReserve
// positions past at. With GrowthReserve -1 only full growth is counted.
func (sc *Scheduler) growth(s *seq, at int, full bool) int {
	end := s.last()
	if !full {
		if sc.cfg.GrowthReserve < 0 {
			return 0
		}
		expected := len(s.req.Prompt) + int(math.Ceil(sc.lengthRatio*float64(s.req.MaxTokens))) - 1
		end = min(end, max(expected, at+sc.cfg.GrowthReserve))
	}
	bs := sc.cfg.BlockSize
	return max(0, blocksFor(end, bs)-max(blocksFor(at, bs), len(s.blocks)))
}

// lengthWeight is the weight of one finished request in lengthRatio's
// moving average.
const lengthWeight = 1.0 / 8

// last is the number of positions the sequence holds in the KV cache at
// most: its prompt and every generated token but the last, which is never
// fed back.
func (s *seq) last() int { return len(s.req.Prompt) + s.req.MaxTokens - 1 }

// victim is the request to preempt when step id needs blocks: the newest
// running request not in the step that has been preempted fewer than
// MaxPreemptions times, else the newest not in the step.
func (sc *Scheduler) victim(id uint64) *seq {
	var newest *seq
	for i := len(sc.running) - 1; i >= 0; i-- {
		s := sc.running[i]
		if s.batch == id {
			continue
		}
		if s.preempted < sc.cfg.MaxPreemptions {
			return s
		}
		if newest == nil {
			newest = s
		}
	}
	return newest
}

// preempt sends a running request back to waiting, by recompute: its blocks
// are freed, what it has in flight will be dropped, and when admitted again
// it prefills its prompt and the tokens generated so far.
func (sc *Scheduler) preempt(s *seq) {
	sc.release(s)
	s.computed, s.pending = 0, 0
	s.epoch++
	s.preempted++
	s.state = waiting
	sc.running = removeSeq(sc.running, s)
	sc.waiting = insertByArrival(sc.waiting, s)
	sc.toFree = append(sc.toFree, s.req.ID)
	sc.stats.Preemptions++
	sc.cfg.Counters.preemptions.Add(1)
}

// end removes a finished or cancelled request.
func (sc *Scheduler) end(s *seq) {
	sc.release(s)
	s.epoch++
	if s.state == running {
		sc.running = removeSeq(sc.running, s)
	} else {
		sc.waiting = removeSeq(sc.waiting, s)
	}
	s.state = ended
	delete(sc.seqs, s.req.ID)
	if s.started {
		sc.toFree = append(sc.toFree, s.req.ID)
	}
}

// release returns s's blocks to the free list, and its hand-off slot.
// Steps in flight may still name them: every stage runs steps in order, so
// they are done with them before any later step reuses them, and the first
// stage applies hand-offs in step order, so a slot's next owner, whose
// placeholders stand for samples of later steps, reads its own tokens.
func (sc *Scheduler) release(s *seq) {
	for i := len(s.blocks) - 1; i >= 0; i-- {
		sc.free = append(sc.free, s.blocks[i])
	}
	s.blocks = nil // steps in flight alias the old table
	if s.slot >= 0 {
		sc.slots = append(sc.slots, s.slot)
		s.slot = -1
	}
}

// Complete takes the result of the oldest step in flight and returns the
// tokens to deliver, in batch order. Tokens of requests preempted,
// cancelled or finished since the step was scheduled are dropped. A result
// that does not match the step (another batch, missing or extra samples) is
// an error and changes nothing. The returned slice is reused by the next
// Complete.
func (sc *Scheduler) Complete(r *pipeline.Result) ([]Output, error) {
	if len(sc.flights) == 0 {
		return nil, fmt.Errorf("result of batch %d, but no batch is in flight", r.Batch)
	}
	f := sc.flights[0]
	if r.Batch != f.batch {
		return nil, fmt.Errorf("result of batch %d, but the oldest batch in flight is %d", r.Batch, f.batch)
	}
	if r.Err != "" {
		return nil, fmt.Errorf("batch %d: stage %d failed: %s", r.Batch, r.Stage, r.Err)
	}
	k := 0
	for _, e := range f.entries {
		if !e.sample {
			continue
		}
		if k >= len(r.Sampled) || r.Sampled[k].Seq != e.s.req.ID {
			return nil, fmt.Errorf("batch %d: sample %d is not of sequence %d", r.Batch, k, e.s.req.ID)
		}
		k++
	}
	if k != len(r.Sampled) {
		return nil, fmt.Errorf("batch %d: %d samples, want %d", r.Batch, len(r.Sampled), k)
	}
	sc.flights[0] = nil
	sc.flights = sc.flights[1:]
	if f.handoff > 0 {
		sc.handoffsDone = f.handoff
	}

	now := sc.clock()
	outs := sc.outs[:0]
	k = 0
	for _, e := range f.entries {
		s := e.s
		s.inflight--
		if !e.sample {
			continue
		}
		t := r.Sampled[k]
		k++
		if s.epoch != e.epoch {
			sc.stats.Discarded++
			sc.cfg.Counters.discarded.Add(1)
			continue
		}
		if t.Err != "" {
			// The stage could not sample it (non-finite logits): this
			// request fails, the others go on.
			sc.end(s)
			sc.stats.Failed++
			sc.cfg.Counters.failed.Add(1)
			outs = append(outs, Output{ID: s.req.ID, Index: s.generated(), Err: fmt.Errorf("%w: stage %d: %s", ErrRequestFailed, r.Stage, t.Err)})
			continue
		}
		s.pending--
		s.tokens = append(s.tokens, t.Token)
		o := Output{ID: s.req.ID, Index: s.generated() - 1, Token: t, Time: now}
		if o.Index == 0 {
			o.Scheduled = s.scheduled
		}
		switch {
		case slices.Contains(s.req.StopTokens, t.Token):
			o.Finish = FinishStop
		case s.generated() >= s.req.MaxTokens:
			o.Finish = FinishLength
		}
		if o.Finish != "" {
			sc.lengthRatio += lengthWeight * (float64(s.generated())/float64(s.req.MaxTokens) - sc.lengthRatio)
			sc.end(s)
			sc.stats.Finished++
		}
		outs = append(outs, o)
	}
	sc.outs = outs
	// The executor is done with the step: reuse its slices, dropping what
	// they point at.
	clear(f.seqs)
	clear(f.entries)
	f.seqs, f.entries = f.seqs[:0], f.entries[:0]
	sc.spare = append(sc.spare, f)
	d := now.Sub(f.start)
	sc.stats.Steps++
	sc.cfg.Counters.steps.Add(1)
	sc.stats.LastStepTime = d
	if sc.stats.Steps == 1 {
		sc.stats.StepTime = d
	} else {
		sc.stats.StepTime += (d - sc.stats.StepTime) / 8
	}
	return outs, nil
}

// InFlight is the number of steps in flight.
func (sc *Scheduler) InFlight() int { return len(sc.flights) }

// Idle reports whether no request is live and no step is in flight.
func (sc *Scheduler) Idle() bool { return len(sc.seqs) == 0 && len(sc.flights) == 0 }

// Stats is a snapshot of the scheduler.
func (sc *Scheduler) Stats() Stats {
	st := sc.stats
	st.Running = len(sc.running)
	st.Waiting = len(sc.waiting)
	st.InFlight = len(sc.flights)
	st.KVBlocks = sc.cfg.NumBlocks
	st.KVBlocksUsed = sc.cfg.NumBlocks - len(sc.free)
	st.BlockSize = sc.cfg.BlockSize
	return st
}

// insertByArrival inserts s into q, which is sorted by arrival.
func insertByArrival(q []*seq, s *seq) []*seq {
	i, _ := slices.BinarySearchFunc(q, s.arrival, func(e *seq, a uint64) int {
		switch {
		case e.arrival < a:
			return -1
		case e.arrival > a:
			return 1
		}
		return 0
	})
	return slices.Insert(q, i, s)
}

// removeSeq removes s from q, keeping the order.
func removeSeq(q []*seq, s *seq) []*seq {
	i := slices.Index(q, s)
	return slices.Delete(q, i, i+1)
}
