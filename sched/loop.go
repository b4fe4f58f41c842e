package sched

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tandem-llm/tandem/pipeline"
)

// Executor runs steps through the pipeline; *pipeline.Driver is one.
// Submit and Wait are called from two goroutines: Submit by the loop, Wait
// by a waiter that calls it once for each submitted step that carries
// sequences. Once Wait has returned a step's result, nothing may read the
// step any more: its slices are reused.
type Executor interface {
	// Submit sends a step without waiting for its result.
	Submit(ctx context.Context, s *pipeline.Step) error
	// Wait returns the result of the oldest submitted step that carries
	// sequences. An error means the pipeline is unusable.
	Wait(ctx context.Context) (*pipeline.Result, error)
}

// ErrClosed ends the streams of a Loop that was closed.
var ErrClosed = errors.New("scheduler closed")

// Loop runs a Scheduler against an Executor: it keeps up to
// MaxConcurrentBatches steps in flight, takes requests and cancellations
// between steps, and streams each request's tokens.
type Loop struct {
	cmds      chan command
	onFailure func(Executor, error)
	obs       Observer
	cancel    context.CancelFunc
	done      chan struct{} // closed when the loop goroutine has returned
	wg        sync.WaitGroup
	stats     atomic.Pointer[Stats]
	err       error // why the loop stopped; written before done is closed
}

// command is a request for the loop goroutine: an addition (add set), a
// move to another executor (replace set), failing every request (failAll
// set), or a cancellation.
type command struct {
	add     *Request
	ctx     context.Context
	reply   chan addReply
	cancel  uint64
	replace *replacement
	failAll error
	ack     chan error // answers replace and failAll
}

// replacement is the new pipeline of a Replace.
type replacement struct {
	cfg Config
	ex  Executor
}

type addReply struct {
	s   *Stream
	err error
}

// Start starts a loop over ex with a scheduler configured by cfg. Close
// stops it; the caller still owns ex. It is LoopOptions{}.Start: a failure
// of ex stops the loop.
func Start(cfg Config, ex Executor) (*Loop, error) { return LoopOptions{}.Start(cfg, ex) }

// LoopOptions configure a Loop beyond its scheduler.
type LoopOptions struct {
	// OnFailure, when set, keeps the requests when the executor fails:
	// the loop stops stepping and calls OnFailure with the executor and
	// its error, from the loop's goroutine (it must return at once and
	// must not call the Loop). The requests wait, and new ones queue,
	// until Replace moves them onto a new executor or FailAll ends them.
	// Without OnFailure a failure stops the loop, ending every stream with
	// the error.
	OnFailure func(ex Executor, err error)
	// Observer, when set, sees the steps scheduled and completed and each
	// request's first token (tracing).
	Observer Observer
}

// Observer sees a Loop's work (LoopOptions.Observer). It is called on the
// loop's goroutine and must return at once; it must not keep the step.
type Observer interface {
	// Scheduled: step st, which carries sequences, was planned and
	// submitted between start and end; inFlight steps are in flight.
	Scheduled(st *pipeline.Step, inFlight int, start, end time.Time)
	// Completed: the result of batch came and its tokens were delivered
	// between start and end; inFlight steps are still in flight.
	Completed(batch uint64, tokens, inFlight int, start, end time.Time)
	// FirstToken: request id, submitted to the loop at submitted, had its
	// first token delivered at at.
	FirstToken(id uint64, submitted, at time.Time)
}

// Start starts a loop over ex (nil: none yet, see Replace) with a
// scheduler configured by cfg. Close stops it; the caller still owns ex.
func (o LoopOptions) Start(cfg Config, ex Executor) (*Loop, error) {
	sc, err := New(cfg, nil)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	l := &Loop{cmds: make(chan command), cancel: cancel, done: make(chan struct{}), onFailure: o.OnFailure, obs: o.Observer}
	st := sc.Stats()
	l.stats.Store(&st)
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		defer close(l.done)
		l.err = l.run(ctx, sc, l.attach(ctx, ex, sc.cfg.MaxConcurrentBatches))
	}()
	return l, nil
}

// attachment is the executor the loop steps, with the goroutine that
// waits for its results.
type attachment struct {
	ex      Executor
	waits   chan struct{}
	results chan waited
	stop    context.CancelFunc
	done    chan struct{} // closed when the waiter has returned
}

// attach starts the waiter of ex, which keeps up to mcb steps in flight
// (nil for a nil ex). The loop goroutine calls it, so the WaitGroup is
// never at zero here.
func (l *Loop) attach(ctx context.Context, ex Executor, mcb int) *attachment {
	if ex == nil {
		return nil
	}
	wctx, stop := context.WithCancel(ctx)
	a := &attachment{ex: ex, waits: make(chan struct{}, mcb), results: make(chan waited), stop: stop, done: make(chan struct{})}
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		defer close(a.done)
		wait(wctx, ex, a.waits, a.results)
	}()
	return a
}

// detach stops the waiter and waits for it: the executor is no longer
// used. Steps in flight are abandoned.
func (a *attachment) detach() {
	if a != nil {
		a.stop()
		<-a.done
	}
}

type waited struct {
	r   *pipeline.Result
	err error
}

// wait calls ex.Wait once per token received on waits and hands the
// results over, until ctx ends or Wait fails.
func wait(ctx context.Context, ex Executor, waits <-chan struct{}, results chan<- waited) {
	for {
		select {
		case <-waits:
		case <-ctx.Done():
			return
		}
		r, err := ex.Wait(ctx)
		select {
		case results <- waited{r, err}:
		case <-ctx.Done():
			return
		}
		if err != nil {
			return
		}
	}
}

// live is a request the loop streams to.
type live struct {
	s    *Stream
	ctx  context.Context
	stop func() bool // unregisters the cancellation
	// submitted is when the loop took the request (with an Observer);
	// first is set once its first token is delivered.
	submitted time.Time
	first     bool
}

func (l *Loop) run(ctx context.Context, sc *Scheduler, cur *attachment) (err error) {
	reqs := make(map[uint64]*live)
	defer func() {
		cur.detach()
		for _, r := range reqs {
			r.stop()
			r.s.end(err)
		}
	}()
	// failed handles a failure of the current executor: the loop stops,
	// or, with OnFailure, parks the requests until Replace.
	failed := func(err error) error {
		if l.onFailure == nil {
			return err
		}
		ex := cur.ex
		cur.detach()
		cur = nil
		l.onFailure(ex, err)
		return nil
	}
	var nextID uint64
	for {
		for cur != nil {
			var start time.Time
			if l.obs != nil {
				start = time.Now()
			}
			st, ok := sc.Schedule()
			if !ok {
				break
			}
			if err := cur.ex.Submit(ctx, st); err != nil {
				if err := failed(fmt.Errorf("submit batch %d: %w", st.Batch.ID, err)); err != nil {
					return err
				}
				break
			}
			if len(st.Batch.Seqs) > 0 {
				cur.waits <- struct{}{} // never blocks: at most MaxConcurrentBatches in flight
				if l.obs != nil {
					l.obs.Scheduled(st, sc.InFlight(), start, time.Now())
				}
			}
		}
		st := sc.Stats()
		l.stats.Store(&st)
		var results <-chan waited
		if cur != nil {
			results = cur.results
		}
		select {
		case c := <-l.cmds:
			switch {
			case c.replace != nil:
				if _, err := c.replace.cfg.withDefaults(); err != nil {
					c.ack <- fmt.Errorf("replace: scheduler config: %w", err)
					continue
				}
				cur.detach()
				dropped, _ := sc.Replace(c.replace.cfg)
				for _, id := range dropped {
					r := reqs[id]
					r.stop()
					delete(reqs, id)
					r.s.end(fmt.Errorf("%w: the new pipeline holds %d KV blocks of %d positions, at most %d positions a request", ErrTooLarge, sc.cfg.NumBlocks, sc.cfg.BlockSize, sc.cfg.MaxModelLen))
				}
				cur = l.attach(ctx, c.replace.ex, sc.cfg.MaxConcurrentBatches)
				// Stats shows the replacement once Replace returns.
				st := sc.Stats()
				l.stats.Store(&st)
				c.ack <- nil
				continue
			case c.failAll != nil:
				for id, r := range reqs {
					sc.Fail(id)
					r.stop()
					r.s.end(c.failAll)
				}
				clear(reqs)
				st := sc.Stats()
				l.stats.Store(&st)
				c.ack <- nil
				continue
			}
			if c.add == nil {
				if r := reqs[c.cancel]; r != nil && sc.Cancel(c.cancel) {
					delete(reqs, c.cancel)
					r.s.end(context.Cause(r.ctx))
				}
				continue
			}
			nextID++
			c.add.ID = nextID
			if err := sc.Add(*c.add); err != nil {
				c.reply <- addReply{err: err}
				continue
			}
			id := nextID
			r := &live{s: newStream(id), ctx: c.ctx}
			if l.obs != nil {
				r.submitted = time.Now()
			}
			r.stop = context.AfterFunc(c.ctx, func() {
				select {
				case l.cmds <- command{cancel: id}:
				case <-l.done:
				}
			})
			reqs[id] = r
			c.reply <- addReply{s: r.s}
		case w := <-results:
			if w.err != nil {
				if err := failed(fmt.Errorf("wait for a result: %w", w.err)); err != nil {
					return err
				}
				continue
			}
			var start time.Time
			if l.obs != nil {
				start = time.Now()
			}
			outs, err := sc.Complete(w.r)
			if err != nil {
				return err
			}
			// Stats shows the step's results before any stream they end
			// does.
			st := sc.Stats()
			l.stats.Store(&st)
			for _, o := range outs {
				r := reqs[o.ID]
				if o.Err != nil {
					r.stop()
					delete(reqs, o.ID)
					r.s.end(o.Err)
					continue
				}
				r.s.push(o)
				if !r.first && l.obs != nil {
					l.obs.FirstToken(o.ID, r.submitted, time.Now())
				}
				r.first = true
				if o.Finish != "" {
					r.stop()
					delete(reqs, o.ID)
					r.s.end(io.EOF)
				}
			}
			if l.obs != nil {
				l.obs.Completed(w.r.Batch, len(outs), sc.InFlight(), start, time.Now())
			}
		case <-ctx.Done():
			return ErrClosed
		}
	}
}

// Submit queues a request and returns the stream of its tokens. The loop
// assigns r.ID (Stream.ID tells it). Cancelling ctx cancels the request:
// its stream then ends with ctx's cause. Submit fails for a request the
// scheduler refuses (see Scheduler.Add; ErrQueueFull when too many wait)
// and once the loop has stopped.
func (l *Loop) Submit(ctx context.Context, r Request) (*Stream, error) {
	reply := make(chan addReply, 1)
	select {
	case l.cmds <- command{add: &r, ctx: ctx, reply: reply}:
	case <-l.done:
		return nil, fmt.Errorf("submit: %w", l.err)
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	}
	rep := <-reply
	if rep.err != nil {
		return nil, fmt.Errorf("submit: %w", rep.err)
	}
	return rep.s, nil
}

// ErrTooLarge is wrapped by the refusal of a request too large to ever run
// on the scheduler's pipeline (Submit, Scheduler.Add: its prompt plus
// MaxTokens exceed MaxModelLen or the whole KV cache), and ends the stream
// of a request that a new pipeline (Replace) cannot hold.
var ErrTooLarge = errors.New("request too large for the pipeline")

// Replace moves the loop's requests onto a new pipeline, ex, configured by
// cfg (see Scheduler.Replace): between two steps, the steps in flight are
// abandoned, the running requests go back to waiting to prefill what they
// have again, and the loop steps ex from then on; a nil ex parks the
// requests (they wait, new ones queue) until the next Replace. Streams stay
// open and continue with the next token; a request the new pipeline cannot
// hold ends with ErrTooLarge. It returns once the old executor is no
// longer used, so the caller may close it; an invalid cfg changes
// nothing.
func (l *Loop) Replace(cfg Config, ex Executor) error {
	return l.command(command{replace: &replacement{cfg: cfg, ex: ex}})
}

// FailAll ends every request now, waiting or running, with err (the
// streams return it once their tokens are read); Stats counts them as
// failed. The loop goes on.
func (l *Loop) FailAll(err error) error {
	if err == nil {
		return errors.New("fail all: no reason given")
	}
	return l.command(command{failAll: err})
}

func (l *Loop) command(c command) error {
	c.ack = make(chan error, 1)
	select {
	case l.cmds <- c:
	case <-l.done:
		return fmt.Errorf("scheduler loop stopped: %w", l.err)
	}
	return <-c.ack
}

// Stats is a snapshot of the scheduler, taken between steps; a request
// whose stream has ended is counted as ended.
func (l *Loop) Stats() Stats { return *l.stats.Load() }

// Done is closed when the loop has stopped, after Close or a pipeline
// failure; Err then says why.
func (l *Loop) Done() <-chan struct{} { return l.done }

// Err is why the loop stopped: ErrClosed after Close, or the pipeline's
// failure. It is nil while the loop runs.
func (l *Loop) Err() error {
	select {
	case <-l.done:
		return l.err
	default:
		return nil
	}
}

// Close stops the loop and its goroutines. Streams not ended end with
// ErrClosed. Steps in flight are abandoned: the executor is then out of
// step and should be closed too.
func (l *Loop) Close() error {
	l.cancel()
	l.wg.Wait()
	return nil
}

// Stream is one request's tokens. Recv may be called from any goroutine;
// the loop never waits for a slow reader.
type Stream struct {
	id    uint64
	ready chan struct{} // holds a token while outputs or the end are unread

	mu   sync.Mutex
	outs []Output
	err  error // io.EOF after the final token, or why the request ended early
}

func newStream(id uint64) *Stream { return &Stream{id: id, ready: make(chan struct{}, 1)} }

// ID is the request's id.
func (s *Stream) ID() uint64 { return s.id }

// Recv returns the next token. After the token with a finish reason it
// returns io.EOF; a request cancelled, cut short by the loop stopping or
// failed on a stage returns its cause (context.Canceled, ErrClosed, a
// pipeline error, an error wrapping ErrRequestFailed) once the tokens
// delivered before are read.
func (s *Stream) Recv(ctx context.Context) (Output, error) {
	for {
		s.mu.Lock()
		if len(s.outs) > 0 {
			o := s.outs[0]
			s.outs = s.outs[1:]
			s.mu.Unlock()
			return o, nil
		}
		err := s.err
		s.mu.Unlock()
		if err != nil {
			return Output{}, err
		}
		select {
		case <-s.ready:
		case <-ctx.Done():
			return Output{}, context.Cause(ctx)
		}
	}
}

func (s *Stream) push(o Output) {
	s.mu.Lock()
	s.outs = append(s.outs, o)
	s.mu.Unlock()
	s.signal()
}

func (s *Stream) end(err error) {
	s.mu.Lock()
	s.err = err
	s.mu.Unlock()
	s.signal()
}

func (s *Stream) signal() {
	select {
	case s.ready <- struct{}{}:
	default:
	}
}
