package steptrace

import (
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"time"
)

// Trace is a recording: Chrome trace events (the JSON object format of
// the Trace Event Format, which Perfetto and chrome://tracing open) and a
// summary of them.
type Trace struct {
	// Events are the trace's events, timestamps in microseconds from the
	// earliest of them.
	Events  []Event
	Summary Summary
	// Steps are the steps recorded, complete, in order.
	Steps []uint64
}

// Event is one trace event.
type Event struct {
	Name string  `json:"name"`
	Cat  string  `json:"cat,omitempty"`
	Ph   string  `json:"ph"`
	Ts   float64 `json:"ts"`
	Dur  float64 `json:"dur,omitempty"`
	Pid  int     `json:"pid"`
	Tid  int     `json:"tid"`
	ID   string  `json:"id,omitempty"`
	Args any     `json:"args,omitempty"`
}

// Summary sums a trace up; it is also the trace's "otherData".
type Summary struct {
	Epoch uint64 `json:"epoch"`
	// Steps is the number of steps recorded with their result; Partial
	// is set when fewer than asked for (the pipeline changed, or the
	// caller stopped waiting).
	Steps           int  `json:"steps"`
	Partial         bool `json:"partial"`
	PipelineChanged bool `json:"pipeline_changed"`
	// WindowMs is the time from the first step's submission to the last
	// one's result; StepMs the mean time from a step's submission to its
	// result; TokensPerS the tokens delivered over the window.
	WindowMs   float64 `json:"window_ms"`
	StepMs     float64 `json:"step_ms"`
	Tokens     int     `json:"tokens"`
	TokensPerS float64 `json:"tokens_per_s"`
	// MeanInFlight is the time-weighted mean of the steps in flight over
	// the window.
	MeanInFlight float64        `json:"mean_in_flight"`
	Stages       []StageSummary `json:"stages"`
	// Requests is the number of first tokens delivered during the
	// recording, and TTFT their times from submission to the scheduler.
	Requests  int     `json:"requests"`
	TTFTP50Ms float64 `json:"ttft_p50_ms"`
	TTFTMaxMs float64 `json:"ttft_max_ms"`
	// Clock says how the stages' spans were placed on the leader's
	// timeline.
	Clock string `json:"clock"`
}

// StageSummary is where one stage's time went over the recorded steps,
// from its own timings: fractions of its window, from its taking the
// first step to its sending the last one's output.
type StageSummary struct {
	Index    int     `json:"index"`
	Node     string  `json:"node"`
	Steps    int     `json:"steps"`
	WindowMs float64 `json:"window_ms"`
	// Busy is the fraction in forward passes; DeviceBusy the device's
	// busy fraction (0 where not measured).
	Busy       float64 `json:"busy"`
	DeviceBusy float64 `json:"device_busy"`
	// WaitStep is waiting for the leader's next step, Handoff awaiting
	// hand-offs, Recv receiving activations (waiting for the previous
	// stage included), Send sending them on; Other is the rest (reports,
	// freeing sequences).
	WaitStep float64 `json:"wait_step"`
	Handoff  float64 `json:"handoff"`
	Recv     float64 `json:"recv"`
	Send     float64 `json:"send"`
	Other    float64 `json:"other"`
	// ForwardMs and DeviceMs are the mean forward pass and device time.
	ForwardMs float64 `json:"forward_ms"`
	DeviceMs  float64 `json:"device_ms"`
	// OffsetUncertaintyUs bounds, in microseconds, how far the stage's
	// spans may sit from their true place on the leader's timeline.
	OffsetUncertaintyUs float64 `json:"offset_uncertainty_us"`
}

// clockNote is Summary.Clock.
const clockNote = "each stage times its steps on its own monotonic clock; its offset to the leader's clock is bounded by the steps themselves " +
	"(a stage takes a step after the leader submitted it and reports it before the report arrives), and spans are placed at the middle of those bounds, " +
	"one offset per stage, so no clock synchronisation is assumed and a stage's spans keep their own order and lengths"

// JSON is the trace in the Trace Event Format's JSON object form.
func (t *Trace) JSON() ([]byte, error) {
	return json.Marshal(struct {
		TraceEvents     []Event `json:"traceEvents"`
		DisplayTimeUnit string  `json:"displayTimeUnit"`
		OtherData       Summary `json:"otherData"`
	}{t.Events, "ms", t.Summary})
}

// Process ids of the trace: the leader, then one per stage.
const (
	leaderPid = 1
	stagePid  = 10 // + stage index
	schedTid  = 1
	workerTid = 1
	deviceTid = 2 // a stage's device work, where the stage measures it
)

// trace builds the recording's trace; the Recorder's mutex is held.
func (rec *recording) trace() *Trace {
	var steps []*stepRecord
	for _, b := range rec.order {
		if s := rec.steps[b]; s.completed {
			steps = append(steps, s)
		}
	}
	tr := &Trace{}
	sum := &tr.Summary
	sum.Epoch, sum.Steps, sum.Clock = rec.epoch, len(steps), clockNote
	sum.Partial, sum.PipelineChanged = len(steps) < rec.want, rec.switched
	if len(steps) == 0 {
		return tr
	}
	// Leader times are durations from the recording's start; stage times
	// are on the stages' clocks, placed with one offset per stage.
	lt := func(t time.Time) time.Duration { return t.Sub(rec.start) }
	offsets, uncertainty := rec.offsets(steps, lt)
	var evs []Event
	origin := time.Duration(math.MaxInt64)
	at := func(d time.Duration) time.Duration { origin = min(origin, d); return d }
	type span struct {
		name, cat  string
		pid, tid   int
		start, end time.Duration
		args       map[string]any
	}
	var spans []span
	type async struct {
		name, cat, id string
		start, end    time.Duration
		args          map[string]any
	}
	var asyncs []async

	// The leader: scheduling and completing each step, the step's life in
	// the pipeline, steps in flight, first tokens.
	var stepTotal time.Duration
	for _, s := range steps {
		sum.Tokens += s.outputs
		stepTotal += s.compStart.Sub(s.submitted)
		if !s.schedStart.IsZero() {
			spans = append(spans, span{"schedule", "leader", leaderPid, schedTid, at(lt(s.schedStart)), lt(s.schedEnd),
				map[string]any{"batch": s.batch, "seqs": s.seqs, "tokens": s.tokens}})
		}
		spans = append(spans, span{"complete", "leader", leaderPid, schedTid, at(lt(s.compStart)), lt(s.compEnd),
			map[string]any{"batch": s.batch, "tokens_out": s.outputs}})
		asyncs = append(asyncs, async{fmt.Sprintf("step %d", s.batch), "step", fmt.Sprint(s.batch), at(lt(s.submitted)), lt(s.compStart),
			map[string]any{"batch": s.batch, "seqs": s.seqs, "tokens": s.tokens, "decodes": s.decodes, "handoff": s.handoff,
				"await_handoff": s.await, "graph": s.graph}})
	}
	first, last := steps[0], steps[len(steps)-1]
	window := last.compStart.Sub(first.submitted)
	sum.WindowMs = ms(window)
	sum.StepMs = ms(stepTotal / time.Duration(len(steps)))
	if window > 0 {
		sum.TokensPerS = float64(sum.Tokens) / window.Seconds()
	}
	sum.MeanInFlight = meanInFlight(rec.inFlight, first.submitted, last.compStart)
	var ttfts []time.Duration
	for _, q := range rec.requests {
		d := q.first.Sub(q.submitted)
		ttfts = append(ttfts, d)
		asyncs = append(asyncs, async{"TTFT", "request", fmt.Sprintf("request %d", q.id), at(lt(q.submitted)), lt(q.first),
			map[string]any{"request": q.id, "ttft_ms": ms(d)}})
	}
	sum.Requests = len(ttfts)
	if len(ttfts) > 0 {
		slices.Sort(ttfts)
		sum.TTFTP50Ms, sum.TTFTMaxMs = ms(ttfts[len(ttfts)/2]), ms(ttfts[len(ttfts)-1])
	}

	// The stages: each step's phases, placed with the stage's offset.
	for i := range rec.nodes {
		ss := StageSummary{Index: i, Node: rec.nodes[i], OffsetUncertaintyUs: us(uncertainty[i])}
		pl := func(d time.Duration) time.Duration { return at(d - offsets[i]) }
		var firstGot, lastEnd, fwd, dev, wait, ho, recv, send time.Duration
		for k, s := range steps {
			r := s.stages[i]
			if r == nil {
				continue
			}
			t := &r.t
			if ss.Steps == 0 {
				firstGot = t.Got
			} else {
				wait += t.Got - t.Waited
			}
			ss.Steps++
			lastEnd = t.SendEnd
			fwd += t.ForwardEnd - t.ForwardStart
			dev += t.Device
			ho += t.HandoffEnd - t.HandoffStart
			recv += t.RecvEnd - t.RecvStart
			send += t.SendEnd - t.SendStart
			pid := stagePid + i
			phase := func(name, cat string, a, b time.Duration, args map[string]any) {
				if b > a {
					spans = append(spans, span{name, cat, pid, workerTid, pl(a), pl(b), args})
				}
			}
			if k > 0 || t.Got-t.Waited < window {
				phase("wait for step", "idle", t.Waited, t.Got, map[string]any{"batch": s.batch})
			}
			phase("await hand-off", "wait", t.HandoffStart, t.HandoffEnd, map[string]any{"batch": s.batch, "await_handoff": s.await})
			phase("recv activations", "wait", t.RecvStart, t.RecvEnd, map[string]any{"batch": s.batch})
			args := map[string]any{"batch": s.batch, "seqs": s.seqs, "tokens": s.tokens, "graph": s.graph}
			if t.Device > 0 {
				args["device_us"] = us(t.Device)
			}
			phase("forward", "compute", t.ForwardStart, t.ForwardEnd, args)
			if t.Device > 0 && t.Device <= t.ForwardEnd-t.ForwardStart {
				// The device's work, placed at the end of the forward pass
				// that waited for it (the host plans and launches first).
				spans = append(spans, span{"device", "device", pid, deviceTid, pl(t.ForwardEnd - t.Device), pl(t.ForwardEnd),
					map[string]any{"batch": s.batch, "device_us": us(t.Device)}})
			}
			phase("send", "send", t.SendStart, t.SendEnd, map[string]any{"batch": s.batch})
		}
		if ss.Steps > 0 {
			w := lastEnd - firstGot
			ss.WindowMs = ms(w)
			ss.ForwardMs, ss.DeviceMs = ms(fwd/time.Duration(ss.Steps)), ms(dev/time.Duration(ss.Steps))
			if w > 0 {
				f := func(d time.Duration) float64 { return float64(d) / float64(w) }
				ss.Busy, ss.DeviceBusy, ss.WaitStep, ss.Handoff, ss.Recv, ss.Send = f(fwd), f(dev), f(wait), f(ho), f(recv), f(send)
				ss.Other = max(0, 1-ss.Busy-ss.WaitStep-ss.Handoff-ss.Recv-ss.Send)
			}
		}
		sum.Stages = append(sum.Stages, ss)
	}

	// Events, timestamps from the earliest.
	evs = append(evs, meta("process_name", leaderPid, 0, "leader"), meta("thread_name", leaderPid, schedTid, "scheduler"),
		Event{Name: "process_sort_index", Ph: "M", Pid: leaderPid, Args: map[string]any{"sort_index": 0}})
	for i, n := range rec.nodes {
		evs = append(evs, meta("process_name", stagePid+i, 0, fmt.Sprintf("stage %d (%s)", i, n)),
			meta("thread_name", stagePid+i, workerTid, "worker"), meta("thread_name", stagePid+i, deviceTid, "device"),
			Event{Name: "process_sort_index", Ph: "M", Pid: stagePid + i, Args: map[string]any{"sort_index": 1 + i}})
	}
	ts := func(d time.Duration) float64 { return us(d - origin) }
	for _, s := range spans {
		evs = append(evs, Event{Name: s.name, Cat: s.cat, Ph: "X", Ts: ts(s.start), Dur: us(s.end - s.start), Pid: s.pid, Tid: s.tid, Args: s.args})
	}
	for _, a := range asyncs {
		evs = append(evs, Event{Name: a.name, Cat: a.cat, Ph: "b", Ts: ts(a.start), Pid: leaderPid, Tid: schedTid, ID: a.id, Args: a.args},
			Event{Name: a.name, Cat: a.cat, Ph: "e", Ts: ts(a.end), Pid: leaderPid, Tid: schedTid, ID: a.id})
	}
	for _, c := range rec.inFlight {
		if d := lt(c.at); d >= origin {
			evs = append(evs, Event{Name: "steps in flight", Ph: "C", Ts: ts(d), Pid: leaderPid, Args: map[string]any{"steps": c.n}})
		}
	}
	tr.Events = evs
	for _, s := range steps {
		tr.Steps = append(tr.Steps, s.batch)
	}
	return tr
}

// offsets places each stage's clock on the leader's: stage time x is
// leader time x - offsets[i], give or take uncertainty[i]. Each recorded
// step bounds a stage's offset: the stage took the step after the leader
// submitted it (Got - submitted bounds the offset from above) and sent
// its output before its report reached the leader (SendEnd - at bounds
// it from below). A stage after the first also finished receiving a
// step's activations after the stage before it began sending them, which
// bounds its offset from above by the previous stage's, placed first. The
// tightest bounds come from a stage that waited for a step or for its
// activations, and from a report read at once. Should the bounds cross
// (they cannot, but for clocks drifting apart), causality between stages
// wins.
func (rec *recording) offsets(steps []*stepRecord, lt func(time.Time) time.Duration) (offsets, uncertainty []time.Duration) {
	for i := range rec.nodes {
		lo, hi := time.Duration(math.MinInt64), time.Duration(math.MaxInt64)
		for _, s := range steps {
			r := s.stages[i]
			if r == nil {
				continue
			}
			hi = min(hi, r.t.Got-lt(s.submitted))
			lo = max(lo, r.t.SendEnd-lt(r.at))
			if i > 0 {
				if p := s.stages[i-1]; p != nil {
					hi = min(hi, r.t.RecvEnd-p.t.SendStart+offsets[i-1])
				}
			}
		}
		switch {
		case hi == math.MaxInt64:
			offsets, uncertainty = append(offsets, 0), append(uncertainty, 0)
		case lo > hi:
			offsets, uncertainty = append(offsets, hi), append(uncertainty, 0)
		default:
			offsets, uncertainty = append(offsets, lo+(hi-lo)/2), append(uncertainty, (hi-lo)/2)
		}
	}
	return offsets, uncertainty
}

// meanInFlight is the time-weighted mean of the counter over [from, to].
func meanInFlight(cs []counter, from, to time.Time) float64 {
	if !to.After(from) {
		return 0
	}
	var area float64
	n, t := 0, from
	for _, c := range cs {
		if c.at.After(to) {
			break
		}
		if c.at.After(t) {
			area += float64(n) * float64(c.at.Sub(t))
			t = c.at
		}
		n = c.n
	}
	area += float64(n) * float64(to.Sub(t))
	return area / float64(to.Sub(from))
}

func meta(name string, pid, tid int, value string) Event {
	return Event{Name: name, Ph: "M", Pid: pid, Tid: tid, Args: map[string]any{"name": value}}
}

func ms(d time.Duration) float64 { return math.Round(float64(d)/1e3) / 1e3 }
func us(d time.Duration) float64 { return math.Round(float64(d)) / 1e3 }
