package daemon

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/daemon/placement"
	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/graphs"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
	"github.com/tandem-llm/tandem/stage"
)

// TestBackendWithoutGPU checks the backend choice on a host where no GPU
// can be used: auto falls back to the CPU and says why, cuda fails, cpu
// never looks. The real probe runs where it finds no driver (CI); a stand-in
// reports a host with a driver but no device.
func TestBackendWithoutGPU(t *testing.T) {
	probes := map[string]func() error{
		"no device": func() error { return errors.New("cuInit: no CUDA-capable device is detected") },
	}
	if err := gpu.Probe(); err != nil {
		probes["real probe"] = gpu.Probe
	} else {
		t.Log("this host has a CUDA driver: the real probe is not checked")
	}
	probes["no driver"] = func() error { return fmt.Errorf("%w: libcuda.so.1 not found in the ld cache", gpu.ErrNoDriver) }
	defer func(p func() error) { gpuProbe = p }(gpuProbe)
	for name, probe := range probes {
		gpuProbe = probe
		why := "no usable GPU"
		if errors.Is(probe(), gpu.ErrNoDriver) {
			why = "no CUDA driver"
		}
		var logs bytes.Buffer
		log := slog.New(slog.NewTextHandler(&logs, nil))
		d, err := openDevice(StageConfig{Backend: BackendAuto}, log)
		if err != nil || d.backend != BackendCPU || d.gpu != nil {
			t.Fatalf("%s: auto: %+v, %v; want the CPU", name, d, err)
		}
		if w := "using CPU backend: " + why; !strings.Contains(logs.String(), w) || !strings.Contains(logs.String(), probe().Error()) {
			t.Errorf("%s: auto logged %q, want %q and the probe's error", name, logs.String(), w)
		}
		if _, err := openDevice(StageConfig{Backend: BackendCUDA}, log); err == nil || !strings.Contains(err.Error(), "stage.backend cuda") {
			t.Errorf("%s: cuda: %v, want an error naming stage.backend", name, err)
		}
	}
	gpuProbe = func() error { t.Error("backend cpu probed for a GPU"); return nil }
	if d, err := openDevice(StageConfig{Backend: BackendCPU}, slog.New(slog.DiscardHandler)); err != nil || d.backend != BackendCPU || d.name == "" {
		t.Errorf("cpu: %+v, %v", d, err)
	}
}

func TestStageMemory(t *testing.T) {
	d := &stageDevice{free: 1000}
	if u, err := d.usable(0); err != nil || u != 900 {
		t.Errorf("default: %d, %v; want 90%% of 1000", u, err)
	}
	if u, err := d.usable(123); err != nil || u != 123 {
		t.Errorf("configured: %d, %v", u, err)
	}
	d.memErr = errors.New("no /proc/meminfo")
	if _, err := d.usable(0); err == nil || !strings.Contains(err.Error(), "stage.memory") {
		t.Errorf("unknown memory: %v, want an error naming stage.memory", err)
	}
}

func TestKernelCacheDir(t *testing.T) {
	for _, tc := range []struct{ configured, tandem, systemd, want string }{
		{"/c", "/t", "/s", "/c"},
		{"", "/t", "/s", ""}, // the stage reads $TANDEM_CACHE_DIR itself
		{"", "", "/var/cache/tandem:/other", filepath.Join("/var/cache/tandem", "kernels")},
		{"", "", "", ""},
	} {
		t.Setenv("TANDEM_CACHE_DIR", tc.tandem)
		t.Setenv("CACHE_DIRECTORY", tc.systemd)
		if got := kernelCacheDir(tc.configured); got != tc.want {
			t.Errorf("%+v: %q", tc, got)
		}
	}
}

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
		cfg := Config{Stage: StageConfig{MaxSeqs: 16, MaxCaptureSize: 32}}
		d, err := cfg.newDispatcher(tc.mode)
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

func TestGraphKeysRoundTrip(t *testing.T) {
	d, err := (&Config{Stage: StageConfig{MaxSeqs: 8, MaxCaptureSize: 64}}).newDispatcher(graphs.FullAndPiecewise)
	if err != nil {
		t.Fatal(err)
	}
	keys := d.Keys()
	got, err := decodeGraphKeys(encodeGraphKeys(keys))
	if err != nil || fmt.Sprint(got) != fmt.Sprint(keys) {
		t.Errorf("keys %v came back as %v, %v", keys, got, err)
	}
	for _, bad := range []*tandemv1.GraphKey{{Mode: "NONE", NumTokens: 8}, {Mode: "FULL", NumTokens: 0}, {Mode: "HALF", NumTokens: 8}} {
		if _, err := decodeGraphKeys([]*tandemv1.GraphKey{bad}); err == nil {
			t.Errorf("key %v: no error", bad)
		}
	}
}
