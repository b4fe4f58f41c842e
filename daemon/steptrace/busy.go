package steptrace

import (
	"maps"
	"slices"
	"time"

	"github.com/tandem-llm/tandem/pipeline"
)

// BusyWindow is the span over which StageBusy.Recent is measured.
const BusyWindow = time.Second

// StageBusy is how busy a stage of the newest pipeline has been, from the
// timings it reports (pipeline.StageTiming): the time of its forward
// passes, on its own clock.
type StageBusy struct {
	Stage int
	Node  string
	// Busy and DeviceBusy are the stage's forward time and its device time
	// (0 where the stage measures none) since its pipeline was built, as
	// of its last report.
	Busy, DeviceBusy time.Duration
	// Recent and RecentDevice are the fractions of the last BusyWindow
	// (up to now) the stage spent in forward passes, and its device in
	// their work.
	Recent, RecentDevice float64
}

// Busy returns the busy figures of the newest pipeline's stages, as of
// now, and that pipeline's epoch (0: none yet).
func (r *Recorder) Busy(now time.Time) (uint64, []StageBusy) {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]StageBusy, len(r.busy))
	for i, b := range r.busy {
		out[i] = StageBusy{Stage: i, Node: r.nodes[i], Busy: b.last.busy, DeviceBusy: b.last.device}
		out[i].Recent, out[i].RecentDevice = b.recent(now)
	}
	return r.epoch, out
}

// NodeBusy is a node's busy time as a stage, over every pipeline this
// recorder followed.
type NodeBusy struct {
	Node             string
	Busy, DeviceBusy time.Duration
}

// NodeBusy returns, for every node that ran a stage of a pipeline the
// recorder followed, in name order, the forward and device time of its
// stages over all those pipelines: unlike StageBusy's, these never go
// down for the life of the recorder.
func (r *Recorder) NodeBusy() []NodeBusy {
	r.mu.Lock()
	defer r.mu.Unlock()
	sum := maps.Clone(r.ended)
	if sum == nil {
		sum = map[string]busySample{}
	}
	for i, b := range r.busy {
		s := sum[r.nodes[i]]
		s.busy += b.last.busy
		s.device += b.last.device
		sum[r.nodes[i]] = s
	}
	out := make([]NodeBusy, 0, len(sum))
	for _, n := range slices.Sorted(maps.Keys(sum)) {
		out = append(out, NodeBusy{Node: n, Busy: sum[n].busy, DeviceBusy: sum[n].device})
	}
	return out
}

// end adds a stage's last busy times on node to the node's ended sums;
// r.mu is held.
func (r *Recorder) end(node string, last busySample) {
	if last.busy == 0 && last.device == 0 {
		return
	}
	if r.ended == nil {
		r.ended = map[string]busySample{}
	}
	s := r.ended[node]
	s.busy += last.busy
	s.device += last.device
	r.ended[node] = s
}

// busyState follows one stage's busy times: its last report, and a ring
// of earlier ones at least busySpacing apart to measure the recent
// fraction from.
type busyState struct {
	last  busySample
	ring  [busyRing]busySample
	n     int // samples in the ring, at most busyRing
	first int // index of the oldest
}

const (
	busyRing    = 32
	busySpacing = BusyWindow / (busyRing / 2)
)

type busySample struct {
	at           time.Time // when the report reached the leader
	busy, device time.Duration
}

func (b *busyState) add(t *pipeline.StageTiming, at time.Time) {
	s := busySample{at: at, busy: t.Busy, device: t.DeviceBusy}
	if s.busy < b.last.busy {
		*b = busyState{} // a new worker: its counts start again
	}
	b.last = s
	if b.n > 0 && at.Sub(b.ring[(b.first+b.n-1)%busyRing].at) < busySpacing {
		return
	}
	if b.n == busyRing {
		b.first = (b.first + 1) % busyRing
		b.n--
	}
	b.ring[(b.first+b.n)%busyRing] = s
	b.n++
}

// recent is the busy fraction from the newest sample at least BusyWindow
// before now (else the oldest) up to now.
func (b *busyState) recent(now time.Time) (busy, device float64) {
	if b.n == 0 {
		return 0, 0
	}
	base := b.ring[b.first]
	for i := 1; i < b.n; i++ {
		s := b.ring[(b.first+i)%busyRing]
		if now.Sub(s.at) < BusyWindow {
			break
		}
		base = s
	}
	span := now.Sub(base.at)
	if span <= 0 {
		return 0, 0
	}
	frac := func(d time.Duration) float64 { return min(1, max(0, float64(d)/float64(span))) }
	return frac(b.last.busy - base.busy), frac(b.last.device - base.device)
}
