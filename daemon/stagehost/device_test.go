package stagehost

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"github.com/tandem-llm/tandem/gpu"
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
		d, err := OpenDevice(BackendAuto, 0, log)
		if err != nil || d.Backend != BackendCPU || d.gpu != nil {
			t.Fatalf("%s: auto: %+v, %v; want the CPU", name, d, err)
		}
		if w := "using CPU backend: " + why; !strings.Contains(logs.String(), w) || !strings.Contains(logs.String(), probe().Error()) {
			t.Errorf("%s: auto logged %q, want %q and the probe's error", name, logs.String(), w)
		}
		if _, err := OpenDevice(BackendCUDA, 0, log); err == nil || !strings.Contains(err.Error(), "stage.backend cuda") {
			t.Errorf("%s: cuda: %v, want an error naming stage.backend", name, err)
		}
	}
	gpuProbe = func() error { t.Error("backend cpu probed for a GPU"); return nil }
	if d, err := OpenDevice(BackendCPU, 0, slog.New(slog.DiscardHandler)); err != nil || d.Backend != BackendCPU || d.Name == "" {
		t.Errorf("cpu: %+v, %v", d, err)
	}
}

func TestStageMemory(t *testing.T) {
	d := &Device{Free: 1000}
	if u, err := d.Usable(0); err != nil || u != 900 {
		t.Errorf("default: %d, %v; want 90%% of 1000", u, err)
	}
	if u, err := d.Usable(123); err != nil || u != 123 {
		t.Errorf("configured: %d, %v", u, err)
	}
	d.memErr = errors.New("no /proc/meminfo")
	if _, err := d.Usable(0); err == nil || !strings.Contains(err.Error(), "stage.memory") {
		t.Errorf("unknown memory: %v, want an error naming stage.memory", err)
	}
}

func TestParseMeminfo(t *testing.T) {
	good := "MemTotal:       16318480 kB\nMemFree:         1000 kB\nMemAvailable:    8159240 kB\nBuffers: 1 kB\n"
	total, avail, err := parseMeminfo([]byte(good))
	if err != nil || total != 16318480<<10 || avail != 8159240<<10 {
		t.Errorf("parseMeminfo: %d %d %v", total, avail, err)
	}
	for _, bad := range []string{"MemTotal: 5 kB\n", "MemTotal: x kB\nMemAvailable: 1 kB\n", "MemTotal: 5 MB\nMemAvailable: 1 kB\n"} {
		if _, _, err := parseMeminfo([]byte(bad)); err == nil {
			t.Errorf("parseMeminfo(%q) succeeded", bad)
		}
	}
}
