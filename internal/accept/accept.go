// Package accept serves a listener's handshakes side by side and hands
// back the first connection that completes one. A link's listener waits
// for one particular peer, but whoever reaches its port can connect first:
// served one at a time, a connection that says nothing would hold the
// peer's for the whole handshake timeout, and a stream of them would keep
// it out for good. Here each connection gets its own handshake, at most
// MaxPending at once, and the first that succeeds is the answer. A
// connection beyond MaxPending closes the oldest handshake still running
// rather than being refused itself: a peer's handshake takes a round trip
// or two, so to keep it out a flood would have to outpace that, where
// refusing newcomers would let MaxPending silent connections lock the
// peer out for a whole handshake timeout.
//
// Usage:
//
//	r, err := accept.First(ctx, ln, accept.Config[*Link]{
//		Handshake: l.handshake,                  // returns once ctx is done
//		Discard:   func(r *Link) { r.Close() },  // a second success
//		Refused:   func(c net.Conn, err error) { log(c.RemoteAddr(), err) },
//	})
//
// Concurrency: First owns the goroutines it starts and returns after all
// of them have; calls on one listener must not overlap.
package accept

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"sync"
	"syscall"
	"time"
)

// DefaultMaxPending is Config.MaxPending's default.
const DefaultMaxPending = 16

// ErrTooMany is the reason a handshake is cut short: it was the oldest of
// MaxPending running when another connection came.
var ErrTooMany = errors.New("too many handshakes at once: the oldest is dropped")

// Listener is what First accepts on: a *net.TCPListener, whose deadline
// First sets to stop accepting when it returns, and clears after.
type Listener interface {
	Accept() (net.Conn, error)
	SetDeadline(time.Time) error
}

// Config says how First serves connections.
type Config[T any] struct {
	// Handshake runs one connection's handshake. It must return soon once
	// ctx is done; a result it returns after that is discarded.
	Handshake func(ctx context.Context, c net.Conn) (T, error)
	// Discard releases a handshake's result that is not the answer (one
	// that completed after the first, or after First gave up). nil: none.
	Discard func(T)
	// Refused is told of each connection whose handshake failed, or was
	// dropped as the oldest of MaxPending (err is ErrTooMany), before it
	// is closed; not of those First cut short when it returned. nil:
	// none. It runs on First's goroutine, before First returns.
	Refused func(c net.Conn, err error)
	// MaxPending bounds the handshakes at once (0: DefaultMaxPending).
	MaxPending int
}

// outOfResources reports whether an accept failed for want of a resource
// that comes back (file descriptors, buffers, memory), not for good.
func outOfResources(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) ||
		errors.Is(err, syscall.ENOBUFS) || errors.Is(err, syscall.ENOMEM)
}

// teardown reports whether a handshake's error is what First's giving up
// causes (the connection closed, its deadline passed, the context done),
// rather than the peer's doing.
func teardown(err error) bool {
	return errors.Is(err, net.ErrClosed) || errors.Is(err, os.ErrDeadlineExceeded) ||
		errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)
}

type result[T any] struct {
	c   net.Conn
	v   T
	err error
	cut bool // First gave up while the handshake ran: its failure is First's doing
}

// First accepts connections on ln and runs their handshakes side by side
// until one succeeds, which it returns. It fails when ctx is done (with
// ctx's error) or when ln fails to accept (with that error), except for
// want of file descriptors or buffers: then it waits (5 ms, doubling up
// to 1 s) and accepts again.
func First[T any](ctx context.Context, ln Listener, cfg Config[T]) (T, error) {
	if cfg.MaxPending <= 0 {
		cfg.MaxPending = DefaultMaxPending
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	conns := make(chan net.Conn)
	acceptErr := make(chan error, 1)
	results := make(chan result[T])
	wg.Go(func() {
		delay := time.Duration(0)
		for {
			c, err := ln.Accept()
			if err != nil && ctx.Err() == nil && outOfResources(err) {
				// Out of file descriptors or buffers (a flood can cause
				// it): wait and try again, as net/http's server does.
				delay = min(max(2*delay, 5*time.Millisecond), time.Second)
				select {
				case <-time.After(delay):
					continue
				case <-ctx.Done():
				}
			}
			if err != nil {
				acceptErr <- err
				return
			}
			delay = 0
			select {
			case conns <- c:
			case <-ctx.Done():
				c.Close()
				return
			}
		}
	})
	refuse := func(r result[T]) {
		if cfg.Refused != nil && !r.cut {
			cfg.Refused(r.c, r.err)
		}
		r.c.Close()
	}

	var (
		answer  T
		err     error
		pending []net.Conn            // the handshakes running, oldest first
		dropped = map[net.Conn]bool{} // those closed for a newer one
	)
	// settle gives a dropped connection's result its reason.
	settle := func(r result[T]) result[T] {
		if dropped[r.c] {
			delete(dropped, r.c)
			if r.err == nil && cfg.Discard != nil {
				cfg.Discard(r.v)
			}
			r.err = ErrTooMany
		}
		return r
	}
loop:
	for {
		select {
		case c := <-conns:
			if len(pending) >= cfg.MaxPending {
				dropped[pending[0]] = true
				pending[0].Close()
				pending = pending[1:]
			}
			pending = append(pending, c)
			wg.Go(func() {
				// Closing the connection when First gives up ends a
				// handshake that ignores ctx as well.
				stop := context.AfterFunc(ctx, func() { c.Close() })
				v, err := cfg.Handshake(ctx, c)
				cut := !stop() && (err == nil || teardown(err))
				if cut && err == nil {
					if cfg.Discard != nil {
						cfg.Discard(v)
					}
					err = fmt.Errorf("handshake done after the listener gave up: %w", context.Cause(ctx))
				}
				results <- result[T]{c, v, err, cut}
			})
		case r := <-results:
			if i := slices.Index(pending, r.c); i >= 0 {
				pending = slices.Delete(pending, i, i+1)
			}
			r = settle(r)
			if r.err == nil {
				answer = r.v
				break loop
			}
			refuse(r)
		case err = <-acceptErr:
			break loop
		case <-ctx.Done():
			err = ctx.Err()
			break loop
		}
	}

	// Stop accepting, end the handshakes still running, and wait for all.
	cancel()
	ln.SetDeadline(time.Unix(1, 0))
	waited := make(chan struct{})
	go func() { wg.Wait(); close(waited) }()
	for {
		select {
		case r := <-results:
			if r = settle(r); r.err == nil {
				if cfg.Discard != nil {
					cfg.Discard(r.v)
				}
				r.c.Close()
			} else {
				refuse(r) // one that failed on its own before First gave up
			}
		case <-waited:
			if derr := ln.SetDeadline(time.Time{}); derr != nil && err == nil {
				if cfg.Discard != nil {
					cfg.Discard(answer)
				}
				var zero T
				return zero, fmt.Errorf("clear the listener's deadline: %w", derr)
			}
			if err != nil {
				var zero T
				return zero, err
			}
			return answer, nil
		}
	}
}
