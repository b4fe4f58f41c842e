package membership

import (
	"log/slog"
	"net"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
)

func newUnstarted(t *testing.T) *Membership {
	t.Helper()
	m, err := New(Config{NodeName: "self", Meta: Meta{Backend: BackendCPU}, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func node(t *testing.T, name string, meta Meta, leaving bool) *memberlist.Node {
	t.Helper()
	b, err := encodeMeta(meta, leaving)
	if err != nil {
		t.Fatal(err)
	}
	return &memberlist.Node{Name: name, Addr: net.IPv4(127, 0, 0, 1), Port: 7946, Meta: b}
}

func TestEventClassification(t *testing.T) {
	meta := Meta{Name: "p", Backend: BackendCUDA, GRPCAddr: "127.0.0.1:1"}
	tests := []struct {
		name     string
		call     func(d eventDelegate, n *memberlist.Node)
		leaving  bool
		kind     EventKind
		state    State
		badMeta  bool
		wantMeta Meta
	}{
		{"join", eventDelegate.NotifyJoin, false, Join, Alive, false, meta},
		{"update", eventDelegate.NotifyUpdate, false, Update, Alive, false, meta},
		{"failure", eventDelegate.NotifyLeave, false, Fail, Dead, false, meta},
		{"graceful leave", eventDelegate.NotifyLeave, true, Leave, Left, false, meta},
		{"undecodable meta", eventDelegate.NotifyJoin, false, Join, Alive, true, Meta{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := newUnstarted(t)
			n := node(t, "p", meta, tt.leaving)
			if tt.badMeta {
				n.Meta = []byte{0}
			}
			tt.call(eventDelegate{m}, n)
			ev := <-m.Events()
			if ev.Kind != tt.kind || ev.Member.State != tt.state || ev.Member.Meta != tt.wantMeta ||
				ev.Member.Addr != "127.0.0.1:7946" || (ev.Member.MetaErr != nil) != tt.badMeta {
				t.Errorf("event %+v, want kind %v state %v meta %+v", ev, tt.kind, tt.state, tt.wantMeta)
			}
			if got := m.Members(); len(got) != 1 || got[0].State != tt.state {
				t.Errorf("members %+v, want p %v", got, tt.state)
			}
		})
	}
}

func TestEventsDropOldest(t *testing.T) {
	m := newUnstarted(t)
	d := eventDelegate{m}
	const extra = 10
	start := time.Now()
	for i := range eventBuffer + extra {
		n := node(t, "p", Meta{Backend: BackendCPU, MemFree: uint64(i), MemTotal: 1 << 40}, false)
		d.NotifyUpdate(n)
	}
	if took := time.Since(start); took > time.Second {
		t.Errorf("delegate calls took %v with no consumer", took)
	}
	if got := m.Dropped(); got != extra {
		t.Errorf("dropped %d, want %d", got, extra)
	}
	for i := extra; i < eventBuffer+extra; i++ {
		if ev := <-m.Events(); ev.Member.Meta.MemFree != uint64(i) {
			t.Fatalf("event %d carries MemFree %d: the oldest were not the ones dropped", i, ev.Member.Meta.MemFree)
		}
	}
}

func TestDeadRetention(t *testing.T) {
	m := newUnstarted(t)
	now := time.Unix(1000, 0)
	m.nowForTest = func() time.Time { return now }
	d := eventDelegate{m}
	d.NotifyJoin(node(t, "alive", Meta{}, false))
	d.NotifyJoin(node(t, "dead", Meta{}, false))
	d.NotifyLeave(node(t, "dead", Meta{}, false))
	now = now.Add(deadRetention)
	if got := m.Members(); len(got) != 2 {
		t.Fatalf("at the retention limit: %+v, want both", got)
	}
	now = now.Add(time.Second)
	got := m.Members()
	if len(got) != 1 || got[0].Name != "alive" {
		t.Fatalf("after retention: %+v, want only the live member", got)
	}
	// A member that comes back is listed again.
	d.NotifyJoin(node(t, "dead", Meta{}, false))
	if got := m.Members(); len(got) != 2 || got[1].State != Alive {
		t.Fatalf("after rejoin: %+v", got)
	}
}
