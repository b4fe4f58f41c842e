package membership

import (
	"fmt"
	"time"
)

// State is a member's state as this node last learned it.
//
// memberlist keeps suspicion private (it is not in its public API), so a
// member under suspicion stays Alive here until it is declared dead or
// refutes the suspicion.
type State int

// Member states.
const (
	// Alive: the member answers probes (or is suspected but not yet dead).
	Alive State = iota
	// Dead: the member stopped answering and was declared failed.
	Dead
	// Left: the member left gracefully (Leave).
	Left
)

func (s State) String() string {
	switch s {
	case Alive:
		return "alive"
	case Dead:
		return "dead"
	case Left:
		return "left"
	}
	return fmt.Sprintf("State(%d)", int(s))
}

// Member is one node of the cluster.
type Member struct {
	// Name is the node's unique name.
	Name string
	// Addr is the node's gossip address, host:port.
	Addr string
	// Meta is the node's metadata; zero when MetaErr is set.
	Meta Meta
	// MetaErr is non-nil when the node's metadata could not be decoded
	// (a newer or corrupt peer); such a member must not be given work.
	MetaErr error
	State   State
	// Since is when this node learned the current state.
	Since time.Time
}

// EventKind is what happened to a member.
type EventKind int

// Event kinds.
const (
	// Join: a member appeared, or came back after being dead or gone.
	Join EventKind = iota
	// Update: a live member changed its metadata.
	Update
	// Leave: a member left gracefully.
	Leave
	// Fail: a member stopped answering and was declared dead.
	Fail
)

func (k EventKind) String() string {
	switch k {
	case Join:
		return "join"
	case Update:
		return "update"
	case Leave:
		return "leave"
	case Fail:
		return "fail"
	}
	return fmt.Sprintf("EventKind(%d)", int(k))
}

// Event is a change of membership, with the member as it is after the
// change.
type Event struct {
	Kind   EventKind
	Member Member
}
