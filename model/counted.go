package model

import (
	"sync"

	"github.com/tandem-llm/tandem/model/safetensors"
)

// Counted hands out a checkpoint's tensors, as Checkpoint.Tensor does, and
// tells a progress display how many bytes of them the reader (a stage
// being built) has gone through: when it asks for a tensor, it is done
// with the ones it asked for before, and Finish says it is done with all.
// Each tensor counts once, however often it is asked for.
type Counted struct {
	c      *Checkpoint
	report func(done int64)

	mu      sync.Mutex
	seen    map[string]bool
	done    int64 // bytes of the tensors finished with
	pending int64 // bytes of the tensor handed out last
}

// Counted returns a Counted over c that calls report (nil: nobody) with the
// bytes gone through so far: 0 at the first tensor asked for, then after
// each one. Compare with StageBytes.
func (c *Checkpoint) Counted(report func(done int64)) *Counted {
	return &Counted{c: c, report: report, seen: map[string]bool{}}
}

// Tensor returns the tensor called name, as Checkpoint.Tensor does.
func (r *Counted) Tensor(name string) (*safetensors.Tensor, error) {
	t, err := r.c.Tensor(name)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	first := len(r.seen) == 0
	r.done += r.pending
	r.pending = 0
	if !r.seen[name] {
		r.seen[name] = true
		r.pending = int64(len(t.Data))
	}
	done := r.done
	r.mu.Unlock()
	if r.report != nil && (first || done > 0) {
		r.report(done)
	}
	return t, nil
}

// Finish reports every tensor handed out as gone through.
func (r *Counted) Finish() {
	r.mu.Lock()
	r.done += r.pending
	r.pending = 0
	done := r.done
	r.mu.Unlock()
	if r.report != nil {
		r.report(done)
	}
}
