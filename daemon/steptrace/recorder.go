package steptrace

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tandem-llm/tandem/pipeline"
)

// StatsPeriod is how often, outside a recording, a step asks the stages
// for their timing, which carries their busy times: the busy figures lag
// the stages by at most this (and a step) while steps run.
const StatsPeriod = 10 * time.Millisecond

// MaxSteps is the most steps one recording may ask for.
const MaxSteps = 100_000

// reportGrace is how long a recording whose steps are all complete waits
// for stages' timing reports still missing.
const reportGrace = time.Second

// ErrBusy is returned by Record while another recording is under way.
var ErrBusy = errors.New("a trace is already being recorded")

// Recorder records the leader's steps when asked (Record), and follows
// each stage's busy time from the timings the stages report. Its Pipeline
// observers go to the pipelines' drivers (pipeline.DriverOptions), and it
// is the scheduler loop's observer (sched.LoopOptions). When no recording
// is under way, a step costs it an atomic load, a clock comparison and
// the calls themselves, and every StatsPeriod one stage report each.
type Recorder struct {
	on           atomic.Bool  // a recording is under way
	lastPeriodic atomic.Int64 // unix nanoseconds of the last step asked for timings outside a recording

	mu  sync.Mutex
	rec *recording // the recording under way (nil: none)
	// epoch is the newest pipeline observed, on nodes, whose stages busy
	// follows.
	epoch uint64
	nodes []string
	busy  []*busyState
	// ended sums, per node, the busy times of its stages in earlier
	// pipelines and of workers that started again, so that NodeBusy
	// only grows for the life of the process.
	ended map[string]busySample
}

// New returns a recorder with nothing recorded.
func New() *Recorder { return &Recorder{} }

// Pipeline returns the observer of the driver of the pipeline of epoch
// whose stages run on nodes, in order. The recorder follows the busy time
// of the newest pipeline's stages.
func (r *Recorder) Pipeline(epoch uint64, nodes []string) pipeline.Observer {
	r.mu.Lock()
	defer r.mu.Unlock()
	if epoch >= r.epoch {
		for i, b := range r.busy {
			r.end(r.nodes[i], b.last)
		}
		r.epoch, r.nodes = epoch, append([]string(nil), nodes...)
		r.busy = make([]*busyState, len(nodes))
		for i := range r.busy {
			r.busy[i] = &busyState{}
		}
	}
	return &pipelineObserver{r: r, epoch: epoch, nodes: append([]string(nil), nodes...)}
}

// pipelineObserver is a pipeline.Observer of one pipeline's driver.
type pipelineObserver struct {
	r     *Recorder
	epoch uint64
	nodes []string
}

// Submitting implements pipeline.Observer: a step asks for timings while
// a recording takes it, and once every StatsPeriod.
func (o *pipelineObserver) Submitting(s *pipeline.Step, at time.Time) bool {
	r := o.r
	if r.on.Load() && r.submitting(o, s, at) {
		return true
	}
	last := r.lastPeriodic.Load()
	if at.UnixNano()-last < int64(StatsPeriod) {
		return false
	}
	return r.lastPeriodic.CompareAndSwap(last, at.UnixNano())
}

// Reported implements pipeline.Observer.
func (o *pipelineObserver) Reported(stage int, batch uint64, t *pipeline.StageTiming, at time.Time) {
	r := o.r
	r.mu.Lock()
	defer r.mu.Unlock()
	if o.epoch == r.epoch && stage < len(r.busy) {
		if b := r.busy[stage]; t.Busy < b.last.busy {
			r.end(r.nodes[stage], b.last) // a new worker: its counts start again
		}
		r.busy[stage].add(t, at)
	}
	if rec := r.rec; rec != nil && rec.epoch == o.epoch {
		if s := rec.steps[batch]; s != nil && stage < len(s.stages) && s.stages[stage] == nil {
			s.stages[stage] = &stageReport{t: *t, at: at}
			s.reports++
			rec.check()
		}
	}
}

// submitting records a step submitted during a recording; it reports
// whether the step is recorded.
func (r *Recorder) submitting(o *pipelineObserver, s *pipeline.Step, at time.Time) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	rec := r.rec
	if rec == nil || len(rec.order) >= rec.want {
		return false
	}
	if rec.epoch == 0 {
		rec.epoch, rec.nodes = o.epoch, o.nodes
	}
	if rec.epoch != o.epoch {
		// The pipeline changed during the recording: its steps in flight
		// were abandoned; the recording ends with what it has.
		rec.switched = true
		rec.finish()
		return false
	}
	st := &stepRecord{batch: s.Batch.ID, submitted: at, stages: make([]*stageReport, len(o.nodes)),
		seqs: len(s.Batch.Seqs), handoff: s.Batch.Handoff, await: s.AwaitHandoff, graph: s.Batch.Graph.Mode.String()}
	for i := range s.Batch.Seqs {
		q := &s.Batch.Seqs[i]
		st.tokens += len(q.Tokens)
		if len(q.Tokens) == 1 && q.Sample {
			st.decodes++
		}
	}
	rec.steps[st.batch] = st
	rec.order = append(rec.order, st.batch)
	return true
}

// Scheduled implements sched.Observer.
func (r *Recorder) Scheduled(st *pipeline.Step, inFlight int, start, end time.Time) {
	if !r.on.Load() {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if rec := r.rec; rec != nil {
		if s := rec.steps[st.Batch.ID]; s != nil {
			s.schedStart, s.schedEnd = start, end
		}
		rec.inFlight = append(rec.inFlight, counter{end, inFlight})
	}
}

// Completed implements sched.Observer.
func (r *Recorder) Completed(batch uint64, tokens, inFlight int, start, end time.Time) {
	if !r.on.Load() {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if rec := r.rec; rec != nil {
		if s := rec.steps[batch]; s != nil && !s.completed {
			s.completed, s.compStart, s.compEnd, s.outputs = true, start, end, tokens
			rec.complete++
			rec.check()
		}
		rec.inFlight = append(rec.inFlight, counter{end, inFlight})
	}
}

// FirstToken implements sched.Observer.
func (r *Recorder) FirstToken(id uint64, submitted, at time.Time) {
	if !r.on.Load() {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if rec := r.rec; rec != nil && !rec.ended {
		rec.requests = append(rec.requests, request{id: id, submitted: submitted, first: at})
	}
}

// Record records the next steps steps the leader submits (every stage
// reports its timing of each) and returns them with the scheduler's work
// and the first tokens of requests meanwhile. It returns once the steps'
// results and the stages' timings are in (or a second after the results,
// for timings lost), when the pipeline changes (with the steps so far),
// or when ctx ends: with the steps complete by then, or ctx's error if
// none is. One recording runs at a time: ErrBusy otherwise.
func (r *Recorder) Record(ctx context.Context, steps int) (*Trace, error) {
	if steps < 1 || steps > MaxSteps {
		return nil, fmt.Errorf("trace of %d steps: want 1 to %d", steps, MaxSteps)
	}
	rec := &recording{want: steps, start: time.Now(), steps: map[uint64]*stepRecord{}, changed: make(chan struct{}, 1)}
	r.mu.Lock()
	if r.rec != nil {
		r.mu.Unlock()
		return nil, ErrBusy
	}
	r.rec = rec
	r.on.Store(true)
	r.mu.Unlock()
	defer func() {
		r.mu.Lock()
		r.rec = nil
		r.on.Store(false)
		r.mu.Unlock()
	}()
	var grace <-chan time.Time
	for ended := false; !ended; {
		select {
		case <-rec.changed:
		case <-grace:
			ended = true
		case <-ctx.Done():
			ended = true
		}
		r.mu.Lock()
		ended = ended || rec.ended
		results := len(rec.order) >= rec.want && rec.complete >= rec.want
		r.mu.Unlock()
		if results && grace == nil {
			t := time.NewTimer(reportGrace)
			defer t.Stop()
			grace = t.C
		}
	}
	r.mu.Lock()
	rec.finish()
	tr := rec.trace()
	r.mu.Unlock()
	if len(tr.Steps) == 0 {
		if err := ctx.Err(); err != nil {
			return nil, fmt.Errorf("no step completed: %w", err)
		}
		return nil, errors.New("no step completed: the pipeline changed")
	}
	return tr, nil
}

// recording is a recording under way; the Recorder's mutex guards it.
type recording struct {
	want  int
	start time.Time
	// epoch and nodes are the pipeline's whose steps are recorded (epoch
	// 0: none yet).
	epoch    uint64
	nodes    []string
	steps    map[uint64]*stepRecord
	order    []uint64 // batches recorded, in submission order
	complete int      // steps whose result was taken
	requests []request
	inFlight []counter
	switched bool // the pipeline changed
	ended    bool
	// changed wakes Record after a change.
	changed chan struct{}
}

// check ends the recording once every step is recorded, has its result
// and is reported by every stage; it wakes Record.
func (rec *recording) check() {
	defer rec.wake()
	if rec.ended || len(rec.order) < rec.want || rec.complete < rec.want {
		return
	}
	for _, b := range rec.order {
		if s := rec.steps[b]; s.reports < len(s.stages) {
			return
		}
	}
	rec.finish()
}

func (rec *recording) finish() {
	rec.ended = true
	rec.wake()
}

func (rec *recording) wake() {
	select {
	case rec.changed <- struct{}{}:
	default:
	}
}

type stepRecord struct {
	batch                        uint64
	submitted                    time.Time
	seqs, tokens, decodes, await int
	handoff                      bool
	graph                        string
	schedStart, schedEnd         time.Time
	completed                    bool
	compStart, compEnd           time.Time
	outputs                      int
	stages                       []*stageReport // by stage index; nil: not reported
	reports                      int
}

type stageReport struct {
	t  pipeline.StageTiming
	at time.Time // when it reached the leader's driver
}

type request struct {
	id               uint64
	submitted, first time.Time
}

type counter struct {
	at time.Time
	n  int
}
