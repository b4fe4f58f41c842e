package supervise

import (
	"errors"
	"strings"
	"testing"

	"github.com/tandem-llm/tandem/daemon/membership"
)

func member(name string, st membership.State, eligible bool, dataAddr, modelID string) membership.Member {
	return membership.Member{Name: name, State: st, Meta: membership.Meta{Name: name, Backend: "cpu", LeaderEligible: eligible, DataAddr: dataAddr, ModelID: modelID, MemTotal: 1 << 30, MemFree: 1 << 30}}
}

func TestChooseLeader(t *testing.T) {
	alive, dead, left := membership.Alive, membership.Dead, membership.Left
	broken := member("a0", alive, true, "", "m")
	broken.MetaErr = errors.New("corrupt")
	for _, tc := range []struct {
		name    string
		fixed   string
		members []membership.Member
		want    string
	}{
		{"smallest eligible", "", []membership.Member{member("a", alive, false, "", ""), member("b", alive, true, "", ""), member("c", alive, true, "", "")}, "b"},
		{"dead skipped", "", []membership.Member{member("a", dead, true, "", ""), member("b", alive, true, "", "")}, "b"},
		{"left skipped", "", []membership.Member{member("a", left, true, "", ""), member("b", alive, true, "", "")}, "b"},
		{"bad metadata skipped", "", []membership.Member{broken, member("b", alive, true, "", "")}, "b"},
		{"fixed", "c", []membership.Member{member("a", alive, true, "", ""), member("c", alive, false, "", "")}, "c"},
		{"fixed but dead", "c", []membership.Member{member("a", alive, true, "", ""), member("c", dead, true, "", "")}, ""},
		{"none eligible", "", []membership.Member{member("a", alive, false, "", "")}, ""},
	} {
		if got := ChooseLeader(tc.fixed, tc.members).Name; got != tc.want {
			t.Errorf("%s: leader %q, want %q", tc.name, got, tc.want)
		}
	}
}

func TestStageCandidates(t *testing.T) {
	ms := []membership.Member{
		member("a", membership.Alive, true, "", "m"),        // no stage
		member("b", membership.Alive, true, "h:0", "m"),     // yes
		member("c", membership.Alive, true, "h:0", "other"), // another model
		member("d", membership.Dead, true, "h:0", "m"),      // dead
		member("e", membership.Alive, false, "h:0", "m"),    // yes
		member("f", membership.Alive, false, "h:0", "m"),    // another protocol
	}
	ms[5].Meta.Protocol = "p2"
	var got []string
	for i := range ms[:5] {
		ms[i].Meta.Protocol = "p1"
	}
	for _, m := range stageCandidates(ms, kin{"m", "p1"}) {
		got = append(got, m.Name)
	}
	if strings.Join(got, ",") != "b,e" {
		t.Errorf("candidates %v, want b,e", got)
	}
}

// TestWaitingReason checks that the leader's reason for not serving names
// the live stage nodes that serve another model, and only those.
func TestWaitingReason(t *testing.T) {
	ms := []membership.Member{
		member("a", membership.Alive, true, "", "other"),                   // no stage
		member("b", membership.Alive, true, "h:0", "m"),                    // a candidate
		member("c", membership.Alive, true, "h:0", "0123456789abcdef0123"), // another model
		member("d", membership.Dead, true, "h:0", "0123456789abcdef0123"),  // dead
		member("e", membership.Alive, true, "h:0", "m"),                    // another protocol
		member("f", membership.Alive, true, "h:0", "m"),                    // an older version
	}
	for i := range ms {
		ms[i].Meta.Protocol = "node/1"
	}
	ms[4].Meta.Protocol = "node/2"
	ms[5].Meta.Protocol = ""
	want := `waiting for stage nodes: 1 of 2 up (left out: c has model 0123456789ab, e speaks internal protocol "node/2", the leader "node/1", f runs an older tandem (it gossips no internal protocol), the leader speaks "node/1"; the leader has model m)`
	if got := waitingReason(ms, kin{"m", "node/1"}, 1, 2); got != want {
		t.Errorf("reason %q, want %q", got, want)
	}
	if got := waitingReason(ms[:2], kin{"m", "node/1"}, 1, 2); got != "waiting for stage nodes: 1 of 2 up" {
		t.Errorf("reason without a mismatch: %q", got)
	}
}
