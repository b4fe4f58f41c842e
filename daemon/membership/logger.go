package membership

import (
	"bytes"
	"context"
	"log"
	"log/slog"
	"net"
	"strings"
	"sync/atomic"
	"time"

	"github.com/tandem-llm/tandem/internal/lograte"
)

// newStdLogger returns a *log.Logger, as memberlist wants, whose lines go
// to l at the level memberlist wrote in their prefix. Once stopping is
// set, lines about memberlist's own closed sockets go to Debug. Warnings
// and errors about what a peer sent are rate-limited (see slogWriter).
func newStdLogger(l *slog.Logger, stopping *atomic.Bool) *log.Logger {
	return log.New(newSlogWriter(l, stopping, nil), "", 0)
}

// slogWriter turns memberlist's log lines ("[WARN] memberlist: text") into
// slog records.
type slogWriter struct {
	l        *slog.Logger
	stopping *atomic.Bool
	peer     *lograte.Limiter // lines about a peer's packets
}

// newSlogWriter returns a writer to l; now is the rate limit's clock (nil:
// time.Now).
func newSlogWriter(l *slog.Logger, stopping *atomic.Bool, now func() time.Time) *slogWriter {
	return &slogWriter{l: l.With("component", "memberlist"), stopping: stopping,
		peer: &lograte.Limiter{Rate: lograte.PeerRate, Burst: lograte.PeerBurst, Now: now}}
}

// Write logs one line; log.Logger calls it once per message. memberlist's
// probe and gossip goroutines can still send for a moment after Shutdown
// has closed the sockets, and log each failure as an error; such a line
// during a clean stop is expected, so it is logged at Debug.
//
// A warning or error that names the peer whose packet or stream caused it
// (memberlist writes "from=ADDR") is what any process reaching the gossip
// port can provoke at will, one line per garbage datagram: such lines pass
// a token bucket (lograte.PeerRate a second, bursts of lograte.PeerBurst), the
// others are dropped, and the next line that passes is preceded by a
// warning counting what was dropped.
func (w *slogWriter) Write(p []byte) (int, error) {
	level, msg := parseLine(p)
	if level > slog.LevelDebug && w.stopping.Load() && strings.Contains(msg, net.ErrClosed.Error()) {
		level = slog.LevelDebug
	}
	if level >= slog.LevelWarn && strings.Contains(msg, "from=") {
		w.peer.Log(w.l, level, msg)
	} else {
		w.l.Log(context.Background(), level, msg)
	}
	return len(p), nil
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
