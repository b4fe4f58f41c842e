package daemon

import (
	"slices"
	"strings"
	"testing"

	"github.com/tandem-llm/tandem/daemon/placement"
)

// TestPlan checks the balanced and the explicit placement over stage
// nodes, and an explicit plan naming a node that is not up.
func TestPlan(t *testing.T) {
	ckpt, _ := openTestModel(t, testModel(t))
	d := &Daemon{ckpt: ckpt}
	d.cfg.Stage = StageConfig{MaxBatchTokens: 64, MaxSeqs: 4, BlockSize: DefaultBlockSize}
	cands := []placement.Node{{Name: "x", UsableBytes: 1 << 30, Backend: "cpu"}, {Name: "y", UsableBytes: 1 << 30, Backend: "cpu"}}
	p, err := d.place(cands, nil)
	if err != nil || len(p.Stages) != 2 || p.Stages[0].Node != "x" || p.Stages[0].Lo != 0 || p.Stages[1].Hi != 4 || p.Stages[0].Hi != p.Stages[1].Lo {
		t.Errorf("balanced plan %+v, %v", p, err)
	}
	p, err = d.place(cands, []placement.Range{{Node: "y", Lo: 0, Hi: 3}, {Node: "x", Lo: 3, Hi: 4}})
	if err != nil || len(p.Stages) != 2 || p.Stages[0].Node != "y" || p.Stages[0].Hi != 3 || p.Stages[1].Node != "x" {
		t.Errorf("explicit plan %+v, %v", p, err)
	}
	if _, err := d.place(cands, []placement.Range{{Node: "y", Lo: 0, Hi: 3}, {Node: "z", Lo: 3, Hi: 4}}); err == nil || !strings.Contains(err.Error(), "z") {
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
			for _, s := range p.Stages {
				// b, with half the memory, may be left out: by name.
				i := slices.IndexFunc(nodes, func(n placement.Node) bool { return n.Name == s.Node })
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
