package daemon

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/tandem-llm/tandem/daemon/apierr"
	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/pipeline"
	"github.com/tandem-llm/tandem/sched"
	"github.com/tandem-llm/tandem/stage"
)

// drainPoll is how often a draining engine checks whether its requests are
// done.
const drainPoll = 10 * time.Millisecond

// engine is the leader's request path over one pipeline: a sched.Loop
// (continuous batching over the stages' paged KV caches, a step in flight
// per stage) driving the pipeline's Driver, every step stamped with the
// leader's epoch. Generate calls submit requests and read their token
// streams; the engine adds drain (finish what was admitted, admit nothing
// more) and abort (fail everything now) for the daemon's lifecycle.
type engine struct {
	loop     *sched.Loop
	drv      *pipeline.Driver
	epoch    uint64
	kvTokens int // the pipeline's KV capacity: blocks × block size
	graphs   *graphs.Stats

	drainCh  chan struct{} // closed by drain
	abortCh  chan struct{} // closed by abort
	done     chan struct{} // closed when run has returned
	drainOne sync.Once
	abortOne sync.Once

	mu         sync.Mutex
	err        error // why run returned
	abortCause error
}

// stepExecutor completes every step before the driver sends it: it stamps
// the leader's epoch (stages refuse steps of an older epoch) and the CUDA
// graph the dispatcher picks for the batch, which every stage obeys, and
// counts the dispatch.
type stepExecutor struct {
	*pipeline.Driver
	epoch    uint64
	dispatch *graphs.Dispatcher
	stats    *graphs.Stats
}

func (x stepExecutor) Submit(ctx context.Context, s *pipeline.Step) error {
	s.Epoch = x.epoch
	if b := &s.Batch; len(b.Seqs) > 0 {
		b.Graph = dispatchStep(x.dispatch, b)
		x.stats.Record(b.NumTokens(), b.Graph.Desc.NumTokens, b.Graph.Mode)
	}
	return x.Driver.Submit(ctx, s)
}

// dispatchStep picks the batch's runtime mode and graph descriptor: a
// batch is a uniform decode when every sequence brings the dispatcher's
// query length of tokens.
func dispatchStep(d *graphs.Dispatcher, b *stage.Batch) graphs.Step {
	q, uniform := d.UniformDecodeQueryLen(), true
	for i := range b.Seqs {
		if len(b.Seqs[i].Tokens) != q {
			uniform = false
			break
		}
	}
	m, desc := d.Dispatch(b.NumTokens(), uniform, len(b.Seqs))
	return graphs.Step{Mode: m, Desc: desc}
}

// newEngine starts the scheduler loop over the driver, dispatching CUDA
// graphs with d. run must then be called: it owns the loop and the driver
// until they stop.
func newEngine(drv *pipeline.Driver, epoch uint64, cfg sched.Config, d *graphs.Dispatcher) (*engine, error) {
	stats := &graphs.Stats{}
	loop, err := sched.Start(cfg, stepExecutor{Driver: drv, epoch: epoch, dispatch: d, stats: stats})
	if err != nil {
		return nil, err
	}
	return &engine{
		loop:     loop,
		drv:      drv,
		epoch:    epoch,
		graphs:   stats,
		kvTokens: cfg.NumBlocks * max(cfg.BlockSize, 1),
		drainCh:  make(chan struct{}),
		abortCh:  make(chan struct{}),
		done:     make(chan struct{}),
	}, nil
}

// Submit hands a request to the scheduler and returns its token stream.
// Cancelling ctx cancels the request and frees its KV blocks.
func (e *engine) Submit(ctx context.Context, r sched.Request) (*sched.Stream, error) {
	select {
	case <-e.drainCh:
		return nil, apierr.Unavailablef("the pipeline is draining")
	case <-e.abortCh:
		return nil, apierr.Unavailablef("the pipeline is stopping")
	case <-e.done:
		return nil, e.endedErr()
	default:
	}
	s, err := e.loop.Submit(ctx, r)
	switch {
	case err == nil:
		return s, nil
	case ctx.Err() != nil:
		return nil, ctx.Err()
	case e.loop.Err() != nil:
		return nil, e.endedErr()
	}
	// Validation caught every other refusal: what is left is a request
	// larger than the pipeline's KV capacity.
	return nil, apierr.Exhaustedf("%v", err)
}

func (e *engine) endedErr() error {
	return apierr.Unavailablef("the pipeline stopped: %v", e.stopErr())
}

// stopErr is why run returned (nil while it runs).
func (e *engine) stopErr() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.err
}

// stats is the scheduler's snapshot.
func (e *engine) stats() sched.Stats { return e.loop.Stats() }

// drain stops admitting requests; run returns once the admitted ones are
// done. It reports whether this call started the drain.
func (e *engine) drain() (first bool) {
	e.drainOne.Do(func() {
		close(e.drainCh)
		first = true
	})
	return first
}

// abort makes run stop at once, for the reason cause: the requests left
// fail. It reports whether this call started the abort.
func (e *engine) abort(cause error) (first bool) {
	e.abortOne.Do(func() {
		e.mu.Lock()
		e.abortCause = cause
		e.mu.Unlock()
		close(e.abortCh)
		first = true
	})
	return first
}

// Why run returned: after abort, after drain.
var (
	errAborted = errors.New("stopped by the leader")
	errDrained = errors.New("drained")
)

// run waits until the engine is drained or aborted, or the pipeline fails;
// then it stops the scheduler (its streams end), closes the driver (the
// stages' workers end) and returns why it stopped.
func (e *engine) run() error {
	err := e.wait()
	e.loop.Close()
	if cerr := e.drv.Close(); cerr != nil && errors.Is(err, errDrained) {
		err = fmt.Errorf("close the pipeline: %w", cerr)
	}
	e.mu.Lock()
	e.err = err
	e.mu.Unlock()
	close(e.done)
	return err
}

func (e *engine) wait() error {
	drain := e.drainCh
	var poll <-chan time.Time
	for {
		select {
		case <-e.loop.Done():
			return e.loop.Err()
		case <-e.abortCh:
			e.mu.Lock()
			defer e.mu.Unlock()
			return fmt.Errorf("%w: %w", errAborted, e.abortCause)
		case <-drain:
			drain = nil
			t := time.NewTicker(drainPoll)
			defer t.Stop()
			poll = t.C
		case <-poll:
		}
		if poll != nil {
			if st := e.loop.Stats(); st.Running+st.Waiting+st.InFlight == 0 {
				return errDrained
			}
		}
	}
}
