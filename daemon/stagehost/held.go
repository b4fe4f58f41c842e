package stagehost

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/progress"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
	"github.com/tandem-llm/tandem/stage"
)

// resetter is a stage a node can reuse in the next pipeline (stage/cpu,
// stage/cuda): Reset forgets every sequence, keeping the weights.
type resetter interface{ Reset() error }

// heldStage is a loaded stage: held by one assignment or, while the
// pipeline moves and this node keeps its layers, by two (the serving
// pipeline's and the new one's). One of them runs steps on it, the active
// one; the new one takes it over at its first step (acquire).
type heldStage struct {
	st    stage.Stage
	info  stage.Info
	spec  stageSpec
	epoch uint64 // the epoch it was loaded in
	// bytes is the memory it holds as placement counts it, for the
	// alongside check (CPU stages; a CUDA stage sizes its KV cache from
	// the device's free memory).
	bytes uint64
	// resp is what Load reported of it, addresses aside.
	resp *tandemv1.LoadResponse
	// steps reports the CUDA stage's loading steps (kernels, graphs).
	steps *progress.Steps

	users atomic.Int32 // assignments holding it; the last one closes it

	// Under the slot's mutex: its CUDA graphs once captured, and whether
	// it may serve another pipeline.
	captured []graphs.Step
	capture  *tandemv1.CaptureResponse
	noReuse  bool

	mu     sync.Mutex
	active *assignment // the assignment that runs steps on it
}

// hold adds a user.
func (h *heldStage) hold() { h.users.Add(1) }

// drop removes a user: the last closes the stage.
func (h *heldStage) drop() {
	if h.users.Add(-1) == 0 {
		h.st.Close()
	}
}

// reusable reports whether the stage can serve sp in another pipeline:
// the same layers, batch bounds and block size, a stage that can forget
// its sequences, and no reason found against it. s.mu is held.
func (h *heldStage) reusable(sp stageSpec) bool {
	_, ok := h.st.(resetter)
	return ok && !h.noReuse && h.spec.lo == sp.lo && h.spec.hi == sp.hi && h.spec.maxTokens == sp.maxTokens &&
		h.spec.maxSeqs == sp.maxSeqs && h.spec.blockSize == sp.blockSize
}

// sameGraphs reports whether the stage's captured graphs are exactly keys.
// s.mu is held.
func (h *heldStage) sameGraphs(keys []graphs.Step) bool {
	return h.captured != nil && slices.Equal(h.captured, keys)
}

// acquire makes a the stage's active assignment, before a runs its first
// step. When another assignment ran steps on it (the pipeline before),
// that one is ended first (its worker returns, its links close, the stage
// stays) and the stage forgets its sequences: the leader prefills them
// again on the new pipeline. It reports whether a took the stage over.
func (h *heldStage) acquire(a *assignment) (bool, error) {
	h.mu.Lock()
	prev := h.active
	h.active = a
	h.mu.Unlock()
	if prev == nil || prev == a {
		return false, nil
	}
	prev.cancel()
	<-prev.done
	if err := h.st.(resetter).Reset(); err != nil {
		return true, fmt.Errorf("reuse the stage of epoch %d: %w", h.epoch, err)
	}
	return true, nil
}
