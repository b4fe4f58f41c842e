// Package lograte bounds how often a kind of log line that anyone can
// provoke at will (a peer's garbage datagram, a refused connection) reaches
// the log, so that a flood of bad input cannot fill the disk or drown the
// lines that matter: a token bucket per kind of line, and a count of what
// it dropped, logged before the next line that passes.
//
// Usage:
//
//	refused := lograte.Limiter{Rate: lograte.PeerRate, Burst: lograte.PeerBurst}
//	...
//	refused.Log(log, slog.LevelWarn, "refused connection", "peer", addr, "err", err)
//
// Concurrency: a Limiter is safe for concurrent use; its fields are set
// before the first use and not changed after.
package lograte

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// What a peer can provoke (a garbage datagram, a refused connection) is
// logged at PeerRate lines a second on average, in bursts of PeerBurst:
// Limiter{Rate: PeerRate, Burst: PeerBurst}.
const (
	PeerRate  = 1
	PeerBurst = 10
)

// Limiter passes lines at Rate a second on average, in bursts of up to
// Burst. The zero Limiter drops nothing.
type Limiter struct {
	Rate  float64          // lines a second, on average (0: no limit)
	Burst int              // lines at once, at least 1
	Now   func() time.Time // the clock (nil: time.Now)

	mu         sync.Mutex
	tokens     float64   // lines that may pass now
	last       time.Time // when tokens was last refilled
	suppressed int       // lines dropped since the last that passed
	since      time.Time // when the first of them was dropped
}

// Admit takes a token for a line. It reports whether the line may pass
// and, if so, how many were dropped before it, since when.
func (l *Limiter) Admit() (pass bool, dropped int, since time.Time) {
	if l.Rate <= 0 {
		return true, 0, time.Time{}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	now := time.Now()
	if l.Now != nil {
		now = l.Now()
	}
	burst := float64(max(l.Burst, 1))
	if l.last.IsZero() {
		l.tokens = burst
	} else {
		l.tokens = min(burst, l.tokens+now.Sub(l.last).Seconds()*l.Rate)
	}
	l.last = now
	if l.tokens < 1 {
		if l.suppressed == 0 {
			l.since = now
		}
		l.suppressed++
		return false, 0, time.Time{}
	}
	l.tokens--
	dropped, since = l.suppressed, l.since
	l.suppressed = 0
	return true, dropped, since
}

// Log logs msg with args at level to log when the limiter admits it,
// after a warning that counts the lines dropped since the last one passed.
func (l *Limiter) Log(log *slog.Logger, level slog.Level, msg string, args ...any) {
	pass, dropped, since := l.Admit()
	if !pass {
		return
	}
	if dropped > 0 {
		log.Warn("log lines suppressed: too many", "like", msg, "suppressed", dropped,
			"since", since.Format(time.RFC3339), "per_second", l.Rate, "burst", max(l.Burst, 1))
	}
	log.Log(context.Background(), level, msg, args...)
}
