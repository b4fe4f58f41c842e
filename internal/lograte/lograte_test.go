package lograte

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
	"time"
)

// TestLimiter drives the bucket on a fake clock: a burst passes at once,
// the rest of an instant is dropped, tokens come back at Rate a second,
// and the first line to pass after drops is preceded by their count.
func TestLimiter(t *testing.T) {
	now := time.Unix(1000, 0)
	l := &Limiter{Rate: 2, Burst: 3, Now: func() time.Time { return now }}
	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(&buf, nil))
	for i := range 10 {
		l.Log(log, slog.LevelWarn, "refused", "i", i)
	}
	if n := strings.Count(buf.String(), `msg=refused`); n != 3 {
		t.Fatalf("%d of 10 lines in one instant passed, want the burst of 3:\n%s", n, buf.String())
	}
	buf.Reset()
	now = now.Add(time.Second) // 2 tokens back
	for i := range 5 {
		l.Log(log, slog.LevelWarn, "refused", "i", i)
	}
	out := buf.String()
	if n := strings.Count(out, `msg=refused`); n != 2 {
		t.Errorf("%d lines passed a second later at 2 a second, want 2:\n%s", n, out)
	}
	if !strings.Contains(out, "suppressed=7") || !strings.Contains(out, "like=refused") || !strings.Contains(out, "since=1970-01-01T00:16:40Z") {
		t.Errorf("no count of the 7 lines dropped before, since when, like what:\n%s", out)
	}
	if strings.Count(out, "suppressed=") != 1 {
		t.Errorf("the count is logged once, before the first line that passes:\n%s", out)
	}
	buf.Reset()
	now = now.Add(time.Hour) // full again, never above the burst
	for range 4 {
		l.Log(log, slog.LevelWarn, "refused")
	}
	if n := strings.Count(buf.String(), `msg=refused`); n != 3 {
		t.Errorf("%d lines passed after an hour's rest, want the burst of 3", n)
	}
}

// TestZeroLimiterPassesAll: without a rate, nothing is dropped.
func TestZeroLimiterPassesAll(t *testing.T) {
	var l Limiter
	for i := range 1000 {
		if pass, _, _ := l.Admit(); !pass {
			t.Fatalf("line %d dropped by the zero Limiter", i)
		}
	}
}
