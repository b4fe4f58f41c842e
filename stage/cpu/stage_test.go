package cpu

import (
	"testing"

	"github.com/tandem-llm/tandem/stage"
	"github.com/tandem-llm/tandem/stage/stagetest"
)

// newTestStage builds a CPU stage for the conformance suite with an uneven
// number of threads, closed when t ends.
func newTestStage(t *testing.T, s stagetest.Spec) stage.Stage {
	t.Helper()
	st, err := New(Config{Model: s.Model, Lo: s.Lo, Hi: s.Hi, Weights: s.Weights, MaxTokens: s.MaxTokens, MaxSeqs: s.MaxSeqs,
		NumBlocks: s.KVBlocks, BlockSize: s.BlockSize, Threads: 3})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

func TestConformance(t *testing.T) {
	stagetest.Run(t, stagetest.Backend{New: newTestStage, Tol: 1e-5, SplitTol: 1e-6, Paged: true, Handoff: true})
}

// TestConformanceTimed runs the suite on CPU stages behind
// stagetest.Timed (with no step time), the stage.Launcher the pipeline's
// tests and the leader-path measurement use in place of a device.
func TestConformanceTimed(t *testing.T) {
	stagetest.Run(t, stagetest.Backend{New: func(t *testing.T, s stagetest.Spec) stage.Stage {
		return stagetest.NewTimed(newTestStage(t, s), 0)
	}, Tol: 1e-5, SplitTol: 1e-6, Paged: true, Handoff: true, Launcher: true})
}
