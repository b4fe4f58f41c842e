package progress

import (
	"bytes"
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// TestMain fails the package when a test leaves a goroutine behind (the
// bars' container must end with the last bar).
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// jsonLog is a logger writing JSON lines into a buffer, and the lines.
type jsonLog struct{ b bytes.Buffer }

func (j *jsonLog) logger() *slog.Logger { return slog.New(slog.NewJSONHandler(&j.b, nil)) }

func (j *jsonLog) lines(t *testing.T) []map[string]any {
	t.Helper()
	var out []map[string]any
	for l := range strings.Lines(j.b.String()) {
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("log line %q: %v", l, err)
		}
		out = append(out, m)
	}
	return out
}

func TestParseMode(t *testing.T) {
	for _, s := range []string{"auto", "bar", "log"} {
		if m, err := ParseMode(s); err != nil || string(m) != s {
			t.Errorf("ParseMode(%q) = %q, %v", s, m, err)
		}
	}
	if _, err := ParseMode("fancy"); err == nil {
		t.Error("ParseMode(fancy): no error")
	}
}

// TestLogLines: without a terminal (Auto on a buffer) an operation is a
// start line, running lines no closer than Every, and a done line with the
// amounts and the rate; a failed one ends in a warning with the error.
func TestLogLines(t *testing.T) {
	var out bytes.Buffer
	var j jsonLog
	r := New(Config{Mode: Auto, Out: &out, Log: j.logger(), Every: time.Nanosecond})
	if r.Bars() {
		t.Fatal("Auto draws bars on a buffer")
	}
	task := r.Start("load layers [0,3)", Bytes, 3000, "node", "n1")
	task.Set(1000, 0)
	time.Sleep(time.Millisecond) // so the rate has a duration
	task.Set(2000, 0)
	task.End(nil)
	task.End(errors.New("ignored: already ended"))
	bad := r.Start("capture graphs", Count, 4)
	bad.Set(1, 0)
	bad.End(errors.New("out of memory"))

	lines := j.lines(t)
	var states []string
	for _, l := range lines {
		states = append(states, l["msg"].(string)+":"+l["state"].(string))
	}
	want := []string{"load layers [0,3):start", "load layers [0,3):running", "load layers [0,3):running", "load layers [0,3):done",
		"capture graphs:start", "capture graphs:running", "capture graphs:failed"}
	if strings.Join(states, ",") != strings.Join(want, ",") {
		t.Fatalf("lines %v, want %v", states, want)
	}
	done := lines[3]
	if done["bytes"] != 3000.0 || done["total_bytes"] != 3000.0 || done["node"] != "n1" || !strings.HasSuffix(done["rate"].(string), " MB/s") {
		t.Errorf("done line %v: want 3000 of 3000 bytes, node n1, a rate in MB/s", done)
	}
	failed := lines[6]
	if failed["level"] != "WARN" || failed["err"] != "out of memory" || failed["done"] != 1.0 || failed["total"] != 4.0 {
		t.Errorf("failed line %v: want a warning with the error and 1 of 4", failed)
	}
	if out.Len() != 0 {
		t.Errorf("log mode wrote to Out: %q", out.String())
	}
}

// TestLogEvery: running lines are at least Every apart.
func TestLogEvery(t *testing.T) {
	var j jsonLog
	r := New(Config{Mode: Log, Log: j.logger(), Every: time.Hour})
	task := r.Start("load", Bytes, 10)
	for i := range 10 {
		task.Set(int64(i), 0)
	}
	task.End(nil)
	if n := len(j.lines(t)); n != 2 {
		t.Errorf("%d lines, want start and done only:\n%s", n, j.b.String())
	}
}

// TestBars: in Bar mode an operation is drawn as a bar with its amounts
// and rate, other output written through Writer shows up, and nothing is
// logged unless an operation fails.
func TestBars(t *testing.T) {
	var out bytes.Buffer
	var j jsonLog
	r := New(Config{Mode: Bar, Out: &out, Log: j.logger()})
	if !r.Bars() {
		t.Fatal("Bar mode draws no bars")
	}
	task := r.Start("load layers [0,3)", Bytes, 5_500_000)
	task.Set(2_000_000, 0)
	if _, err := r.Writer().Write([]byte("a log line while the bar runs\n")); err != nil {
		t.Fatal(err)
	}
	task.End(nil)
	steps := r.Steps(Count)
	kernels := steps.Step("compile kernels")
	kernels(0, 1)
	kernels(1, 1)
	graphs := steps.Step("capture graphs")
	graphs(0, 8)
	graphs(3, 8)
	steps.End(errors.New("capture failed"))

	s := out.String()
	for _, w := range []string{"load layers [0,3)", "5.5 MB / 5.5 MB", "MB/s", "a log line while the bar runs", "compile kernels", "1 / 1", "capture graphs", "failed"} {
		if !strings.Contains(s, w) {
			t.Errorf("bars lack %q:\n%s", w, s)
		}
	}
	lines := j.lines(t)
	if len(lines) != 1 || lines[0]["msg"] != "capture graphs" || lines[0]["state"] != "failed" {
		t.Errorf("log in Bar mode: %v, want the failed step only", lines)
	}
	// Once every bar ended, Writer writes straight to Out.
	out.Reset()
	r.Writer().Write([]byte("after\n"))
	if out.String() != "after\n" {
		t.Errorf("after the bars, Writer wrote %q", out.String())
	}
}

// TestStepsEnd: a step the component left open is ended by Steps.End, as
// interrupted when the component returned no error.
func TestStepsEnd(t *testing.T) {
	var j jsonLog
	r := New(Config{Mode: Log, Log: j.logger()})
	steps := r.Steps(Count, "stage", "[0,2)")
	steps.Step("compile kernels")(0, 1)
	steps.End(nil)
	lines := j.lines(t)
	if len(lines) != 2 || lines[1]["state"] != "failed" || lines[1]["err"] != "interrupted" || lines[1]["stage"] != "[0,2)" {
		t.Errorf("lines %v: want start, then failed (interrupted) with the steps' attributes", lines)
	}
}

// TestNil: a nil Reporter and Task do nothing.
func TestNil(t *testing.T) {
	var r *Reporter
	task := r.Start("x", Count, 1)
	task.Set(1, 0)
	task.End(nil)
	if r.Bars() {
		t.Error("nil Reporter draws bars")
	}
}
