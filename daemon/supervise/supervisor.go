package supervise

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tandem-llm/tandem/daemon/apierr"
	"github.com/tandem-llm/tandem/daemon/membership"
	"github.com/tandem-llm/tandem/daemon/placement"
	"github.com/tandem-llm/tandem/daemon/steptrace"
	"github.com/tandem-llm/tandem/pipeline"
	"github.com/tandem-llm/tandem/sched"
)

// Timings of the supervisor's loop.
const (
	// DefaultTick is how often the loop re-reads the membership and lets
	// the core's timers run.
	DefaultTick = 200 * time.Millisecond
	// probeTimeout bounds the health probe of a stage node when a failure
	// names none.
	probeTimeout = time.Second
)

// Membership is the view of the cluster the supervisor follows
// (*membership.Membership).
type Membership interface {
	// Members is a snapshot, sorted by name.
	Members() []membership.Member
	// Events wakes the supervisor on changes.
	Events() <-chan membership.Event
}

// Config configures a Supervisor.
type Config struct {
	Core    CoreConfig
	Builder BuilderConfig
	// Probe checks that the node at a gRPC address answers, within ctx;
	// it names the stage to blame when a failure names none (a step past
	// its deadline). Nil: no probing.
	Probe func(ctx context.Context, addr string) error
	// OnStatus is called, from the loop's goroutine, after every step with
	// the supervisor's state (nil: not called). It must not block.
	OnStatus func(Snapshot)
	// RetireTimeout bounds how long the requests of a pipeline given up
	// (this node no longer leads) may take to finish before they fail.
	RetireTimeout time.Duration
	// Tick is how often the membership is re-read (default DefaultTick).
	Tick time.Duration
	Log  *slog.Logger
}

// Snapshot is the supervisor's state: the core's, with the serving
// pipeline and the scheduler's figures.
type Snapshot struct {
	Status
	// Pipeline is the serving pipeline (nil: none).
	Pipeline *Pipeline
	Sched    sched.Stats
	// Change is the last change of pipeline (Status.Last) with what it
	// re-prefilled.
	Change ChangeReport
	// Totals count since the supervisor started, across leaderships.
	Totals Totals
}

// ChangeReport is a change of pipeline and the running requests it sent
// to prefill again on the new pipeline.
type ChangeReport struct {
	Change
	// Requests re-prefilled, and the KV positions they had, which they
	// compute again.
	Requests, Tokens uint64
}

// Totals are the supervisor's counts for the life of the process.
type Totals struct {
	Counts
	// ReprefilledRequests and ReprefilledTokens count the running
	// requests re-prefilled on a new pipeline and the positions they
	// computed again (BuilderConfig.Counters).
	ReprefilledRequests, ReprefilledTokens uint64
}

// Supervisor is the leader's supervision loop: it feeds the Core the
// membership, the results of builds and the failures of pipelines, and
// performs the actions the Core returns. On a node that does not lead it
// only follows the membership.
type Supervisor struct {
	cfg     Config
	log     *slog.Logger
	trace   *steptrace.Recorder
	core    *Core
	builder *Builder
	engine  *Engine
	memb    Membership
	events  chan Event
	stopped chan struct{} // closed when Run returns
	tick    atomic.Int64  // the loop's last wake-up, unix nanoseconds
	bg      sync.WaitGroup

	// The loop goroutine's own state.
	builds  map[uint64]context.CancelFunc
	watch   *Pipeline               // the serving pipeline, watched for a failure while idle
	waiters map[uint64][]chan error // admin commands waiting for the build of an epoch to end
	base    [2]uint64               // the re-prefill counts when the last change began

	mu    sync.Mutex
	pipes map[uint64]*Pipeline // built and not closed, by epoch
	snap  Snapshot
}

// New returns a supervisor over memb; it starts nothing.
func New(cfg Config, memb Membership) *Supervisor {
	if cfg.Tick == 0 {
		cfg.Tick = DefaultTick
	}
	if cfg.RetireTimeout == 0 {
		cfg.RetireTimeout = DefaultRecoveryTimeout
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.Builder.Log == nil {
		cfg.Builder.Log = cfg.Log
	}
	if cfg.Builder.Counters == nil {
		cfg.Builder.Counters = &sched.Counters{}
	}
	trace := steptrace.New()
	if cfg.Builder.Observer == nil {
		cfg.Builder.Observer = trace.Pipeline
	}
	s := &Supervisor{
		cfg: cfg, log: cfg.Log, trace: trace, core: NewCore(cfg.Core), builder: NewBuilder(cfg.Builder), memb: memb,
		events: make(chan Event, 16), stopped: make(chan struct{}),
		builds: map[uint64]context.CancelFunc{}, pipes: map[uint64]*Pipeline{}, waiters: map[uint64][]chan error{},
	}
	s.engine = newEngine(s.pipelineFailed)
	s.engine.observer = trace
	s.snap.Status = s.core.Status()
	return s
}

// Engine is the leader's request engine.
func (s *Supervisor) Engine() *Engine { return s.engine }

// Trace is the leader's step recorder: traces of its steps, and its
// stages' busy time.
func (s *Supervisor) Trace() *steptrace.Recorder { return s.trace }

// Snapshot is the state after the loop's last step.
func (s *Supervisor) Snapshot() Snapshot {
	s.mu.Lock()
	snap := s.snap
	s.mu.Unlock()
	snap.Sched = s.engine.Stats()
	c := s.cfg.Builder.Counters
	snap.Totals.ReprefilledRequests, snap.Totals.ReprefilledTokens = c.Reprefilled(), c.ReprefilledTokens()
	return snap
}

// reprefilled is how many requests and positions were re-prefilled so far.
func (s *Supervisor) reprefilled() [2]uint64 {
	c := s.cfg.Builder.Counters
	return [2]uint64{c.Reprefilled(), c.ReprefilledTokens()}
}

// LastTick is when the loop last woke up.
func (s *Supervisor) LastTick() time.Time { return time.Unix(0, s.tick.Load()) }

// Run runs the loop until ctx is done, then gives up the builds under
// way. The pipeline serving, and the requests, stay: Stop drains them.
func (s *Supervisor) Run(ctx context.Context) {
	defer close(s.stopped)
	defer func() {
		for _, cancel := range s.builds {
			cancel()
		}
		for epoch := range s.waiters {
			s.answer(epoch, errors.New("the supervisor stopped"))
		}
	}()
	t := time.NewTicker(s.cfg.Tick)
	defer t.Stop()
	for {
		s.tick.Store(time.Now().UnixNano())
		s.step(ctx, Members{List: s.memb.Members()})
		var broken <-chan struct{}
		if s.watch != nil {
			broken = s.watch.drv.Broken()
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if s.cfg.Core.BalanceAfter > 0 {
				s.step(ctx, s.stageTimes())
			}
		case <-s.memb.Events():
			// Level-triggered: the next step re-reads Members.
		case ev := <-s.events:
			s.step(ctx, ev)
		case <-broken:
			// A pipeline broken while no step is in flight: its engine
			// would only learn of it with the next request.
			p := s.watch
			s.watch = nil
			s.bg.Go(func() { s.report(ctx, p, p.drv.Failure(ctx)) })
		}
	}
}

// stageTimes is the newest pipeline's stages' times in their steps, for a
// balance by time (CoreConfig.BalanceAfter).
func (s *Supervisor) stageTimes() StageTimes {
	epoch, busy := s.trace.Busy(time.Now())
	t := StageTimes{Epoch: epoch}
	for _, b := range busy {
		t.Busy = append(t.Busy, placement.StageBusy(b.Busy, b.DeviceBusy))
	}
	return t
}

// Move is a pipeline build an admin command started.
type Move struct {
	// Epoch is the pipeline being built (0: the command started none).
	Epoch uint64
	done  <-chan error
}

// Wait waits until the build has ended: nil once the requests run on the
// new pipeline, else why it did not (the build failed or was given up).
func (m Move) Wait(ctx context.Context) error {
	if m.Epoch == 0 {
		return nil
	}
	select {
	case err := <-m.done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Admin applies an admin command (Drain, Undrain, Rebalance) on the
// loop's goroutine and returns the core's answer, and the build it
// started, if any.
func (s *Supervisor) Admin(ctx context.Context, ev Event) (Move, error) {
	reply := make(chan adminReply, 1)
	select {
	case s.events <- adminEvent{ev, reply}:
	case <-s.stopped:
		return Move{}, errors.New("the supervisor has stopped")
	case <-ctx.Done():
		return Move{}, ctx.Err()
	}
	r := <-reply
	return r.move, r.err
}

// Plan is the placement a rebalance would apply now (ranges nil: by
// memory over the live, undrained stage nodes), changing nothing.
func (s *Supervisor) Plan(ctx context.Context, ranges []placement.Range) (placement.Plan, error) {
	type result struct {
		p   placement.Plan
		err error
	}
	reply := make(chan result, 1)
	q := queryEvent(func(c *Core) {
		p, err := c.Plan(ranges)
		reply <- result{p, err}
	})
	select {
	case s.events <- q:
	case <-s.stopped:
		return placement.Plan{}, errors.New("the supervisor has stopped")
	case <-ctx.Done():
		return placement.Plan{}, ctx.Err()
	}
	r := <-reply
	return r.p, r.err
}

// adminEvent carries an admin command and its reply through the loop.
type adminEvent struct {
	Event
	reply chan adminReply
}

type adminReply struct {
	move Move
	err  error
}

// queryEvent runs on the loop's goroutine with the core, changing nothing.
type queryEvent func(*Core)

func (queryEvent) event() {}

// step gives the core one event and performs the actions it returns.
func (s *Supervisor) step(ctx context.Context, ev Event) {
	var reply chan adminReply
	switch e := ev.(type) {
	case queryEvent:
		e(s.core)
		return
	case adminEvent:
		ev, reply = e.Event, e.reply
	case BuildDone:
		delete(s.builds, e.Epoch)
	}
	before := s.reprefilled()
	building := s.core.Status().Building
	acts, err := s.core.Step(time.Now(), ev)
	if reply != nil {
		r := adminReply{err: err}
		if b := s.core.Status().Building; err == nil && b != 0 && b != building {
			done := make(chan error, 1)
			s.waiters[b] = append(s.waiters[b], done)
			r.move = Move{Epoch: b, done: done}
		}
		reply <- r
	}
	for _, a := range acts {
		s.perform(ctx, a)
	}
	st := s.core.Status()
	s.engine.admit(st.Accepting, st.Reason)
	stats := s.engine.Stats()
	now := s.reprefilled()
	s.mu.Lock()
	if c := &s.snap.Change; st.Last.Start != c.Start || st.Last.Kind != c.Kind {
		// A change began in this step: what it re-prefills counts from
		// before the step's actions.
		s.base = before
	}
	if c := &s.snap.Change; c.End.IsZero() || c.Start != st.Last.Start {
		*c = ChangeReport{Change: st.Last, Requests: now[0] - s.base[0], Tokens: now[1] - s.base[1]}
	}
	s.snap.Status = st
	s.snap.Pipeline = s.pipes[st.Epoch]
	s.snap.Totals.Counts = st.Counts
	snap := s.snap
	s.mu.Unlock()
	if e, ok := ev.(BuildDone); ok {
		// Answered once the snapshot shows the step's outcome.
		var err error
		if st.Epoch != e.Epoch {
			err = e.Err
			if err == nil {
				err = fmt.Errorf("the build of epoch %d was given up", e.Epoch)
			}
		}
		s.answer(e.Epoch, err)
	}
	if s.cfg.OnStatus != nil {
		snap.Sched = stats
		s.cfg.OnStatus(snap)
	}
}

// answer tells the admin commands waiting for the build of epoch how it
// ended.
func (s *Supervisor) answer(epoch uint64, err error) {
	for _, w := range s.waiters[epoch] {
		w <- err
	}
	delete(s.waiters, epoch)
}

func (s *Supervisor) perform(ctx context.Context, a Action) {
	switch a := a.(type) {
	case Log:
		if a.Warn {
			s.log.Warn(a.Msg)
		} else {
			s.log.Info(a.Msg)
		}
	case Build:
		bctx, cancel := context.WithCancel(ctx)
		s.builds[a.Epoch] = cancel
		s.log.Info("building a pipeline", "epoch", a.Epoch, "plan", PlanString(a.Plan), "why", a.Why)
		s.bg.Go(func() {
			defer cancel()
			start := time.Now()
			p, err := s.builder.Build(bctx, a)
			done := BuildDone{Epoch: a.Epoch, Err: err}
			var be *BuildError
			if errors.As(err, &be) {
				done.Nodes, done.RefusedEpoch = be.Nodes, be.RefusedEpoch
			}
			if p != nil {
				s.mu.Lock()
				s.pipes[p.Epoch] = p
				s.mu.Unlock()
				s.log.Info("pipeline built", "epoch", p.Epoch, "time", time.Since(start).Round(time.Millisecond), "kv_tokens", p.KVTokens)
			}
			if !s.send(done) && p != nil {
				s.closePipeline(context.Background(), s.take(p.Epoch))
			}
		})
	case CancelBuild:
		if cancel := s.builds[a.Epoch]; cancel != nil {
			cancel()
		}
		s.answer(a.Epoch, fmt.Errorf("the build of epoch %d was given up: %s", a.Epoch, s.core.Status().Reason))
	case Switch:
		s.mu.Lock()
		p := s.pipes[a.Epoch]
		s.mu.Unlock()
		if p == nil {
			return
		}
		if err := s.engine.switchTo(p); err != nil {
			// The configuration the stages reported is one the scheduler
			// refuses: a failure of this pipeline.
			s.bg.Go(func() { s.report(ctx, p, err) })
			return
		}
		s.watch = p
	case Close:
		p := s.take(a.Epoch)
		if p == nil {
			return
		}
		if s.watch == p {
			s.watch = nil
		}
		s.engine.detach(p)
		s.bg.Go(func() { s.closePipeline(context.WithoutCancel(ctx), p) })
	case Retire:
		p := s.take(a.Epoch)
		if s.watch == p {
			s.watch = nil
		}
		s.bg.Go(func() {
			s.engine.retire(a.Why, s.cfg.RetireTimeout)
			if p != nil {
				s.closePipeline(context.WithoutCancel(ctx), p)
			}
		})
	case FailRequests:
		s.log.Warn("failing the requests", "reason", a.Reason)
		s.engine.failAll(apierr.Unavailablef("%s", a.Reason))
	}
}

// send hands an event to the loop; false once the loop has stopped.
func (s *Supervisor) send(ev Event) bool {
	select {
	case s.events <- ev:
		return true
	case <-s.stopped:
		return false
	}
}

// take removes the pipeline of epoch from the built ones (nil: none).
func (s *Supervisor) take(epoch uint64) *Pipeline {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.pipes[epoch]
	delete(s.pipes, epoch)
	return p
}

// closePipeline releases a pipeline's stages (each stage's worker ends,
// cleanly, before its neighbours' links close under it), then closes its
// links, concurrently.
func (s *Supervisor) closePipeline(ctx context.Context, p *Pipeline) {
	s.builder.Release(ctx, p)
	if err := p.drv.Close(); err != nil {
		s.log.Debug("close the pipeline's links", "epoch", p.Epoch, "err", err)
	}
}

// pipelineFailed is the engine's report of a failed step or link; it runs
// on the scheduler's goroutine, so it hands the work on.
func (s *Supervisor) pipelineFailed(p *Pipeline, err error) {
	s.bg.Go(func() { s.report(context.Background(), p, err) })
}

// report tells the core that p failed, naming the stage node to blame:
// the one the driver blamed, or, when it named none (a step past its
// deadline), the first that does not answer a probe. The driver's blame
// of a data link's failure is the least sure (the stage at the other end
// caused it, when its own end was not learned first): then a stage that
// does not answer is blamed before it, so that a dead process is named
// however late the leader read the end of its control link.
func (s *Supervisor) report(ctx context.Context, p *Pipeline, err error) {
	node, sure := "", false
	var se *pipeline.StageError
	if errors.As(err, &se) && se.Stage >= 0 && se.Stage < len(p.Stages) {
		node, sure = p.Stages[se.Stage].Node, !pipeline.LinkFailure(se.Err)
	}
	if !sure && s.cfg.Probe != nil {
		silent := make([]bool, len(p.Stages))
		forEach(len(p.Stages), func(i int) error {
			pctx, cancel := context.WithTimeout(ctx, probeTimeout)
			defer cancel()
			silent[i] = s.cfg.Probe(pctx, p.Stages[i].Member.Meta.GRPCAddr) != nil
			return nil
		})
		for i, q := range silent {
			if q {
				node = p.Stages[i].Node
				err = fmt.Errorf("%w (stage %d on %s does not answer)", err, i, node)
				break
			}
		}
	}
	s.send(StageFailed{Epoch: p.Epoch, Node: node, Err: err})
}

// Stop, once Run has returned, drains the requests: none is admitted,
// the accepted ones finish within timeout (then fail), the scheduler
// stops; then it closes every pipeline and waits for every goroutine the
// supervisor started.
func (s *Supervisor) Stop(timeout time.Duration, why string) {
	<-s.stopped
	s.engine.retire(why, timeout)
	s.bg.Wait()
	s.mu.Lock()
	pipes := s.pipes
	s.pipes = map[uint64]*Pipeline{}
	s.mu.Unlock()
	var wg sync.WaitGroup
	for _, p := range pipes {
		wg.Go(func() { s.closePipeline(context.Background(), p) })
	}
	wg.Wait()
	s.bg.Wait()
}
