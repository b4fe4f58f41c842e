package daemon

import (
	"errors"
	"strings"
	"testing"

	"github.com/tandem-llm/tandem/daemon/membership"
	"github.com/tandem-llm/tandem/daemon/placement"
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
		if got := chooseLeader(tc.fixed, tc.members).Name; got != tc.want {
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
	}
	var got []string
	for _, m := range stageCandidates(ms, "m") {
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
	}
	want := "waiting for stage nodes: 1 of 2 up (left out: c has model 0123456789ab; the leader has model m)"
	if got := waitingReason(ms, "m", 1, 2); got != want {
		t.Errorf("reason %q, want %q", got, want)
	}
	if got := waitingReason(ms[:2], "m", 1, 2); got != "waiting for stage nodes: 1 of 2 up" {
		t.Errorf("reason without a mismatch: %q", got)
	}
}

// TestPlan checks the balanced and the explicit placement over members,
// and an explicit plan naming a node that is not up.
func TestPlan(t *testing.T) {
	ckpt, _ := openTestModel(t, testModel(t))
	d := &Daemon{ckpt: ckpt}
	d.cfg.Stage = StageConfig{MaxBatchTokens: 64, MaxSeqs: 4}
	cands := []membership.Member{member("x", membership.Alive, true, "h:0", "m"), member("y", membership.Alive, true, "h:0", "m")}
	p, err := d.plan(cands)
	if err != nil || len(p.Stages) != 2 || p.Stages[0].Node != "x" || p.Stages[0].Lo != 0 || p.Stages[1].Hi != 4 || p.Stages[0].Hi != p.Stages[1].Lo {
		t.Errorf("balanced plan %+v, %v", p, err)
	}
	d.cfg.Plan = []PlanRange{{Node: "y", Layers: [2]int{0, 3}}, {Node: "x", Layers: [2]int{3, 4}}}
	p, err = d.plan(cands)
	if err != nil || len(p.Stages) != 2 || p.Stages[0].Node != "y" || p.Stages[0].Hi != 3 || p.Stages[1].Node != "x" {
		t.Errorf("explicit plan %+v, %v", p, err)
	}
	d.cfg.Plan = []PlanRange{{Node: "y", Layers: [2]int{0, 3}}, {Node: "z", Layers: [2]int{3, 4}}}
	if _, err := d.plan(cands); err == nil || !strings.Contains(err.Error(), "z") {
		t.Errorf("plan naming a node that is not up: %v, want an error naming it", err)
	}
}

// TestStageKVTokensMatchesPlacement checks the capacity a node reports for
// its stage against what placement computed for the same stage, for the
// costs of both backends.
func TestStageKVTokensMatchesPlacement(t *testing.T) {
	ckpt, _ := openTestModel(t, testModel(t))
	cfg := ckpt.Config()
	for _, backend := range []string{BackendCPU, BackendCUDA} {
		cost := backendCost(cfg, backend, 64, 4)
		for _, usable := range []uint64{300 << 20, 1 << 30} {
			nodes := []placement.Node{{Name: "a", UsableBytes: usable}, {Name: "b", UsableBytes: usable / 2}, {Name: "c", UsableBytes: usable}}
			p, err := placement.Balance(nodes, cost)
			if err != nil {
				t.Fatal(err)
			}
			for i, s := range p.Stages {
				got, err := cost.StageKVTokens(nodes[i].UsableBytes, s.Lo, s.Hi)
				if err != nil || got != s.KVTokens {
					t.Errorf("%s, usable %d, stage %+v: node reports %d tokens (%v), placement %d", backend, usable, s, got, err, s.KVTokens)
				}
			}
		}
		if _, err := cost.StageKVTokens(1<<20, 0, cfg.NumLayers); err == nil {
			t.Errorf("%s: a stage in 1 MiB: no error", backend)
		}
	}
}
