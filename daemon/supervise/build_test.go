package supervise

import (
	"fmt"
	"strings"
	"testing"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/daemon/placement"
	"github.com/tandem-llm/tandem/graphs"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
	"github.com/tandem-llm/tandem/stage"
)

// TestDispatchStep checks the leader's per-step dispatch for each mode on
// batches of decodes and of prefill chunks, within and past the capture
// sizes.
func TestDispatchStep(t *testing.T) {
	batch := func(lens ...int) *stage.Batch {
		b := &stage.Batch{}
		for _, n := range lens {
			b.Seqs = append(b.Seqs, stage.Seq{Tokens: make([]int32, n)})
		}
		return b
	}
	decodes := func(n int) []int {
		l := make([]int, n)
		for i := range l {
			l[i] = 1
		}
		return l
	}
	full := func(n int) graphs.Step {
		return graphs.Step{Mode: graphs.Full, Desc: graphs.BatchDescriptor{NumTokens: n, NumReqs: n, UniformDecode: true, QueryLen: 1}}
	}
	tokens := func(m graphs.Mode, n int) graphs.Step {
		return graphs.Step{Mode: m, Desc: graphs.BatchDescriptor{NumTokens: n}}
	}
	for _, tc := range []struct {
		mode graphs.Mode
		lens []int
		want graphs.Step
	}{
		{graphs.None, decodes(3), tokens(graphs.None, 3)},
		{graphs.None, []int{7, 1}, tokens(graphs.None, 8)},
		{graphs.FullAndPiecewise, decodes(3), full(4)},
		{graphs.FullAndPiecewise, decodes(1), full(1)},
		{graphs.FullAndPiecewise, []int{5, 1}, tokens(graphs.Piecewise, 8)},
		{graphs.FullAndPiecewise, []int{40}, tokens(graphs.None, 40)},
		{graphs.FullAndPiecewise, decodes(20), tokens(graphs.Piecewise, 24)}, // past max_seqs 16: no full key
		{graphs.Piecewise, decodes(3), tokens(graphs.Piecewise, 4)},
		{graphs.FullDecodeOnly, []int{2, 1}, tokens(graphs.None, 3)},
		{graphs.FullDecodeOnly, decodes(9), full(16)},
		{graphs.Full, []int{2, 1}, tokens(graphs.Full, 4)},
	} {
		d, err := graphs.NewDispatcher(graphs.Config{Mode: tc.mode, MaxNumSeqs: 16, MaxCaptureSize: 32})
		if err != nil {
			t.Fatal(err)
		}
		if got := dispatchStep(d, batch(tc.lens...)); got != tc.want {
			t.Errorf("%s, batch %v: %s, want %s", tc.mode, tc.lens, got, tc.want)
		}
	}
}

// TestPlanLinks checks the transports of every link: NCCL between two CUDA
// stages, TCP otherwise, and the hand-off ring from the last stage to the
// first.
func TestPlanLinks(t *testing.T) {
	tcp, viaNCCL, none := tandemv1.Transport_TRANSPORT_TCP, tandemv1.Transport_TRANSPORT_NCCL, tandemv1.Transport_TRANSPORT_NONE
	loads := func(backends ...string) []*tandemv1.LoadResponse {
		out := make([]*tandemv1.LoadResponse, len(backends))
		for i, b := range backends {
			out[i] = &tandemv1.LoadResponse{Backend: b, DataAddr: fmt.Sprintf("data%d", i), HandoffAddr: fmt.Sprintf("handoff%d", i)}
		}
		return out
	}
	type link struct {
		prev, next, in, out tandemv1.Transport
		addr, hoAddr        string
	}
	for _, tc := range []struct {
		backends []string
		handoff  bool
		want     []link
	}{
		{[]string{"cuda"}, true, []link{{}}},
		{[]string{"cuda", "cuda"}, true, []link{{next: viaNCCL, in: viaNCCL}, {prev: viaNCCL, out: viaNCCL}}},
		{[]string{"cuda", "cuda"}, false, []link{{next: viaNCCL}, {prev: viaNCCL}}},
		{[]string{"cpu", "cpu", "cpu"}, true, []link{{next: tcp, addr: "data1", in: tcp}, {prev: tcp, next: tcp, addr: "data2"}, {prev: tcp, out: tcp, hoAddr: "handoff0"}}},
		{[]string{"cuda", "cpu", "cuda"}, true, []link{{next: tcp, addr: "data1", in: viaNCCL}, {prev: tcp, next: tcp, addr: "data2"}, {prev: tcp, out: viaNCCL}}},
		{[]string{"cpu", "cuda"}, true, []link{{next: tcp, addr: "data1", in: tcp}, {prev: tcp, out: tcp, hoAddr: "handoff0"}}},
	} {
		reqs := planLinks(loads(tc.backends...), tc.handoff)
		for i, r := range reqs {
			got := link{r.GetPrev(), r.GetNext(), r.GetHandoffIn(), r.GetHandoffOut(), r.GetNextDataAddr(), r.GetHandoffAddr()}
			if got != tc.want[i] {
				t.Errorf("%v hand-off %t, stage %d: %+v, want %+v", tc.backends, tc.handoff, i, got, tc.want[i])
			}
			if got.prev == none && i > 0 {
				t.Errorf("%v: stage %d has no link in", tc.backends, i)
			}
		}
	}
}

func TestCheckActivations(t *testing.T) {
	stages := []placement.Stage{{Node: "a"}, {Node: "b"}}
	ok := []*tandemv1.LoadResponse{{Backend: "cuda", ActDtype: uint32(collective.F32)}, {Backend: "cpu", ActDtype: uint32(collective.F32)}}
	if err := checkActivations(stages, ok); err != nil {
		t.Errorf("F32 to F32: %v", err)
	}
	bad := []*tandemv1.LoadResponse{{Backend: "cuda", ActDtype: uint32(collective.BF16)}, {Backend: "cpu", ActDtype: uint32(collective.F32)}}
	err := checkActivations(stages, bad)
	if err == nil || !strings.Contains(err.Error(), "stage 0 on a (cuda) sends bf16 activations, stage 1 on b (cpu) receives f32") {
		t.Errorf("BF16 to F32: %v", err)
	}
}
