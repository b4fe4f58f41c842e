package progress

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/vbauerster/cupwriter"
	"github.com/vbauerster/mpb/v8"
	"github.com/vbauerster/mpb/v8/decor"
)

// Mode is how a Reporter shows progress.
type Mode string

const (
	// Auto draws bars when Config.Out is a terminal and logs otherwise.
	Auto Mode = "auto"
	// Bar draws a bar per operation on Config.Out.
	Bar Mode = "bar"
	// Log writes structured lines to Config.Log.
	Log Mode = "log"
)

// ParseMode reads a mode: auto, bar or log.
func ParseMode(s string) (Mode, error) {
	switch m := Mode(s); m {
	case Auto, Bar, Log:
		return m, nil
	}
	return "", fmt.Errorf("progress %q: want auto, bar or log", s)
}

// Unit is what an operation counts.
type Unit int

const (
	// Count counts items (kernels, graphs).
	Count Unit = iota
	// Bytes counts bytes; rates show as MB/s.
	Bytes
)

// DefaultEvery is the least time between two lines of one running
// operation in Log mode.
const DefaultEvery = 5 * time.Second

// Config configures a Reporter.
type Config struct {
	Mode Mode
	// Out is where bars are drawn (os.Stderr for a daemon); nil: os.Stderr.
	Out io.Writer
	// Log receives the lines of Log mode, and a line for each operation
	// that fails in Bar mode; nil: slog.Default() at the time of the line
	// (so a program may set a default that writes through Writer).
	Log *slog.Logger
	// Every is the least time between two lines of a running operation in
	// Log mode (0: DefaultEvery).
	Every time.Duration
}

// Reporter shows operations as they advance. A nil *Reporter shows
// nothing.
type Reporter struct {
	out   io.Writer
	log   *slog.Logger // nil: slog.Default()
	every time.Duration
	bars  bool

	mu        sync.Mutex
	container *mpb.Progress // while bars are shown
	open      int           // operations not ended
}

// New returns a Reporter for cfg; Auto resolves here.
func New(cfg Config) *Reporter {
	r := &Reporter{out: cfg.Out, log: cfg.Log, every: cfg.Every}
	if r.out == nil {
		r.out = os.Stderr
	}
	if r.every <= 0 {
		r.every = DefaultEvery
	}
	switch cfg.Mode {
	case Bar:
		r.bars = true
	case Log:
	default:
		r.bars = isTerminal(r.out)
	}
	return r
}

// logger is where lines go.
func (r *Reporter) logger() *slog.Logger {
	if r.log != nil {
		return r.log
	}
	return slog.Default()
}

// isTerminal reports whether w is a terminal, as the bars library decides
// it.
func isTerminal(w io.Writer) bool { return cupwriter.New(w, false).IsTerminal() }

// Bars reports whether the Reporter draws bars (else it logs).
func (r *Reporter) Bars() bool { return r != nil && r.bars }

// Writer is where other output to Out should go while bars may be drawn
// (the daemon's log handler writes through it): above the bars while some
// are shown, straight to Out otherwise.
func (r *Reporter) Writer() io.Writer { return writer{r} }

type writer struct{ r *Reporter }

func (w writer) Write(b []byte) (int, error) {
	w.r.mu.Lock()
	c := w.r.container
	w.r.mu.Unlock()
	if c != nil {
		if n, err := c.Write(b); err == nil {
			return n, nil
		}
		// The container was shut down meanwhile: write past it.
	}
	return w.r.out.Write(b)
}

// Start begins an operation of total units (0: not known yet) and returns
// it; attrs (slog key-value pairs) go with each of its log lines. Every
// operation must be ended with Task.End.
func (r *Reporter) Start(name string, unit Unit, total int64, attrs ...any) *Task {
	if r == nil {
		return nil
	}
	t := &Task{r: r, name: name, unit: unit, total: total, attrs: attrs, start: time.Now()}
	t.logged = t.start
	if r.bars {
		r.mu.Lock()
		if r.container == nil {
			r.container = mpb.New(mpb.WithOutput(r.out), mpb.WithAutoRefresh(), mpb.WithWidth(100), mpb.WithRefreshRate(100*time.Millisecond))
		}
		r.open++
		t.bar = r.container.AddBar(total, t.decorators()...)
		r.mu.Unlock()
		return t
	}
	r.logger().Info(name, t.line("start", 0, total)...)
	return t
}

func (t *Task) decorators() []mpb.BarOption {
	counters := decor.CountersNoUnit("%d / %d")
	if t.unit == Bytes {
		counters = decor.Counters(decor.SizeB1000(0), "% .1f / % .1f")
	}
	// The rate and the time are the task's own, so that they stay right
	// on a bar that completed before it was ever drawn.
	rate := decor.Any(func(s decor.Statistics) string {
		if s.Aborted {
			return "failed"
		}
		return rateText(t.unit, s.Current, t.elapsed())
	})
	el := decor.Any(func(decor.Statistics) string { return t.elapsed().Round(time.Millisecond).String() })
	return []mpb.BarOption{
		mpb.PrependDecorators(decor.Name(t.name, decor.WCSyncSpaceR), counters),
		mpb.AppendDecorators(rate, decor.Name(" "), el),
	}
}

// elapsed is the time since the task started, or the time it took once
// it ended.
func (t *Task) elapsed() time.Duration {
	if e := t.took.Load(); e != 0 {
		return time.Duration(e)
	}
	return time.Since(t.start)
}

// rateText is done units over el, as MB/s for bytes.
func rateText(u Unit, done int64, el time.Duration) string {
	if el <= 0 {
		return ""
	}
	rate := float64(done) / el.Seconds()
	if u == Bytes {
		return fmt.Sprintf("%.1f MB/s", rate/1e6)
	}
	return fmt.Sprintf("%.1f/s", rate)
}

// Task is one operation of a Reporter. Its methods are safe for
// concurrent use; a nil *Task does nothing.
type Task struct {
	r     *Reporter
	name  string
	unit  Unit
	attrs []any
	start time.Time
	bar   *mpb.Bar
	took  atomic.Int64 // nanoseconds from start to End; 0 until then

	mu     sync.Mutex
	total  int64
	done   int64
	logged time.Time // the last line
	ended  bool
}

// Set records the work done so far (and, with total > 0, a new total).
func (t *Task) Set(done, total int64) {
	if t == nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.ended {
		return
	}
	if total > 0 && total != t.total {
		t.total = total
		if t.bar != nil {
			t.bar.SetTotal(total, false)
		}
	}
	t.done = done
	if t.bar != nil {
		t.bar.SetCurrent(done)
		return
	}
	if now := time.Now(); now.Sub(t.logged) >= t.r.every {
		t.logged = now
		t.r.logger().Info(t.name, t.line("running", done, t.total)...)
	}
}

// End ends the operation: done (its bar completes, a line says how long
// it took and how fast) or, with err, failed.
func (t *Task) End(err error) {
	if t == nil {
		return
	}
	t.mu.Lock()
	if t.ended {
		t.mu.Unlock()
		return
	}
	t.ended = true
	t.took.Store(int64(max(time.Since(t.start), 1)))
	done, total := t.done, t.total
	if err == nil && total > 0 {
		done = total
	}
	t.mu.Unlock()
	switch {
	case err != nil:
		t.r.logger().Warn(t.name, append(t.line("failed", done, total), "err", err)...)
	case t.bar == nil:
		t.r.logger().Info(t.name, t.line("done", done, total)...)
	}
	if t.bar == nil {
		return
	}
	if err != nil {
		t.bar.Abort(false)
	} else {
		t.bar.SetTotal(done, true)
	}
	t.bar.Wait()
	t.r.ended()
}

// ended notes that a bar ended; the last one ends the container.
func (r *Reporter) ended() {
	r.mu.Lock()
	r.open--
	var c *mpb.Progress
	if r.open == 0 {
		c, r.container = r.container, nil
	}
	r.mu.Unlock()
	if c != nil {
		c.Wait()
	}
}

// line is a log line's attributes: the state, the work done and the
// total, the time since the start and the rate, then the task's own.
func (t *Task) line(state string, done, total int64) []any {
	a := []any{"state", state}
	if t.unit == Bytes {
		a = append(a, "bytes", done)
		if total > 0 {
			a = append(a, "total_bytes", total)
		}
	} else {
		a = append(a, "done", done)
		if total > 0 {
			a = append(a, "total", total)
		}
	}
	if state != "start" {
		el := t.elapsed()
		a = append(a, "elapsed", el.Round(time.Millisecond))
		if done > 0 {
			a = append(a, "rate", rateText(t.unit, done, el))
		}
	}
	return append(a, t.attrs...)
}

// Steps starts an operation for each step a component names as it goes
// (stage/cuda's Config.Progress: compiling kernels, capturing graphs), so
// the component needs only a function.
type Steps struct {
	r     *Reporter
	unit  Unit
	attrs []any

	mu   sync.Mutex
	open []*Task
}

// Steps returns a Steps whose operations count unit and carry attrs.
func (r *Reporter) Steps(unit Unit, attrs ...any) *Steps {
	return &Steps{r: r, unit: unit, attrs: attrs}
}

// Step begins the step called name and returns the function the
// component calls with the work done and the total; the step ends when
// done reaches total.
func (s *Steps) Step(name string) func(done, total int) {
	var t *Task
	return func(done, total int) {
		if t == nil {
			t = s.r.Start(name, s.unit, int64(total), s.attrs...)
			s.mu.Lock()
			s.open = append(s.open, t)
			s.mu.Unlock()
		}
		t.Set(int64(done), int64(total))
		if total > 0 && done >= total {
			t.End(nil)
		}
	}
}

// End ends the steps still open, as failed by err (or, with err nil,
// as interrupted): the component returned without finishing them.
func (s *Steps) End(err error) {
	s.mu.Lock()
	open := s.open
	s.open = nil
	s.mu.Unlock()
	if err == nil {
		err = errInterrupted
	}
	for _, t := range open {
		t.End(err)
	}
}

var errInterrupted = errors.New("interrupted")
