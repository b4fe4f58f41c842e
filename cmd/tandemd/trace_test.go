package main

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// traceJSON is a Chrome trace as the Trace Event Format defines it, read
// without the recorder's types.
type traceJSON struct {
	TraceEvents []struct {
		Name string         `json:"name"`
		Cat  string         `json:"cat"`
		Ph   string         `json:"ph"`
		Ts   float64        `json:"ts"`
		Dur  float64        `json:"dur"`
		Pid  int            `json:"pid"`
		Tid  int            `json:"tid"`
		ID   string         `json:"id"`
		Args map[string]any `json:"args"`
	} `json:"traceEvents"`
	OtherData struct {
		Steps  int `json:"steps"`
		Stages []struct {
			Index               int     `json:"index"`
			Node                string  `json:"node"`
			Steps               int     `json:"steps"`
			Busy                float64 `json:"busy"`
			WaitStep            float64 `json:"wait_step"`
			Recv                float64 `json:"recv"`
			OffsetUncertaintyUs float64 `json:"offset_uncertainty_us"`
		} `json:"stages"`
		Requests int `json:"requests"`
	} `json:"otherData"`
}

// TestTrace records steps of a real cluster (a leader and three CPU stage
// daemons, hand-off on) serving a stream of short requests, and checks the
// trace: a track per stage named for its node; for every step recorded a
// forward span on every stage, and the other phases' spans; spans that
// never overlap within a track; spans placed consistently on the leader's
// timeline although every stage timed them on its own clock (a stage takes
// a step after the leader submitted it, receives the activations after the
// previous stage began sending them, and the last stage is done before the
// leader takes the result); the requests' times to first token; and each
// stage's busy fraction, which status reports too.
func TestTrace(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, _ := startCluster(t, ctx, testModel(t), 3, false)

	// Clients keep 6 requests of 12 tokens in flight until told to stop.
	load, stopLoad := context.WithCancel(ctx)
	var (
		wg     sync.WaitGroup
		mu     sync.Mutex
		served int
		errs   []error
	)
	for k := range 6 {
		wg.Go(func() {
			for i := 0; load.Err() == nil; i++ {
				prompt := []int32{int32(1 + k), int32(2 + i%50), 7, 9}
				_, err := generate(load, c.Conn, &tandemv1.GenerateRequest{PromptTokenIds: prompt, MaxTokens: 12, IgnoreEos: true})
				mu.Lock()
				if err == nil {
					served++
				} else if load.Err() == nil {
					errs = append(errs, err)
				}
				mu.Unlock()
			}
		})
	}
	defer func() {
		stopLoad()
		wg.Wait()
		if len(errs) > 0 {
			t.Errorf("%d requests failed, the first: %v", len(errs), errs[0])
		}
	}()

	const steps = 60
	admin := tandemv1.NewAdminClient(c.Conn)
	r, err := admin.Trace(ctx, &tandemv1.TraceRequest{Steps: steps, Timeout: durationpb.New(time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	var tr traceJSON
	if err := json.Unmarshal(r.GetTraceJson(), &tr); err != nil {
		t.Fatalf("trace JSON: %v", err)
	}
	checkTrace(t, &tr, steps, []string{"stage-1", "stage-2", "stage-3"})

	// A bad step count is refused.
	if _, err := admin.Trace(ctx, &tandemv1.TraceRequest{Steps: 0}); err == nil || !strings.Contains(err.Error(), "InvalidArgument") {
		t.Errorf("trace of 0 steps: %v, want InvalidArgument", err)
	}

	// Status reports each stage's busy time while requests run.
	st := awaitStatus(t, ctx, admin, "stages busy", func(st *tandemv1.StatusResponse) bool {
		for _, s := range st.GetStages() {
			if s.GetBusy().AsDuration() <= 0 || s.GetBusyFraction() <= 0 || s.GetBusyFraction() > 1 {
				return false
			}
		}
		return len(st.GetStages()) == 3
	})
	for _, s := range st.GetStages() {
		t.Logf("stage %d on %s: busy %v since the pipeline was built, %.1f%% of the last second", s.GetIndex(), s.GetNode(), s.GetBusy().AsDuration(), 100*s.GetBusyFraction())
	}
}

// checkTrace checks a trace of steps steps over stages on nodes.
func checkTrace(t *testing.T, tr *traceJSON, steps int, nodes []string) {
	t.Helper()
	const eps = 0.002 // µs: timestamps are rounded to the nanosecond
	if tr.OtherData.Steps != steps || len(tr.OtherData.Stages) != len(nodes) {
		t.Fatalf("trace summary: %d steps, %d stages; want %d and %d", tr.OtherData.Steps, len(tr.OtherData.Stages), steps, len(nodes))
	}
	names := map[int]string{}
	type span struct {
		name       string
		start, end float64
		batch      uint64
	}
	tracks := map[int][]span{} // pid → the stage's spans
	stepStart, stepEnd := map[uint64]float64{}, map[uint64]float64{}
	ttft := map[string][2]float64{}
	var ttftArgs []float64
	batchOf := func(args map[string]any) uint64 {
		b, _ := args["batch"].(float64)
		return uint64(b)
	}
	for _, e := range tr.TraceEvents {
		switch {
		case e.Ph == "M" && e.Name == "process_name":
			names[e.Pid], _ = e.Args["name"].(string)
		case e.Ph == "X" && e.Pid >= 10 && e.Tid == 1: // a stage's worker
			tracks[e.Pid] = append(tracks[e.Pid], span{e.Name, e.Ts, e.Ts + e.Dur, batchOf(e.Args)})
		case e.Ph == "X" && e.Pid >= 10:
			t.Errorf("span %q on thread %d of stage %d: CPU stages measure no device time", e.Name, e.Tid, e.Pid-10)
		case e.Cat == "step" && e.Ph == "b":
			stepStart[batchOf(e.Args)] = e.Ts
		case e.Cat == "step" && e.Ph == "e":
			var b uint64
			fmt.Sscan(e.ID, &b)
			stepEnd[b] = e.Ts
		case e.Cat == "request" && e.Ph == "b":
			v := ttft[e.ID]
			v[0] = e.Ts
			ttft[e.ID] = v
			ms, _ := e.Args["ttft_ms"].(float64)
			ttftArgs = append(ttftArgs, ms)
		case e.Cat == "request" && e.Ph == "e":
			v := ttft[e.ID]
			v[1] = e.Ts
			ttft[e.ID] = v
		}
	}
	if names[1] != "leader" {
		t.Errorf("process 1 is %q, want the leader", names[1])
	}
	if len(stepStart) != steps || len(stepEnd) != steps {
		t.Fatalf("%d steps begun and %d ended in the trace, want %d", len(stepStart), len(stepEnd), steps)
	}
	// forward[i][batch] is stage i's forward span of the batch; send and
	// recv likewise.
	forward := make([]map[uint64]span, len(nodes))
	send, recv := make([]map[uint64]span, len(nodes)), make([]map[uint64]span, len(nodes))
	for i, node := range nodes {
		pid := 10 + i
		if want := fmt.Sprintf("stage %d (%s)", i, node); names[pid] != want {
			t.Errorf("process %d is %q, want %q", pid, names[pid], want)
		}
		spans := tracks[pid]
		slices.SortFunc(spans, func(a, b span) int { return cmp.Compare(a.start, b.start) })
		forward[i], send[i], recv[i] = map[uint64]span{}, map[uint64]span{}, map[uint64]span{}
		for k, s := range spans {
			if s.end < s.start {
				t.Errorf("stage %d: span %s of batch %d ends before it starts", i, s.name, s.batch)
			}
			if k > 0 && spans[k-1].end > s.start+eps {
				t.Errorf("stage %d: %s of batch %d (%.3f-%.3f µs) overlaps %s of batch %d (%.3f-%.3f µs)", i, s.name, s.batch, s.start, s.end,
					spans[k-1].name, spans[k-1].batch, spans[k-1].start, spans[k-1].end)
			}
			switch s.name {
			case "forward":
				if _, dup := forward[i][s.batch]; dup {
					t.Errorf("stage %d: two forward spans of batch %d", i, s.batch)
				}
				forward[i][s.batch] = s
			case "send":
				send[i][s.batch] = s
			case "recv activations":
				recv[i][s.batch] = s
			case "wait for step", "await hand-off":
			default:
				t.Errorf("stage %d: span %q", i, s.name)
			}
		}
	}
	last := len(nodes) - 1
	for b, start := range stepStart {
		for i := range nodes {
			f, ok := forward[i][b]
			if !ok {
				t.Errorf("step %d: no forward span on stage %d", b, i)
				continue
			}
			if i == 0 && f.start < start-eps {
				t.Errorf("step %d: stage 0 runs it at %.3f µs, before the leader submitted it at %.3f", b, f.start, start)
			}
			if i > 0 {
				r, rok := recv[i][b]
				s, sok := send[i-1][b]
				if !rok || !sok {
					t.Errorf("step %d: stage %d received no activations (%v) or stage %d sent none (%v)", b, i, rok, i-1, sok)
				} else if r.end < s.start-eps {
					t.Errorf("step %d: stage %d had its activations at %.3f µs, before stage %d began sending them at %.3f", b, i, r.end, i-1, s.start)
				}
			}
		}
		if f, ok := forward[last][b]; ok && f.end > stepEnd[b]+eps {
			t.Errorf("step %d: the last stage's forward pass ends at %.3f µs, after the leader took the result at %.3f", b, f.end, stepEnd[b])
		}
	}
	if len(ttft) == 0 || tr.OtherData.Requests != len(ttft) {
		t.Errorf("%d requests' first tokens in the trace, summary says %d; want some", len(ttft), tr.OtherData.Requests)
	}
	for id, v := range ttft {
		if v[1] < v[0] {
			t.Errorf("%s: first token at %.3f µs, before its submission at %.3f", id, v[1], v[0])
		}
	}
	for _, ms := range ttftArgs {
		if ms <= 0 || math.IsNaN(ms) {
			t.Errorf("a time to first token of %v ms", ms)
		}
	}
	for _, s := range tr.OtherData.Stages {
		if s.Steps != steps || s.Busy <= 0 || s.Busy > 1 || s.Node != nodes[s.Index] {
			t.Errorf("stage summary %+v: want %d steps on %s, busy in (0, 1]", s, steps, nodes[s.Index])
		}
		t.Logf("stage %d on %s: busy %.1f%%, waiting for steps %.1f%%, receiving %.1f%%, clock ±%.0f µs", s.Index, s.Node, 100*s.Busy, 100*s.WaitStep, 100*s.Recv, s.OffsetUncertaintyUs)
	}
}
