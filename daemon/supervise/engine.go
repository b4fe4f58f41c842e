package supervise

import (
	"context"
	"errors"
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

// Engine is the leader's request path: one scheduler loop (continuous
// batching over the stages' paged KV caches) whose requests outlive the
// pipelines it runs them on. Switching to a new pipeline re-prefills every
// running request on it; while none serves, the requests wait. Generate
// calls Submit and reads the streams.
type Engine struct {
	// failed is told when the pipeline the loop runs on fails; it must
	// not block.
	failed func(p *Pipeline, err error)
	// observer sees the scheduler loop's work (nil: nothing does).
	observer sched.Observer

	// ops serializes what moves the loop between pipelines (switchTo,
	// detach); it is held while the loop is called, mu never is: the
	// loop's failure callback takes mu.
	ops       sync.Mutex
	mu        sync.Mutex
	loop      *sched.Loop // nil until the first pipeline
	cur       *Pipeline   // the pipeline the loop runs on (nil: parked)
	accepting bool        // new requests queue
	refusal   string      // why new requests are refused
	retiring  string      // set once the engine retires: why its requests fail if its pipeline does
	bg        sync.WaitGroup
}

func newEngine(failed func(*Pipeline, error)) *Engine {
	return &Engine{failed: failed, refusal: "no pipeline is ready"}
}

// Submit hands a request to the scheduler and returns its token stream.
// Cancelling ctx cancels the request and frees its KV blocks. A request
// is refused at once (UNAVAILABLE) while no pipeline serves and none is
// being rebuilt within the recovery deadline, when too many wait already
// (RESOURCE_EXHAUSTED of kind apierr.Overloaded, HTTP 429), and when it
// can never fit the pipeline (RESOURCE_EXHAUSTED, HTTP 400); otherwise it
// queues, and during an outage waits for the new pipeline.
func (e *Engine) Submit(ctx context.Context, r sched.Request) (*sched.Stream, error) {
	e.mu.Lock()
	loop, ok, refusal := e.loop, e.accepting && e.retiring == "", e.refusal
	if e.retiring != "" {
		refusal = e.retiring
	}
	e.mu.Unlock()
	if !ok || loop == nil {
		return nil, apierr.Unavailablef("%s", refusal)
	}
	s, err := loop.Submit(ctx, r)
	switch {
	case err == nil:
		return s, nil
	case ctx.Err() != nil:
		return nil, ctx.Err()
	case loop.Err() != nil:
		return nil, apierr.Unavailablef("the scheduler stopped: %v", loop.Err())
	case errors.Is(err, sched.ErrTooLarge):
		return nil, apierr.Exhaustedf("%v", err)
	case errors.Is(err, sched.ErrQueueFull):
		return nil, apierr.Overloadedf("%v: retry later", err)
	}
	return nil, err
}

// Stats is the scheduler's snapshot (zero before the first pipeline).
func (e *Engine) Stats() sched.Stats {
	e.mu.Lock()
	loop := e.loop
	e.mu.Unlock()
	if loop == nil {
		return sched.Stats{}
	}
	return loop.Stats()
}

// admit sets whether new requests queue, and why they are refused when
// they do not.
func (e *Engine) admit(accepting bool, refusal string) {
	e.mu.Lock()
	e.accepting = accepting
	if refusal != "" {
		e.refusal = "no pipeline is ready: " + refusal
	}
	e.mu.Unlock()
}

// switchTo moves the requests onto p (re-prefilling the running ones):
// from then on the loop steps p's driver.
func (e *Engine) switchTo(p *Pipeline) error {
	e.ops.Lock()
	defer e.ops.Unlock()
	e.mu.Lock()
	e.retiring = "" // leading a pipeline again
	loop, prev := e.loop, e.cur
	// A failure of the old pipeline reported meanwhile is not p's.
	e.cur = p
	e.mu.Unlock()
	if loop == nil {
		l, err := sched.LoopOptions{OnFailure: e.onFailure, Observer: e.observer}.Start(p.Sched, p.ex)
		e.mu.Lock()
		defer e.mu.Unlock()
		if err != nil {
			e.cur = nil
			return err
		}
		e.loop = l
		return nil
	}
	if err := loop.Replace(p.Sched, p.ex); err != nil {
		// Nothing changed: the loop still steps the old pipeline.
		e.mu.Lock()
		e.cur = prev
		e.mu.Unlock()
		return err
	}
	return nil
}

// detach parks the requests if they run on p: the loop no longer uses it
// once detach returns, so it may be closed.
func (e *Engine) detach(p *Pipeline) {
	e.ops.Lock()
	defer e.ops.Unlock()
	e.mu.Lock()
	loop, cur := e.loop, e.cur
	if cur == p {
		e.cur = nil
	}
	e.mu.Unlock()
	if cur == p && loop != nil {
		loop.Replace(p.Sched, nil)
	}
}

// failAll ends every request with err.
func (e *Engine) failAll(err error) {
	e.mu.Lock()
	loop := e.loop
	e.mu.Unlock()
	if loop != nil {
		loop.FailAll(err)
	}
}

// onFailure is the loop's OnFailure: it runs on the loop goroutine, so it
// only hands the failure on.
func (e *Engine) onFailure(ex sched.Executor, err error) {
	e.mu.Lock()
	p, retiring := e.cur, e.retiring
	if p == nil || sched.Executor(p.ex) != ex {
		e.mu.Unlock()
		return
	}
	e.cur = nil
	e.mu.Unlock()
	if retiring != "" {
		// A retiring engine has no pipeline to wait for.
		e.bg.Go(func() { e.failAll(apierr.Unavailablef("%s (and its pipeline failed: %v)", retiring, err)) })
	}
	e.failed(p, err)
}

// retire stops admitting requests (they are refused with why) and lets
// the ones accepted finish, for at most timeout; then it fails what is
// left with why and stops the scheduler. It returns once the scheduler
// has stopped (or a pipeline was switched to meanwhile: the node leads
// again); the caller then closes the pipeline.
func (e *Engine) retire(why string, timeout time.Duration) {
	e.mu.Lock()
	e.retiring = why
	loop, parked := e.loop, e.cur == nil
	e.mu.Unlock()
	if loop == nil {
		return
	}
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	poll := time.NewTicker(drainPoll)
	defer poll.Stop()
	for !parked {
		if st := loop.Stats(); st.Running+st.Waiting+st.InFlight == 0 {
			break
		}
		select {
		case <-deadline.C:
			loop.FailAll(apierr.Unavailablef("%s: the requests took longer than %v", why, timeout))
			parked = true
		case <-poll.C:
		}
		e.mu.Lock()
		parked = parked || e.cur == nil
		e.mu.Unlock()
	}
	e.mu.Lock()
	revived := e.retiring != why
	if !revived {
		e.loop, e.cur = nil, nil
	}
	e.mu.Unlock()
	if revived {
		return
	}
	// Parked with no pipeline to come: what is left cannot finish.
	loop.FailAll(apierr.Unavailablef("%s", why))
	loop.Close()
	e.bg.Wait()
}

// stepExecutor completes every step before the driver sends it: it stamps
// the leader's epoch (stages refuse steps of an older epoch) and the CUDA
// graph the dispatcher picks for the batch, which every stage obeys, and
// counts the dispatch.
type stepExecutor struct {
	*pipeline.Driver
	epoch    uint64
	dispatch *graphs.Dispatcher
	stats    *graphs.Stats // this pipeline's
	total    *graphs.Stats // every pipeline's (nil: none)
}

func (x *stepExecutor) Submit(ctx context.Context, s *pipeline.Step) error {
	s.Epoch = x.epoch
	if b := &s.Batch; len(b.Seqs) > 0 {
		b.Graph = dispatchStep(x.dispatch, b)
		x.stats.Record(b.NumTokens(), b.Graph.Desc.NumTokens, b.Graph.Mode)
		if x.total != nil {
			x.total.Record(b.NumTokens(), b.Graph.Desc.NumTokens, b.Graph.Mode)
		}
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
