package stagetest

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/stage"
)

// Timed is a stage whose steps take a fixed time on an emulated device,
// for measuring what a pipeline adds to a known step time on the CPU. It
// wraps a real stage (a CPU stage of a small model), which computes each
// batch's tokens when the batch is launched; the batch is done Step after
// the emulated device finished the batch before it, or after its launch if
// the device was idle by then. So a host that keeps the next batch
// launched behind the running one sees one batch per Step, and one that
// waits for each batch before it launches the next sees Step plus its own
// time between the two.
//
// Timed implements stage.Launcher and stage.LinkedLauncher, as a CUDA
// stage does: Forward is Launch then Finish, and a pipeline's only stage,
// or every stage of one whose links are stream-ordered
// (pipeline.LocalOptions.StreamOrdered), keeps batches launched on it.
// Synchronous hides Launch, for the comparison with a stage that cannot
// launch ahead. It implements stage.HandoffReceiver when the wrapped stage
// does. Stats says how the emulated device was used.
type Timed struct {
	inner stage.Stage
	step  time.Duration

	free   time.Time // when the emulated device finishes what is launched
	queue  []*timedBatch
	logits bool // a launched batch asks for logits

	mu    sync.Mutex
	stats TimedStats
}

// TimedStats say how a Timed stage's emulated device was used.
type TimedStats struct {
	// Steps is how many batches it ran, Ahead how many of them were
	// launched while another was.
	Steps, Ahead int
	// Idle is how long it waited with nothing launched, between its first
	// batch and its last.
	Idle time.Duration
	// Late is how much later than their times the batches were seen done,
	// in all: the emulation's own wake-up latency (a GPU's spinning
	// synchronisation sees its work done within microseconds), which a
	// host waiting for each batch before it launches the next pays as
	// idle time.
	Late time.Duration
}

// timedBatch is a launched batch: a copy of its output, and when it is done.
type timedBatch struct {
	out  stage.Output
	done chan struct{}
}

// NewTimed wraps inner into a stage whose steps take step on an emulated
// device. Closing it closes inner.
func NewTimed(inner stage.Stage, step time.Duration) *Timed {
	return &Timed{inner: inner, step: step}
}

// timedSpin is how long before a batch is done the emulated device stops
// sleeping and spins, as a CUDA stream synchronisation does, so that a
// batch is seen done within microseconds of its time.
const timedSpin = 200 * time.Microsecond

// Info implements stage.Stage.
func (t *Timed) Info() stage.Info { return t.inner.Info() }

// Input implements stage.Stage.
func (t *Timed) Input() collective.Buffer { return t.inner.Input() }

// Free implements stage.Stage.
func (t *Timed) Free(seq uint64) { t.inner.Free(seq) }

// Close implements stage.Stage.
func (t *Timed) Close() error { return t.inner.Close() }

// Reset forgets every sequence and hand-off slot of the wrapped stage,
// which must have a Reset; nothing may be launched.
func (t *Timed) Reset() error {
	r, ok := t.inner.(resetter)
	switch {
	case !ok:
		return fmt.Errorf("timed stage: %T has no Reset", t.inner)
	case len(t.queue) > 0:
		return fmt.Errorf("timed stage: reset while %d batches are launched", len(t.queue))
	}
	return r.Reset()
}

// HandoffInput implements stage.HandoffReceiver (nil when the wrapped stage
// takes no hand-offs).
func (t *Timed) HandoffInput() collective.Buffer {
	if r, ok := t.inner.(stage.HandoffReceiver); ok {
		return r.HandoffInput()
	}
	return nil
}

// ApplyHandoff implements stage.HandoffReceiver.
func (t *Timed) ApplyHandoff(ctx context.Context, rows int) error {
	r, ok := t.inner.(stage.HandoffReceiver)
	if !ok {
		return fmt.Errorf("timed stage: %T takes no hand-offs", t.inner)
	}
	return r.ApplyHandoff(ctx, rows)
}

// QueueHandoff implements stage.LinkedLauncher: ApplyHandoff, at once (the
// rows are in host memory when it is called).
func (t *Timed) QueueHandoff(ctx context.Context, rows int) error { return t.ApplyHandoff(ctx, rows) }

// LaunchedOutput implements stage.LinkedLauncher: the whole Output of the
// batch launched last, which the wrapped stage computed at its launch.
func (t *Timed) LaunchedOutput() *stage.Output {
	if len(t.queue) == 0 {
		return nil
	}
	return &t.queue[len(t.queue)-1].out
}

// Forward implements stage.Stage: Launch, then Finish.
func (t *Timed) Forward(ctx context.Context, b *stage.Batch) (*stage.Output, error) {
	if len(t.queue) > 0 {
		return nil, errors.New("timed stage: forward while batches are launched")
	}
	if _, err := t.launch(ctx, b, false); err != nil {
		return nil, err
	}
	return t.Finish(ctx)
}

// Launch implements stage.Launcher.
func (t *Timed) Launch(ctx context.Context, b *stage.Batch) (<-chan struct{}, error) {
	return t.launch(ctx, b, true)
}

// launch computes b with the wrapped stage and schedules its completion on
// the emulated device; applyOwn applies a single stage's own hand-off rows
// (stage.Launcher).
func (t *Timed) launch(ctx context.Context, b *stage.Batch, applyOwn bool) (<-chan struct{}, error) {
	logits := false
	for i := range b.Seqs {
		logits = logits || b.Seqs[i].Logits
	}
	switch {
	case len(t.queue) >= stage.LaunchDepth:
		return nil, fmt.Errorf("timed stage: batch %d: %d batches launched already", b.ID, len(t.queue))
	case len(t.queue) > 0 && (logits || t.logits):
		return nil, fmt.Errorf("timed stage: batch %d: a batch asking for logits runs alone", b.ID)
	}
	out, err := t.inner.Forward(ctx, b)
	if err != nil {
		return nil, err
	}
	tb := &timedBatch{out: copyOutput(out), done: make(chan struct{})}
	info := t.inner.Info()
	if applyOwn && b.Handoff && info.First && info.Last {
		if err := t.applyOwn(ctx, out); err != nil {
			return nil, err
		}
	}
	now := time.Now()
	t.mu.Lock()
	if !t.free.IsZero() && now.After(t.free) {
		t.stats.Idle += now.Sub(t.free)
	}
	t.stats.Steps++
	if len(t.queue) > 0 {
		t.stats.Ahead++
	}
	t.mu.Unlock()
	at := later(now, t.free).Add(t.step)
	t.free = at
	t.queue = append(t.queue, tb)
	t.logits = t.logits || logits
	go func() {
		waitUntil(at)
		late := time.Since(at)
		t.mu.Lock()
		t.stats.Late += late
		t.mu.Unlock()
		close(tb.done)
	}()
	return tb.done, nil
}

// Finish implements stage.Launcher.
func (t *Timed) Finish(ctx context.Context) (*stage.Output, error) {
	if len(t.queue) == 0 {
		return nil, errors.New("timed stage: finish with no batch launched")
	}
	tb := t.queue[0]
	select {
	case <-tb.done:
	case <-ctx.Done():
		return nil, fmt.Errorf("timed stage: %w", context.Cause(ctx))
	}
	t.queue = t.queue[1:]
	if len(t.queue) == 0 {
		t.logits = false
	}
	return &tb.out, nil
}

// applyOwn records a single stage's hand-off rows of out, as a device
// would after the batch.
func (t *Timed) applyOwn(ctx context.Context, out *stage.Output) error {
	r, ok := t.inner.(stage.HandoffReceiver)
	if !ok {
		return fmt.Errorf("timed stage: hand-off asked for, but %T takes none", t.inner)
	}
	h := out.HandoffHeader
	src, srcOK := out.Handoff.(collective.Host)
	dst, dstOK := r.HandoffInput().(collective.Host)
	if !srcOK || !dstOK || len(src) < h.Bytes() || len(dst) < h.Bytes() {
		return fmt.Errorf("timed stage: hand-off %v between %T and %T: want host buffers", h, out.Handoff, r.HandoffInput())
	}
	copy(dst, src[:h.Bytes()])
	return r.ApplyHandoff(ctx, h.Rows)
}

// Stats says how the emulated device was used so far. It may be called
// from any goroutine.
func (t *Timed) Stats() TimedStats {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.stats
}

// Synchronous is t without Launch: a stage that a pipeline runs one
// Forward at a time.
func (t *Timed) Synchronous() stage.Stage { return timedSync{t} }

// timedSync hides Timed's Launch and Finish.
type timedSync struct{ t *Timed }

func (s timedSync) Info() stage.Info                { return s.t.Info() }
func (s timedSync) Input() collective.Buffer        { return s.t.Input() }
func (s timedSync) Free(seq uint64)                 { s.t.Free(seq) }
func (s timedSync) Close() error                    { return s.t.Close() }
func (s timedSync) HandoffInput() collective.Buffer { return s.t.HandoffInput() }
func (s timedSync) ApplyHandoff(ctx context.Context, rows int) error {
	return s.t.ApplyHandoff(ctx, rows)
}
func (s timedSync) Forward(ctx context.Context, b *stage.Batch) (*stage.Output, error) {
	return s.t.Forward(ctx, b)
}

// later is the later of two times.
func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// waitUntil sleeps until shortly before at, then spins until it.
func waitUntil(at time.Time) {
	if d := time.Until(at) - timedSpin; d > 0 {
		time.Sleep(d)
	}
	for time.Now().Before(at) {
	}
}

// copyOutput copies what out points at: the wrapped stage reuses its
// buffers on its next Forward, before a launched batch is finished.
func copyOutput(out *stage.Output) stage.Output {
	c := *out
	c.Sampled = make([]stage.Sampled, len(out.Sampled))
	for i, s := range out.Sampled {
		s.Top = append([]stage.TokenLogprob(nil), s.Top...)
		c.Sampled[i] = s
	}
	c.Logits = make([]stage.SeqLogits, len(out.Logits))
	for i, sl := range out.Logits {
		rows := make([][]float32, len(sl.Rows))
		for j, row := range sl.Rows {
			rows[j] = append([]float32(nil), row...)
		}
		c.Logits[i] = stage.SeqLogits{Seq: sl.Seq, Rows: rows}
	}
	if h, ok := out.Activations.(collective.Host); ok {
		c.Activations = append(collective.Host(nil), h...)
	}
	if h, ok := out.Handoff.(collective.Host); ok {
		c.Handoff = append(collective.Host(nil), h...)
	}
	return c
}
