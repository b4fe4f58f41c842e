package supervise

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/tandem-llm/tandem/daemon/membership"
	"github.com/tandem-llm/tandem/daemon/placement"
)

// Defaults of CoreConfig.
const (
	DefaultRecoveryTimeout = 60 * time.Second
	DefaultBuildRetry      = 2 * time.Second
	DefaultStableFor       = 5 * time.Second
	DefaultSuspectFor      = 30 * time.Second
	// rebalanceGain is the least rise of KV capacity, as a fraction, for
	// which auto-rebalance moves a pipeline that restores no node.
	rebalanceGain = 0.10
	// balanceGain is the least fall of the slowest stage's time, as a
	// fraction, for which a balance by time moves the pipeline.
	balanceGain = 0.10
)

// CoreConfig configures a Core.
type CoreConfig struct {
	// Name is this node's name; Leader the configured leader ("" chooses
	// the eligible member with the smallest name).
	Name, Leader string
	// ModelID is the model's identity: stage nodes of another model are
	// left out. So are those that gossip other internal protocol versions
	// than Protocol, when it is set (nodewire.Protocol).
	ModelID, Protocol string
	// ExpectStages is how many stage nodes the leader waits for before it
	// first places the model (a start-up wait only: a pipeline lost later
	// is rebuilt over whatever nodes can hold the model).
	ExpectStages int
	// Plan is the configured explicit placement (nil: by memory). It is
	// used whenever all its nodes are candidates; otherwise the model is
	// placed by memory over the candidates.
	Plan []placement.Range
	// Place places the model over nodes: by memory (ranges nil) or as
	// ranges say. It must be pure.
	Place func(nodes []placement.Node, ranges []placement.Range) (placement.Plan, error)
	// RecoveryTimeout bounds how long accepted requests wait for a new
	// pipeline once the serving one is lost (default 60s); then they fail
	// with UNAVAILABLE.
	RecoveryTimeout time.Duration
	// BuildRetry is the wait after a failed build (default 2s).
	BuildRetry time.Duration
	// AutoRebalance moves the pipeline, once the membership has been
	// stable for StableFor (default 5s), when the placement over the
	// candidates restores a node lost or undrained, or raises the KV
	// capacity by 10% or more.
	AutoRebalance bool
	StableFor     time.Duration
	// BalanceAfter, when not 0, balances the serving pipeline by time
	// (placement.ByTime, as `tandemctl rebalance --by-time` does) once
	// every stage has measured that much time in its steps (StageTimes
	// events), if that makes the slowest stage 10% faster or more. The
	// placement it moves to is pinned like one asked for: neither balance
	// moves it again until the membership changes.
	BalanceAfter time.Duration
	// SuspectFor is how long a stage node blamed for a failure is left out
	// of placement unless it comes back sooner (restarts: the membership
	// sees it dead, then alive again) (default 30s).
	SuspectFor time.Duration
	// EpochBase is the least epoch a build at now may use (nil: the clock
	// in nanoseconds, so that a newly chosen leader's epochs supersede its
	// predecessor's).
	EpochBase func(now time.Time) uint64
}

func (c CoreConfig) withDefaults() CoreConfig {
	def := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	def(&c.RecoveryTimeout, DefaultRecoveryTimeout)
	def(&c.BuildRetry, DefaultBuildRetry)
	def(&c.StableFor, DefaultStableFor)
	def(&c.SuspectFor, DefaultSuspectFor)
	if c.ExpectStages < 1 {
		c.ExpectStages = 1
	}
	if c.EpochBase == nil {
		c.EpochBase = func(now time.Time) uint64 { return uint64(now.UnixNano()) }
	}
	return c
}

// Core is the leader's supervision as a synchronous state machine: Step
// takes an event (a membership snapshot, a build's end, a stage failure,
// an admin command, or just time passing) and returns the actions that
// follow (build this plan at epoch N, switch the requests to it, close
// that pipeline, fail the requests with this reason). It starts no
// goroutine and reads time only from Step's argument.
type Core struct {
	cfg  CoreConfig
	now  time.Time
	acts []Action

	members []membership.Member
	leader  membership.Member
	candKey string    // the stage candidates as last seen
	changed time.Time // when candKey last changed

	serving, building *pipe
	everServed        bool   // this node has led a pipeline since it became leader
	inherited         string // the member this node took the leadership over from ("": none): the cluster was up, so no start-up wait
	lastEpoch         uint64
	seenEpoch         uint64 // the newest epoch a node said it had accepted
	nextTry           time.Time

	outage    time.Time // when the serving pipeline was lost (zero: not lost)
	outageWhy string
	failed    bool // the outage passed RecoveryTimeout: requests failed

	suspects map[string]time.Time // nodes blamed for a failure, and when
	drained  map[string]bool
	wanted   map[string]bool // nodes lost or undrained: a placement restoring one is a rebalance
	replace  string          // why the serving pipeline must move ("" while it need not)
	leaving  bool            // it must move because a stage node is leaving: if it cannot, it retires
	stuck    string          // the last move found impossible, warned about once
	pinned   bool            // the serving placement was asked for explicitly or balanced by time: auto-rebalance leaves it until the membership changes
	times    StageTimes      // the stages' times, as last reported
	unfit    uint64          // the epoch whose balance by time was found impossible (logged once)
	asked    bool            // an operator undrained a node in this step: auto-rebalance need not wait for a stable membership
	reason   string          // why no pipeline serves
	leftOut  string          // the nodes the last placement left out, as logged
	last     Change
	counts   Counts
}

// Counts are the pipeline changes a core completed, for the life of the
// process.
type Counts struct {
	// Recoveries rebuilt a lost pipeline; Moves moved a serving one off a
	// node leaving or drained; Rebalances moved one to a better
	// placement (asked for, or automatic).
	Recoveries, Moves, Rebalances uint64
}

// rebalanceAsked is why an admin's rebalance moves the pipeline.
const rebalanceAsked = "asked for"

// pipe is a pipeline the core placed.
type pipe struct {
	epoch   uint64
	plan    placement.Plan
	ranges  []placement.Range // the explicit placement asked for (nil: by memory)
	kind    string            // "start", "recovery", "move", "rebalance"
	why     string
	started time.Time
	byTime  bool // placed by the stages' times (CoreConfig.BalanceAfter)
}

// Change is the last time the pipeline was built or replaced: why, and
// how long it took.
type Change struct {
	Kind       string // "start", "recovery", "move" (a node left or was drained) or "rebalance"
	Why        string
	Start, End time.Time // End is zero while it is under way
	Epoch      uint64    // the pipeline it ended with (0: it failed)
	Err        string    // why it failed ("" unless it did)
}

// Status is what the core knows, for the daemon's health, status and
// admission.
type Status struct {
	Leader  membership.Member // zero while there is none
	Leading bool
	// Epoch and Plan are the serving pipeline's (0 and empty: none).
	Epoch uint64
	Plan  placement.Plan
	// Building is the epoch of a build under way (0: none).
	Building uint64
	// Accepting: new requests queue, because a pipeline serves or one is
	// being rebuilt within the recovery deadline. Otherwise they fail at
	// once with Reason.
	Accepting bool
	Reason    string // why no pipeline serves ("" while one does)
	Drained   []string
	// LeftOut are the live stage nodes the serving pipeline's placement
	// (while none serves, the one being built) leaves out, and why:
	// too small to hold a layer where they would stand, lowering the KV
	// capacity, not named by an explicit plan. Drained and suspected nodes
	// are not placed at all: not here.
	LeftOut []placement.LeftOut
	// Outage is when the serving pipeline was lost (zero: none).
	Outage time.Time
	Last   Change
	Counts Counts
}

// NewCore returns the core of node cfg.Name, which knows no member yet.
func NewCore(cfg CoreConfig) *Core {
	return &Core{cfg: cfg.withDefaults(), suspects: map[string]time.Time{}, drained: map[string]bool{}, wanted: map[string]bool{},
		reason: "no membership seen yet"}
}

// Step applies ev at time now and returns the actions that follow, in the
// order they must be performed. Admin commands (Drain, Undrain,
// Rebalance) that cannot be applied return an error and change nothing.
func (c *Core) Step(now time.Time, ev Event) ([]Action, error) {
	c.now = now
	var err error
	switch ev := ev.(type) {
	case Members:
		c.observe(ev.List)
	case Tick:
	case BuildDone:
		c.buildDone(ev)
	case StageFailed:
		c.stageFailed(ev)
	case Drain:
		err = c.drain(ev.Node)
	case Undrain:
		err = c.undrain(ev.Node)
	case Rebalance:
		err = c.rebalance(ev.Ranges)
	case StageTimes:
		c.times = ev
	default:
		err = fmt.Errorf("unknown event %T", ev)
	}
	if err == nil {
		c.decide()
	}
	acts := c.acts
	c.acts = nil
	return acts, err
}

// Status is the core's state after the last Step.
func (c *Core) Status() Status {
	s := Status{Leader: c.leader, Leading: c.leading(), Reason: c.reason, Outage: c.outage, Last: c.last, Counts: c.counts}
	if c.serving != nil {
		s.Epoch, s.Plan, s.Reason = c.serving.epoch, c.serving.plan, ""
	}
	if c.building != nil {
		s.Building = c.building.epoch
	}
	s.Accepting = s.Leading && (c.serving != nil || (!c.outage.IsZero() && !c.failed))
	for n := range c.drained {
		s.Drained = append(s.Drained, n)
	}
	slices.Sort(s.Drained)
	p := c.serving
	if p == nil {
		p = c.building
	}
	if p != nil {
		live := stageCandidates(c.members, c.cfg.kin())
		for _, l := range p.plan.LeftOut {
			if !c.drained[l.Node] && slices.ContainsFunc(live, func(m membership.Member) bool { return m.Name == l.Node }) {
				s.LeftOut = append(s.LeftOut, l)
			}
		}
	}
	return s
}

// Plan is the placement a rebalance would apply now (ranges nil: by
// memory over the live, undrained stage nodes), changing nothing.
func (c *Core) Plan(ranges []placement.Range) (placement.Plan, error) {
	return c.place(c.candidates(), ranges, false)
}

func (c *Core) leading() bool { return c.leader.Name != "" && c.leader.Name == c.cfg.Name }

func (c *Core) emit(a Action) { c.acts = append(c.acts, a) }

func (c *Core) info(format string, args ...any) {
	c.emit(Log{Msg: fmt.Sprintf(format, args...)})
}

func (c *Core) warn(format string, args ...any) {
	c.emit(Log{Warn: true, Msg: fmt.Sprintf(format, args...)})
}

func (c *Core) member(name string) (membership.Member, bool) {
	i := slices.IndexFunc(c.members, func(m membership.Member) bool { return m.Name == name })
	if i < 0 {
		return membership.Member{}, false
	}
	return c.members[i], true
}

// observe takes a membership snapshot: the leader, the stage candidates
// (their last change starts the stability wait), and the serving
// pipeline's nodes: one dead loses the pipeline, one leaving makes it
// move.
func (c *Core) observe(list []membership.Member) {
	c.members = list
	if l := ChooseLeader(c.cfg.Leader, list); l.Name != c.leader.Name {
		if l.Name == "" {
			c.info("no leader: no eligible member is alive")
		} else {
			c.info("leader is %s", l.Name)
		}
		if l.Name == c.cfg.Name && c.leader.Name != "" {
			// Another member led: the cluster has been up, its stages
			// placed; this one serves over the nodes left at once.
			c.inherited = c.leader.Name
		}
		c.leader = l
	} else {
		c.leader = l
	}
	var key strings.Builder
	for _, m := range stageCandidates(list, c.cfg.kin()) {
		fmt.Fprintf(&key, "%s@%d ", m.Name, m.Since.UnixNano())
	}
	if key.String() != c.candKey {
		// Another set of nodes: worth trying at once.
		c.candKey, c.changed, c.pinned, c.nextTry = key.String(), c.now, false, c.now
	}
	if c.serving == nil || !c.leading() {
		return
	}
	for _, s := range c.serving.plan.Stages {
		m, ok := c.member(s.Node)
		switch {
		case !ok || m.State == membership.Dead:
			c.lost(fmt.Sprintf("stage node %s is dead", s.Node), s.Node)
			return
		case m.State == membership.Left && !c.leaving:
			c.replace, c.leaving = fmt.Sprintf("stage node %s is leaving", s.Node), true
			c.info("%s: moving its layers to the other stage nodes", c.replace)
		}
	}
}

// lost handles the loss of the serving pipeline, blamed on node (""
// when none could be named): its requests wait while a new pipeline is
// built over the candidates left.
func (c *Core) lost(why, node string) {
	p := c.serving
	c.serving = nil
	c.replace, c.leaving, c.pinned = "", false, false
	if c.building != nil {
		// The move under way replaced its stages (a node loads one stage
		// at a time): expected, the requests wait for the new pipeline.
		c.info("pipeline of epoch %d stopped while moving to epoch %d: %s", p.epoch, c.building.epoch, why)
		c.reason = fmt.Sprintf("building the pipeline of epoch %d", c.building.epoch)
	} else {
		c.warn("pipeline of epoch %d lost: %s; rebuilding it over the live stage nodes", p.epoch, why)
		if node != "" {
			c.suspects[node] = c.now
			c.wanted[node] = true
		}
		c.nextTry = c.now
	}
	c.emit(Close{Epoch: p.epoch, Why: "lost: " + why})
	if c.outage.IsZero() {
		c.outage, c.outageWhy, c.failed = c.now, why, false
		c.last = Change{Kind: "recovery", Why: why, Start: c.now}
		if b := c.building; b != nil {
			// The change is the move, whose requests wait for it.
			c.last = Change{Kind: b.kind, Why: b.why, Start: b.started}
		}
	}
}

func (c *Core) stageFailed(ev StageFailed) {
	if c.serving == nil || ev.Epoch != c.serving.epoch {
		c.info("failure of epoch %d ignored: not the serving pipeline (stale): %v", ev.Epoch, ev.Err)
		return
	}
	// A loss blamed on a node always begins with it, however the failure
	// names it further on (a probe's "stage 1 on s2 does not answer").
	why := fmt.Sprint(ev.Err)
	if ev.Node != "" {
		why = fmt.Sprintf("stage node %s: %s", ev.Node, why)
	}
	c.lost(why, ev.Node)
}

func (c *Core) buildDone(ev BuildDone) {
	c.seenEpoch = max(c.seenEpoch, ev.RefusedEpoch)
	if c.building == nil || ev.Epoch != c.building.epoch {
		if ev.Err == nil {
			c.emit(Close{Epoch: ev.Epoch, Why: "built for nothing: its build was given up"})
		}
		c.info("result of the build of epoch %d ignored: stale", ev.Epoch)
		return
	}
	p := c.building
	c.building = nil
	if ev.Err != nil {
		c.warn("building the pipeline of epoch %d failed: %v", p.epoch, ev.Err)
		if c.outage.IsZero() {
			c.last.End, c.last.Err = c.now, ev.Err.Error()
		}
		for _, n := range ev.Nodes {
			c.suspects[n] = c.now
		}
		c.nextTry = c.now.Add(c.cfg.BuildRetry)
		if c.serving == nil {
			c.reason = fmt.Sprintf("building the pipeline failed: %v", ev.Err)
		}
		return
	}
	old := c.serving
	c.emit(Switch{Epoch: p.epoch})
	if old != nil {
		c.emit(Close{Epoch: old.epoch, Why: fmt.Sprintf("replaced by epoch %d", p.epoch)})
	}
	c.serving, c.everServed, c.replace, c.leaving, c.stuck, c.reason = p, true, "", false, "", ""
	c.pinned = p.byTime || p.kind == "rebalance" && p.why == rebalanceAsked && len(p.ranges) > 0
	for _, s := range p.plan.Stages {
		delete(c.wanted, s.Node)
	}
	if !c.outage.IsZero() {
		c.info("pipeline of epoch %d serving [%s]: recovered %v after losing the last one (%s)", p.epoch, PlanString(p.plan), c.now.Sub(c.outage), c.outageWhy)
		c.last.End, c.last.Epoch = c.now, p.epoch
		c.outage, c.failed = time.Time{}, false
	} else {
		c.info("pipeline of epoch %d serving [%s] (%s: %s)", p.epoch, PlanString(p.plan), p.kind, p.why)
		c.last = Change{Kind: p.kind, Why: p.why, Start: p.started, End: c.now, Epoch: p.epoch}
	}
	switch c.last.Kind {
	case "recovery":
		c.counts.Recoveries++
	case "move":
		c.counts.Moves++
	case "rebalance":
		c.counts.Rebalances++
	}
}

// errNotLeader refuses an admin command on a node that does not lead.
func (c *Core) errNotLeader() error {
	if c.leader.Name == "" {
		return errors.New("no leader has been chosen yet")
	}
	return fmt.Errorf("this node is not the leader; the leader is %s", c.leader.Name)
}

func (c *Core) drain(node string) error {
	if !c.leading() {
		return c.errNotLeader()
	}
	m, ok := c.member(node)
	if !ok || m.Meta.DataAddr == "" {
		return fmt.Errorf("drain: %s is not a stage node of the cluster", node)
	}
	if c.drained[node] {
		return nil
	}
	c.drained[node] = true
	delete(c.wanted, node)
	c.info("stage node %s drained: out of placement", node)
	if c.serving != nil && inPlan(c.serving.plan, node) {
		c.replace = fmt.Sprintf("stage node %s drained", node)
	}
	return nil
}

func (c *Core) undrain(node string) error {
	if !c.leading() {
		return c.errNotLeader()
	}
	if !c.drained[node] {
		return fmt.Errorf("undrain: %s is not drained", node)
	}
	delete(c.drained, node)
	c.wanted[node] = true
	c.asked = true
	c.info("stage node %s undrained: back in placement", node)
	return nil
}

func (c *Core) rebalance(ranges []placement.Range) error {
	if !c.leading() {
		return c.errNotLeader()
	}
	if c.building != nil {
		return fmt.Errorf("rebalance: the build of epoch %d is under way", c.building.epoch)
	}
	plan, err := c.place(c.candidates(), ranges, false)
	if err != nil {
		return fmt.Errorf("rebalance: %w", err)
	}
	if c.serving != nil && samePlan(plan, c.serving.plan) {
		return fmt.Errorf("rebalance: the pipeline of epoch %d already has this placement [%s]", c.serving.epoch, PlanString(plan))
	}
	c.startBuild(plan, "rebalance", rebalanceAsked)
	c.building.ranges = ranges
	return nil
}

// decide starts what the state calls for: giving up the pipeline when
// another node leads, the first build, a rebuild after a loss, a move off
// a leaving or drained node, an automatic rebalance; and fails the
// requests of an outage past its deadline.
func (c *Core) decide() {
	defer func() { c.asked = false }()
	if !c.leading() {
		c.demote()
		return
	}
	if !c.outage.IsZero() && !c.failed && c.now.Sub(c.outage) >= c.cfg.RecoveryTimeout {
		c.failed = true
		c.emit(FailRequests{Reason: fmt.Sprintf("no pipeline could be rebuilt within %v of losing the last one (%s): %s", c.cfg.RecoveryTimeout, c.outageWhy, c.reason)})
	}
	if c.building != nil || c.now.Before(c.nextTry) {
		return
	}
	cands := c.candidates()
	switch {
	case c.serving == nil:
		if !c.everServed && c.inherited == "" && len(cands) < c.cfg.ExpectStages {
			c.reason = waitingReason(c.members, c.cfg.kin(), len(cands), c.cfg.ExpectStages)
			return
		}
		plan, err := c.place(cands, c.cfg.Plan, true)
		if err != nil {
			c.reason = fmt.Sprintf("no placement over the live stage nodes: %v", err)
			c.nextTry = c.now.Add(c.cfg.BuildRetry)
			return
		}
		c.noteLeftOut(plan)
		if !c.outage.IsZero() {
			c.startBuild(plan, "recovery", c.outageWhy)
		} else if c.inherited != "" {
			c.startBuild(plan, "start", fmt.Sprintf("took the leadership over from %s; %d stage nodes up", c.inherited, len(cands)))
		} else {
			c.startBuild(plan, "start", fmt.Sprintf("%d stage nodes up", len(cands)))
		}
	case c.replace != "":
		plan, err := c.place(cands, c.cfg.Plan, true)
		if err != nil && c.leaving {
			// The node goes whatever happens: let the requests running
			// finish on the pipeline, then release it.
			why := fmt.Sprintf("%s and no placement is possible without it (%v)", c.replace, err)
			c.warn("%s: retiring the pipeline of epoch %d once its requests finish", why, c.serving.epoch)
			c.emit(Retire{Epoch: c.serving.epoch, Why: why})
			c.serving, c.replace, c.leaving = nil, "", false
			c.reason = why
			return
		}
		if err != nil {
			if c.stuck != c.replace {
				c.warn("%s, but no placement without it: %v; it keeps serving", c.replace, err)
				c.stuck = c.replace
			}
			c.nextTry = c.now.Add(c.cfg.BuildRetry)
			return
		}
		c.noteLeftOut(plan)
		c.startBuild(plan, "move", c.replace)
	case c.cfg.AutoRebalance && !c.pinned && (c.now.Sub(c.changed) >= c.cfg.StableFor || c.asked) && c.rebalanceByMemory(cands):
	case c.cfg.BalanceAfter > 0 && c.now.Sub(c.changed) >= c.cfg.StableFor && c.balanceByTime():
	}
}

// rebalanceByMemory starts moving the serving pipeline to the placement
// over the candidates (auto-rebalance) when that restores a node lost or
// undrained or raises the KV capacity by rebalanceGain, and reports
// whether it did.
func (c *Core) rebalanceByMemory(cands []membership.Member) bool {
	plan, err := c.place(cands, c.cfg.Plan, true)
	if err != nil {
		return false
	}
	c.noteLeftOut(plan)
	if samePlan(plan, c.serving.plan) {
		// The nodes that joined since hold no stage either: say why.
		c.serving.plan.LeftOut = plan.LeftOut
		return false
	}
	var restored []string
	for _, s := range plan.Stages {
		if c.wanted[s.Node] && !inPlan(c.serving.plan, s.Node) {
			restored = append(restored, s.Node)
		}
	}
	switch old := c.serving.plan.KVTokens; {
	case len(restored) > 0:
		c.startBuild(plan, "rebalance", fmt.Sprintf("restores %s", strings.Join(restored, ", ")))
	case float64(plan.KVTokens) >= float64(old)*(1+rebalanceGain):
		c.startBuild(plan, "rebalance", fmt.Sprintf("raises the KV capacity from %d to %d tokens", old, plan.KVTokens))
	default:
		return false
	}
	return true
}

// balanceByTime starts moving the serving pipeline to the placement its
// stages' times call for (CoreConfig.BalanceAfter), and reports whether it
// did.
func (c *Core) balanceByTime() bool {
	p, t := c.serving, c.times
	if p == nil || c.pinned || t.Epoch != p.epoch || len(t.Busy) != len(p.plan.Stages) || c.unfit == p.epoch {
		return false
	}
	stages := make([]placement.StageTime, len(t.Busy))
	for i, s := range p.plan.Stages {
		if t.Busy[i] < c.cfg.BalanceAfter {
			return false
		}
		stages[i] = placement.StageTime{Node: s.Node, Lo: s.Lo, Hi: s.Hi, Busy: t.Busy[i]}
	}
	fit, err := placement.ByTime(stages)
	if err != nil || fit.Unchanged() {
		return false
	}
	was, will := placement.Slowest(fit.Times), placement.Slowest(fit.Predicted)
	if float64(will) > float64(was)*(1-balanceGain) {
		return false
	}
	plan, err := c.place(c.candidates(), fit.After, false)
	if err != nil {
		c.warn("balancing the pipeline of epoch %d by its stages' times: %v; it keeps its placement", p.epoch, err)
		c.unfit = p.epoch
		return false
	}
	// The same nodes, so the same ones left out, for the same reasons.
	plan.LeftOut = p.plan.LeftOut
	var total time.Duration
	for _, d := range fit.Times {
		total += d
	}
	c.startBuild(plan, "rebalance", fmt.Sprintf("balances the stages' times: the slowest took %.0f%% of their time, %.0f%% predicted; KV capacity %d -> %d tokens",
		100*float64(was)/float64(total), 100*float64(will)/float64(total), p.plan.KVTokens, plan.KVTokens))
	c.building.ranges, c.building.byTime = fit.After, true
	return true
}

// demote gives up what this node ran as leader: another node leads.
func (c *Core) demote() {
	why := "this node is no longer the leader"
	if c.leader.Name != "" {
		why += "; the leader is " + c.leader.Name
	}
	if c.building != nil {
		c.emit(CancelBuild{Epoch: c.building.epoch})
		c.building = nil
	}
	if c.serving != nil {
		c.warn("%s: retiring the pipeline of epoch %d", why, c.serving.epoch)
		c.emit(Retire{Epoch: c.serving.epoch, Why: why})
		c.serving = nil
	} else if !c.outage.IsZero() && !c.failed {
		c.emit(FailRequests{Reason: why})
	}
	c.outage, c.failed, c.replace, c.leaving, c.everServed, c.inherited, c.leftOut = time.Time{}, false, "", false, false, "", ""
	if c.leader.Name == "" {
		c.reason = "no leader: no eligible member is alive"
	} else {
		c.reason = fmt.Sprintf("not the leader (the leader is %q)", c.leader.Name)
	}
}

// candidates are the live stage nodes of the model that placement may
// use: not drained, and not suspected of a recent failure (a suspect
// comes back once it restarted, or once SuspectFor has passed).
func (c *Core) candidates() []membership.Member {
	var out []membership.Member
	for _, m := range stageCandidates(c.members, c.cfg.kin()) {
		if c.drained[m.Name] {
			continue
		}
		if t, ok := c.suspects[m.Name]; ok {
			if !m.Since.After(t) && c.now.Sub(t) < c.cfg.SuspectFor {
				continue
			}
			delete(c.suspects, m.Name)
		}
		out = append(out, m)
	}
	return out
}

// place places the model over cands: after ranges when every node they
// name is a candidate, else (when ranges is the configured plan,
// fallback set) by memory.
func (c *Core) place(cands []membership.Member, ranges []placement.Range, fallback bool) (placement.Plan, error) {
	if len(cands) == 0 {
		return placement.Plan{}, errors.New("no stage node is up")
	}
	nodes := make([]placement.Node, len(cands))
	for i, m := range cands {
		nodes[i] = placement.Node{Name: m.Name, UsableBytes: m.Meta.MemFree, Backend: m.Meta.Backend}
	}
	if len(ranges) > 0 && fallback {
		for _, r := range ranges {
			if !slices.ContainsFunc(nodes, func(n placement.Node) bool { return n.Name == r.Node }) {
				ranges = nil // the configured plan names a node that is not up
				break
			}
		}
	}
	return c.cfg.Place(nodes, ranges)
}

// noteLeftOut logs the nodes a placement over the candidates leaves out,
// and why, when they or their reasons differ from the last logged.
func (c *Core) noteLeftOut(p placement.Plan) {
	parts := make([]string, len(p.LeftOut))
	for i, l := range p.LeftOut {
		parts[i] = l.String()
	}
	if s := strings.Join(parts, "; "); s != c.leftOut {
		c.leftOut = s
		if s != "" {
			c.info("left out of placement: %s", s)
		}
	}
}

// startBuild emits the build of plan at a new epoch.
func (c *Core) startBuild(plan placement.Plan, kind, why string) {
	c.lastEpoch = max(c.cfg.EpochBase(c.now), c.lastEpoch+1, c.seenEpoch+1)
	c.building = &pipe{epoch: c.lastEpoch, plan: plan, kind: kind, why: why, started: c.now}
	var ms []membership.Member
	for _, s := range plan.Stages {
		m, _ := c.member(s.Node)
		ms = append(ms, m)
	}
	if c.serving == nil {
		c.reason = fmt.Sprintf("building the pipeline of epoch %d", c.lastEpoch)
	}
	if c.outage.IsZero() {
		// A recovery's change began with the loss.
		c.last = Change{Kind: kind, Why: why, Start: c.now}
	}
	c.emit(Build{Epoch: c.lastEpoch, Plan: plan, Members: ms, Why: kind + ": " + why, Alongside: c.serving != nil})
}

func inPlan(p placement.Plan, node string) bool {
	return slices.ContainsFunc(p.Stages, func(s placement.Stage) bool { return s.Node == node })
}

// samePlan reports whether two plans put the same layers on the same
// nodes.
func samePlan(a, b placement.Plan) bool {
	return slices.EqualFunc(a.Stages, b.Stages, func(x, y placement.Stage) bool {
		return x.Node == y.Node && x.Lo == y.Lo && x.Hi == y.Hi
	})
}
