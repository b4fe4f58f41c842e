package daemon

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/tandem-llm/tandem/pipeline"
	"github.com/tandem-llm/tandem/stage"
)

// maxWaiting bounds the requests waiting for room in the pipeline.
const maxWaiting = 4096

// engine is the leader's request loop: the one goroutine that owns the
// pipeline's Driver. Generate calls submit requests through a channel and
// read their tokens from the request's queue. Each step carries the decode
// token of every running request and prefill chunks of newer ones, within
// the batch bounds; waiting requests are admitted between steps while the
// pipeline's KV capacity (reserved for prompt plus max tokens) allows.
// A continuous-batching scheduler can take its place behind the same
// submit/cancel interface.
type engine struct {
	// runCtx bounds run; abort cancels it, interrupting a step in flight.
	runCtx    context.Context
	cancelRun context.CancelFunc
	drv       *pipeline.Driver
	epoch     uint64
	lim       engineLimits

	submitCh chan *request
	wake     chan struct{} // cancellations pending (capacity 1)
	drainCh  chan struct{} // closed by drain: admit nothing new, finish the rest
	abortCh  chan struct{} // closed by abort: fail everything now
	done     chan struct{} // closed when run returns
	drainOne sync.Once
	abortOne sync.Once

	mu        sync.Mutex
	cancelled []*request
	err       error // why run returned

	running, waiting atomic.Int32
	nextID           atomic.Uint64
}

type engineLimits struct {
	maxBatchTokens int
	maxSeqs        int
	kvTokens       int // pipeline KV capacity
}

// request is one Generate call as the engine sees it.
type request struct {
	id         uint64
	prompt     []int32
	maxTokens  int
	stopTokens []int32
	sampling   stage.Sampling
	out        *tokenQueue

	// Engine state.
	tokens   []int32 // prompt then generated
	cached   int     // tokens in the KV cache
	produced int
}

func newEngine(drv *pipeline.Driver, epoch uint64, lim engineLimits) *engine {
	ctx, cancel := context.WithCancel(context.Background())
	return &engine{
		runCtx:    ctx,
		cancelRun: cancel,
		drv:       drv,
		epoch:     epoch,
		lim:       lim,
		submitCh:  make(chan *request),
		wake:      make(chan struct{}, 1),
		drainCh:   make(chan struct{}),
		abortCh:   make(chan struct{}),
		done:      make(chan struct{}),
	}
}

// submit hands a request to the engine; its tokens arrive on r.out.
func (e *engine) submit(ctx context.Context, r *request) error {
	if need := len(r.prompt) + r.maxTokens; need > e.lim.kvTokens {
		return exhaustedf("prompt of %d tokens plus %d to generate exceeds the pipeline's KV capacity of %d tokens", len(r.prompt), r.maxTokens, e.lim.kvTokens)
	}
	r.id = e.nextID.Add(1)
	select {
	case <-e.drainCh:
		return unavailablef("the pipeline is draining")
	case <-e.done:
		return e.endedErr()
	default:
	}
	select {
	case e.submitCh <- r:
		return nil
	case <-e.drainCh:
		return unavailablef("the pipeline is draining")
	case <-e.done:
		return e.endedErr()
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (e *engine) endedErr() error {
	return unavailablef("the pipeline stopped: %v", e.stopErr())
}

// stopErr is why run returned (nil while it runs).
func (e *engine) stopErr() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.err
}

// cancel drops a request: its KV caches are freed on the next step.
func (e *engine) cancel(r *request) {
	e.mu.Lock()
	e.cancelled = append(e.cancelled, r)
	e.mu.Unlock()
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

// drain stops admitting requests; run returns once the admitted ones are
// done. It reports whether this call started the drain.
func (e *engine) drain() (first bool) {
	e.drainOne.Do(func() {
		close(e.drainCh)
		first = true
	})
	return first
}

// abort makes run fail every request and return at once, interrupting the
// step in flight. It reports whether this call started the abort.
func (e *engine) abort() (first bool) {
	e.abortOne.Do(func() {
		close(e.abortCh)
		e.cancelRun()
		first = true
	})
	return first
}

// Why run returned: after abort, after drain.
var (
	errAborted = errors.New("pipeline stopped by the leader")
	errDrained = errors.New("drained")
)

// run serves requests until drained or aborted, or a step fails; then it
// fails the requests left, closes the driver (the stages' workers end) and
// returns why it stopped (nil after a drain).
func (e *engine) run() (err error) {
	ctx := e.runCtx
	defer e.cancelRun()
	var active, waiting []*request
	kvUsed := 0
	defer func() {
		reason := err
		if reason == nil {
			reason = errDrained
		}
		e.mu.Lock()
		e.err = reason
		e.mu.Unlock()
		close(e.done)
		fail := unavailablef("the pipeline stopped: %v", reason)
		for _, r := range slices.Concat(active, waiting) {
			r.out.finish("", fail)
		}
		// Requests submitted after the loop's last receive cannot exist:
		// submit selects on done.
		if cerr := e.drv.Close(); cerr != nil && err == nil {
			err = cerr
		}
		e.running.Store(0)
		e.waiting.Store(0)
	}()
	draining := false
	var free []uint64
	var batchID uint64
	finish := func(r *request, reason string, ferr error) {
		r.out.finish(reason, ferr)
		kvUsed -= len(r.prompt) + r.maxTokens
		free = append(free, r.id)
	}
	accept := func(r *request) {
		if draining {
			r.out.finish("", unavailablef("the pipeline is draining"))
			return
		}
		if len(waiting) >= maxWaiting {
			r.out.finish("", exhaustedf("%d requests are already waiting", maxWaiting))
			return
		}
		waiting = append(waiting, r)
	}
	for {
		if len(active) == 0 && len(waiting) == 0 && len(free) == 0 {
			if draining {
				return nil
			}
			select {
			case r := <-e.submitCh:
				accept(r)
			case <-e.wake:
			case <-e.drainCh:
				draining = true
			case <-e.abortCh:
				return errAborted
			}
		}
	gather:
		for {
			select {
			case r := <-e.submitCh:
				accept(r)
			case <-e.drainCh:
				draining = true
				break gather
			default:
				break gather
			}
		}
		select {
		case <-e.abortCh:
			return errAborted
		default:
		}
		e.mu.Lock()
		cancelled := e.cancelled
		e.cancelled = nil
		e.mu.Unlock()
		for _, c := range cancelled {
			if i := slices.Index(waiting, c); i >= 0 {
				waiting = slices.Delete(waiting, i, i+1)
				c.out.finish("", context.Canceled)
			} else if i := slices.Index(active, c); i >= 0 {
				active = slices.Delete(active, i, i+1)
				finish(c, "", context.Canceled)
			}
		}
		for len(waiting) > 0 && len(active) < e.lim.maxSeqs && kvUsed+len(waiting[0].prompt)+waiting[0].maxTokens <= e.lim.kvTokens {
			r := waiting[0]
			waiting = waiting[1:]
			r.tokens = slices.Clone(r.prompt)
			kvUsed += len(r.prompt) + r.maxTokens
			active = append(active, r)
		}
		e.running.Store(int32(len(active)))
		e.waiting.Store(int32(len(waiting)))

		batchID++
		st := &pipeline.Step{Epoch: e.epoch, Batch: e.batch(batchID, active), Free: free}
		if len(st.Batch.Seqs) == 0 && len(free) == 0 {
			continue
		}
		res, err := e.drv.Step(ctx, st)
		if err != nil {
			if ctx.Err() != nil {
				return errAborted
			}
			return fmt.Errorf("step %d: %w", batchID, err)
		}
		free = nil
		if res == nil {
			continue
		}
		if err := e.deliver(st, res, &active, finish); err != nil {
			return err
		}
	}
}

// batch builds one step: every running request's decode first, so prefills
// never starve them, then prefill chunks within the token budget.
func (e *engine) batch(id uint64, active []*request) stage.Batch {
	b := stage.Batch{ID: id}
	budget := e.lim.maxBatchTokens
	for _, r := range active {
		if budget == 0 {
			break
		}
		if r.cached >= len(r.prompt) {
			b.Seqs = append(b.Seqs, stage.Seq{ID: r.id, Pos: r.cached, Tokens: r.tokens[r.cached:], Sample: true, Sampling: r.sampling, Index: r.produced})
			budget--
		}
	}
	for _, r := range active {
		if budget == 0 {
			break
		}
		if r.cached < len(r.prompt) {
			n := min(len(r.prompt)-r.cached, budget)
			b.Seqs = append(b.Seqs, stage.Seq{ID: r.id, Pos: r.cached, Tokens: r.tokens[r.cached : r.cached+n], Sample: r.cached+n == len(r.prompt), Sampling: r.sampling, Index: r.produced})
			budget -= n
		}
	}
	return b
}

// deliver hands the step's sampled tokens to their requests and retires the
// finished ones.
func (e *engine) deliver(st *pipeline.Step, res *pipeline.Result, active *[]*request, finish func(*request, string, error)) error {
	if res.Batch != st.Batch.ID {
		return fmt.Errorf("last stage reported batch %d for batch %d", res.Batch, st.Batch.ID)
	}
	byID := make(map[uint64]stage.Sampled, len(res.Sampled))
	for _, t := range res.Sampled {
		byID[t.Seq] = t
	}
	byReq := make(map[uint64]*request, len(*active))
	for _, r := range *active {
		byReq[r.id] = r
	}
	for _, bs := range st.Batch.Seqs {
		r := byReq[bs.ID]
		r.cached += len(bs.Tokens)
		if !bs.Sample {
			continue
		}
		t, ok := byID[bs.ID]
		if !ok {
			return fmt.Errorf("batch %d: no token sampled for request %d", st.Batch.ID, bs.ID)
		}
		r.tokens = append(r.tokens, t.Token)
		r.produced++
		reason := ""
		switch {
		case slices.Contains(r.stopTokens, t.Token):
			reason = finishStop
		case r.produced >= r.maxTokens:
			reason = finishLength
		}
		r.out.push(t)
		if reason != "" {
			finish(r, reason, nil)
			*active = slices.DeleteFunc(*active, func(a *request) bool { return a == r })
		}
	}
	return nil
}

// Finish reasons.
const (
	finishStop   = "stop"
	finishLength = "length"
)

// tokenQueue carries one request's tokens from the engine to its Generate
// call. The engine never blocks on it: tokens queue up (at most the
// request's max tokens) until the call takes them.
type tokenQueue struct {
	mu     sync.Mutex
	toks   []stage.Sampled
	ended  bool
	reason string // finishStop or finishLength when the engine finished it
	err    error  // why it ended otherwise
	notify chan struct{}
}

func newTokenQueue() *tokenQueue { return &tokenQueue{notify: make(chan struct{}, 1)} }

func (q *tokenQueue) signal() {
	select {
	case q.notify <- struct{}{}:
	default:
	}
}

func (q *tokenQueue) push(t stage.Sampled) {
	q.mu.Lock()
	q.toks = append(q.toks, t)
	q.mu.Unlock()
	q.signal()
}

// finish ends the queue with a finish reason or an error; later calls are
// ignored.
func (q *tokenQueue) finish(reason string, err error) {
	q.mu.Lock()
	if !q.ended {
		q.ended, q.reason, q.err = true, reason, err
	}
	q.mu.Unlock()
	q.signal()
}

// take waits for tokens or the end. It returns the tokens queued so far
// and, once the queue has ended and every token was taken, ended = true
// with the reason or error.
func (q *tokenQueue) take(ctx context.Context) (toks []stage.Sampled, ended bool, reason string, err error) {
	for {
		q.mu.Lock()
		toks, q.toks = q.toks, nil
		ended, reason, err = q.ended, q.reason, q.err
		q.mu.Unlock()
		if len(toks) > 0 || ended {
			return toks, ended, reason, err
		}
		select {
		case <-q.notify:
		case <-ctx.Done():
			return nil, false, "", ctx.Err()
		}
	}
}
