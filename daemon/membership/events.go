package membership

import (
	"github.com/hashicorp/memberlist"
)

// eventDelegate is the memberlist.EventDelegate. memberlist calls it with
// its node lock held, one call at a time, so it only updates the member
// table and queues the event, never blocking.
type eventDelegate struct{ m *Membership }

func (d eventDelegate) NotifyJoin(n *memberlist.Node)   { d.m.observe(n, Join) }
func (d eventDelegate) NotifyUpdate(n *memberlist.Node) { d.m.observe(n, Update) }

// NotifyLeave covers both a graceful leave and a failure; the leaving
// flag the node set in its metadata before leaving tells them apart.
func (d eventDelegate) NotifyLeave(n *memberlist.Node) { d.m.observe(n, Fail) }

// observe records a node's new state and queues the event. kind is Fail
// for every departure; a departure flagged as leaving becomes Leave.
func (m *Membership) observe(n *memberlist.Node, kind EventKind) {
	mb := Member{Name: n.Name, Addr: n.Address(), State: Alive}
	meta, leaving, err := decodeMeta(n.Meta)
	if err != nil {
		mb.MetaErr = err
		m.log.Warn("member metadata rejected", "member", n.Name, "addr", mb.Addr, "err", err)
	} else {
		mb.Meta = meta
	}
	if kind == Fail {
		mb.State = Dead
		if leaving {
			kind, mb.State = Leave, Left
		}
	}
	m.evMu.Lock()
	if m.closed {
		m.evMu.Unlock()
		return
	}
	mb.Since = m.now()
	m.members[n.Name] = &mb
	m.enqueue(Event{Kind: kind, Member: mb})
	m.evMu.Unlock()
	m.log.Debug("membership event", "kind", kind, "member", n.Name, "addr", mb.Addr)
}

// enqueue sends ev without blocking, dropping the oldest queued event when
// the buffer is full. Callers hold evMu, so enqueue is the only sender.
func (m *Membership) enqueue(ev Event) {
	for {
		select {
		case m.events <- ev:
			return
		default:
		}
		select {
		case <-m.events:
			m.dropped.Add(1)
		default:
		}
	}
}
