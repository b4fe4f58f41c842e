package supervise

import (
	"fmt"
	"strings"
	"time"

	"github.com/tandem-llm/tandem/daemon/membership"
	"github.com/tandem-llm/tandem/daemon/placement"
)

// Event is an input of the Core.
type Event interface{ event() }

// Members is a snapshot of the membership (membership.Members): the
// core's view of the cluster is level-triggered, so every wake-up may
// carry one.
type Members struct{ List []membership.Member }

// Tick only lets time pass: timers (build retries, the recovery deadline,
// auto-rebalance after a stable membership) are checked on every event.
type Tick struct{}

// BuildDone is the end of a Build: Err is nil when the pipeline of Epoch
// is wired and ready to switch to.
type BuildDone struct {
	Epoch uint64
	Err   error
	// Nodes are the nodes whose calls failed (empty when the failure is
	// no node's, or the build succeeded).
	Nodes []string
	// RefusedEpoch is the newest epoch a node said it had accepted when it
	// refused this one as stale (0: none), so the next epoch is newer.
	RefusedEpoch uint64
}

// StageFailed is a failure of a running pipeline, from its engine: a step
// failed or a link broke (the driver blames a stage), or a step passed
// its deadline.
type StageFailed struct {
	Epoch uint64
	// Node is the stage node blamed, "" when none could be named.
	Node string
	Err  error
}

// Drain takes a stage node out of placement: its layers move to the
// others, it stays a member. Undrain puts it back.
type Drain struct{ Node string }

// Undrain puts a drained node back into placement; with auto-rebalance a
// rebalance follows once the membership is stable.
type Undrain struct{ Node string }

// Rebalance recomputes the placement over the live, undrained stage nodes
// (or applies Ranges) and moves the pipeline to it.
type Rebalance struct{ Ranges []placement.Range }

// StageTimes is the time each stage of the pipeline of Epoch has spent in
// its steps since it was built, in pipeline order (placement.StageBusy):
// what a balance by time reads (CoreConfig.BalanceAfter).
type StageTimes struct {
	Epoch uint64
	Busy  []time.Duration
}

func (Members) event()     {}
func (Tick) event()        {}
func (BuildDone) event()   {}
func (StageFailed) event() {}
func (Drain) event()       {}
func (Undrain) event()     {}
func (Rebalance) event()   {}
func (StageTimes) event()  {}

// Action is an output of the Core, for the loop to perform.
type Action interface {
	action()
	String() string
}

// Build has the stage nodes load, capture and wire the pipeline of Epoch
// after Plan, then reports BuildDone. Members are the plan's nodes as the
// membership describes them (their addresses).
type Build struct {
	Epoch   uint64
	Plan    placement.Plan
	Members []membership.Member
	Why     string
	// Alongside: a pipeline serves meanwhile, so each node keeps its stage
	// of it running beside the new one where its memory allows (a stage
	// whose layers do not change is reused), until the switch.
	Alongside bool
}

// Switch moves the requests onto the built pipeline of Epoch: the steps in
// flight on the old one are abandoned, and every running request
// re-prefills its prompt and the tokens already streamed on the new one.
type Switch struct{ Epoch uint64 }

// Close stops using the pipeline of Epoch (the requests are parked first
// if it is the one they run on), closes its links and releases its
// stages.
type Close struct {
	Epoch uint64
	Why   string
}

// CancelBuild gives up the build of Epoch; its result, when it comes, is
// stale.
type CancelBuild struct{ Epoch uint64 }

// Retire lets the requests running on the pipeline of Epoch finish, admits
// no more, then closes it: this node is no longer the leader. If the
// pipeline fails meanwhile its requests fail with Why.
type Retire struct {
	Epoch uint64
	Why   string
}

// FailRequests ends every accepted request, running or waiting, with
// UNAVAILABLE and Reason: no pipeline could serve them in time.
type FailRequests struct{ Reason string }

// Log is a line for the node's log: what the core decided and why.
type Log struct {
	Warn bool
	Msg  string
}

func (Build) action()        {}
func (Switch) action()       {}
func (Close) action()        {}
func (CancelBuild) action()  {}
func (Retire) action()       {}
func (FailRequests) action() {}
func (Log) action()          {}

func (a Build) String() string {
	beside := ""
	if a.Alongside {
		beside = " alongside"
	}
	return fmt.Sprintf("build epoch %d [%s] kv %d%s (%s)", a.Epoch, PlanString(a.Plan), a.Plan.KVTokens, beside, a.Why)
}
func (a Switch) String() string      { return fmt.Sprintf("switch to epoch %d", a.Epoch) }
func (a Close) String() string       { return fmt.Sprintf("close epoch %d (%s)", a.Epoch, a.Why) }
func (a CancelBuild) String() string { return fmt.Sprintf("cancel the build of epoch %d", a.Epoch) }
func (a Retire) String() string      { return fmt.Sprintf("retire epoch %d (%s)", a.Epoch, a.Why) }
func (a FailRequests) String() string {
	return fmt.Sprintf("fail requests: %s", a.Reason)
}
func (a Log) String() string {
	if a.Warn {
		return "warn: " + a.Msg
	}
	return "info: " + a.Msg
}

// PlanString writes a plan's stages as node[lo,hi) in pipeline order.
func PlanString(p placement.Plan) string {
	parts := make([]string, len(p.Stages))
	for i, s := range p.Stages {
		parts[i] = fmt.Sprintf("%s[%d,%d)", s.Node, s.Lo, s.Hi)
	}
	return strings.Join(parts, " ")
}
