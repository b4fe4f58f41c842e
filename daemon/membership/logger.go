package membership

import (
	"bytes"
	"context"
	"log"
	"log/slog"
	"net"
	"strings"
	"sync/atomic"
)

// newStdLogger returns a *log.Logger, as memberlist wants, whose lines go
// to l at the level memberlist wrote in their prefix. Once stopping is
// set, lines about memberlist's own closed sockets go to Debug.
func newStdLogger(l *slog.Logger, stopping *atomic.Bool) *log.Logger {
	return log.New(slogWriter{l, stopping}, "", 0)
}

// slogWriter turns memberlist's log lines ("[WARN] memberlist: text") into
// slog records.
type slogWriter struct {
	l        *slog.Logger
	stopping *atomic.Bool
}

// Write logs one line; log.Logger calls it once per message. memberlist's
// probe and gossip goroutines can still send for a moment after Shutdown
// has closed the sockets, and log each failure as an error; such a line
// during a clean stop is expected, so it is logged at Debug.
func (w slogWriter) Write(p []byte) (int, error) {
	level, msg := parseLine(p)
	if level > slog.LevelDebug && w.stopping.Load() && strings.Contains(msg, net.ErrClosed.Error()) {
		level = slog.LevelDebug
	}
	w.l.Log(context.Background(), level, msg, "component", "memberlist")
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
