package membership

import (
	"bytes"
	"context"
	"log"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// newStdLogger returns a *log.Logger, as memberlist wants, whose lines go
// to l at the level memberlist wrote in their prefix. Once stopping is
// set, lines about memberlist's own closed sockets go to Debug. Warnings
// and errors about what a peer sent are rate-limited (see slogWriter).
func newStdLogger(l *slog.Logger, stopping *atomic.Bool) *log.Logger {
	return log.New(&slogWriter{l: l, stopping: stopping, now: time.Now}, "", 0)
}

// Peer lines (see slogWriter.Write) pass at peerLineRate a second on
// average, in bursts of up to peerLineBurst.
const (
	peerLineRate  = 1
	peerLineBurst = 10
)

// slogWriter turns memberlist's log lines ("[WARN] memberlist: text") into
// slog records.
type slogWriter struct {
	l        *slog.Logger
	stopping *atomic.Bool
	now      func() time.Time

	mu         sync.Mutex
	tokens     float64   // peer lines that may pass now
	last       time.Time // when tokens was last refilled
	suppressed int       // peer lines dropped since the last that passed
	since      time.Time // when the first of them was dropped
}

// Write logs one line; log.Logger calls it once per message. memberlist's
// probe and gossip goroutines can still send for a moment after Shutdown
// has closed the sockets, and log each failure as an error; such a line
// during a clean stop is expected, so it is logged at Debug.
//
// A warning or error that names the peer whose packet or stream caused it
// (memberlist writes "from=ADDR") is what any process reaching the gossip
// port can provoke at will, one line per garbage datagram: such lines pass
// a token bucket (peerLineRate a second, bursts of peerLineBurst), the
// others are dropped, and the next line that passes is preceded by a
// warning counting what was dropped.
func (w *slogWriter) Write(p []byte) (int, error) {
	level, msg := parseLine(p)
	if level > slog.LevelDebug && w.stopping.Load() && strings.Contains(msg, net.ErrClosed.Error()) {
		level = slog.LevelDebug
	}
	if level >= slog.LevelWarn && strings.Contains(msg, "from=") {
		pass, dropped, since := w.admit()
		if !pass {
			return len(p), nil
		}
		if dropped > 0 {
			w.l.Warn("suppressed warnings and errors about peers' packets", "component", "memberlist",
				"suppressed", dropped, "since", since.Format(time.RFC3339), "per_second", peerLineRate, "burst", peerLineBurst)
		}
	}
	w.l.Log(context.Background(), level, msg, "component", "memberlist")
	return len(p), nil
}

// admit takes a token for a peer line. It reports whether the line may
// pass and, if so, how many were dropped before it since when.
func (w *slogWriter) admit() (pass bool, dropped int, since time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	now := w.now()
	if w.last.IsZero() {
		w.tokens = peerLineBurst
	} else {
		w.tokens = min(peerLineBurst, w.tokens+now.Sub(w.last).Seconds()*peerLineRate)
	}
	w.last = now
	if w.tokens < 1 {
		if w.suppressed == 0 {
			w.since = now
		}
		w.suppressed++
		return false, 0, time.Time{}
	}
	w.tokens--
	dropped, since = w.suppressed, w.since
	w.suppressed = 0
	return true, dropped, since
}

// levels maps memberlist's prefixes to slog levels.
var levels = map[string]slog.Level{
	"DEBUG": slog.LevelDebug,
	"INFO":  slog.LevelInfo,
	"WARN":  slog.LevelWarn,
	"ERR":   slog.LevelError,
	"ERROR": slog.LevelError,
}

// parseLine splits a memberlist log line into its level and message. A
// line without a known "[LEVEL] " prefix is logged at Info as it is.
func parseLine(p []byte) (slog.Level, string) {
	p = bytes.TrimRight(p, "\r\n")
	level := slog.LevelInfo
	if rest, ok := bytes.CutPrefix(p, []byte("[")); ok {
		if name, msg, ok := bytes.Cut(rest, []byte("] ")); ok {
			if l, known := levels[string(name)]; known {
				level, p = l, msg
			}
		}
	}
	p, _ = bytes.CutPrefix(p, []byte("memberlist: "))
	return level, string(p)
}
