package sched

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"

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
	cmds   chan command
	cancel context.CancelFunc
	done   chan struct{} // closed when the loop goroutine has returned
	wg     sync.WaitGroup
	stats  atomic.Pointer[Stats]
	err    error // why the loop stopped; written before done is closed
}

// command is a request for the loop goroutine: an addition (add set) or a
// cancellation.
type command struct {
	add    *Request
	ctx    context.Context
	reply  chan addReply
	cancel uint64
}

type addReply struct {
	s   *Stream
	err error
}

// Start starts a loop over ex with a scheduler configured by cfg. Close
// stops it; the caller still owns ex.
func Start(cfg Config, ex Executor) (*Loop, error) {
	sc, err := New(cfg, nil)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	l := &Loop{cmds: make(chan command), cancel: cancel, done: make(chan struct{})}
	st := sc.Stats()
	l.stats.Store(&st)
	results := make(chan waited)
	waits := make(chan struct{}, sc.cfg.MaxConcurrentBatches)
	l.wg.Add(2)
	go func() {
		defer l.wg.Done()
		wait(ctx, ex, waits, results)
	}()
	go func() {
		defer l.wg.Done()
		defer close(l.done)
		l.err = l.run(ctx, sc, ex, waits, results)
	}()
	return l, nil
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
}

func (l *Loop) run(ctx context.Context, sc *Scheduler, ex Executor, waits chan<- struct{}, results <-chan waited) (err error) {
	reqs := make(map[uint64]*live)
	defer func() {
		for _, r := range reqs {
			r.stop()
			r.s.end(err)
		}
	}()
	var nextID uint64
	for {
		for {
			st, ok := sc.Schedule()
			if !ok {
				break
			}
			if err := ex.Submit(ctx, st); err != nil {
				return fmt.Errorf("submit batch %d: %w", st.Batch.ID, err)
			}
			if len(st.Batch.Seqs) > 0 {
				waits <- struct{}{} // never blocks: at most MaxConcurrentBatches in flight
			}
		}
		st := sc.Stats()
		l.stats.Store(&st)
		select {
		case c := <-l.cmds:
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
				return fmt.Errorf("wait for a result: %w", w.err)
			}
			outs, err := sc.Complete(w.r)
			if err != nil {
				return err
			}
			for _, o := range outs {
				r := reqs[o.ID]
				r.s.push(o)
				if o.Finish != "" {
					r.stop()
					delete(reqs, o.ID)
					r.s.end(io.EOF)
				}
			}
		case <-ctx.Done():
			return ErrClosed
		}
	}
}

// Submit queues a request and returns the stream of its tokens. The loop
// assigns r.ID (Stream.ID tells it). Cancelling ctx cancels the request:
// its stream then ends with ctx's cause. Submit fails for a request the
// scheduler refuses (see Scheduler.Add) and once the loop has stopped.
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

// Stats is a snapshot of the scheduler, taken between steps.
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
// returns io.EOF; a request cancelled, or cut short by the loop stopping,
// returns its cause (context.Canceled, ErrClosed, a pipeline error) once
// the tokens delivered before are read.
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
