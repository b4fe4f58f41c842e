package stagehost

import (
	"errors"
	"fmt"
	"log/slog"
	"os"

	"github.com/tandem-llm/tandem/daemon/membership"
	"github.com/tandem-llm/tandem/gpu"
)

// Device is what this node's stage runs on: the host's CPU, or one GPU
// the daemon holds open from start to stop (its stages run on it).
type Device struct {
	Backend string // membership.BackendCPU or membership.BackendCUDA
	Name    string // the CPU's or GPU's name
	// Total is the device's memory; Free what was free at start.
	Total, Free uint64
	memErr      error       // why Total and Free are unknown
	gpu         *gpu.Device // nil on the CPU
}

// gpuProbe finds the CUDA driver; a variable so tests can stand in for a
// host with or without one.
var gpuProbe = gpu.Probe

// Backends a stage may ask for: BackendCPU, BackendCUDA, or BackendAuto
// (CUDA when a driver and the device are there, else the CPU).
const (
	BackendCPU  = membership.BackendCPU
	BackendCUDA = membership.BackendCUDA
	BackendAuto = "auto"
)

// OpenDevice picks the backend asked for: cpu; cuda on GPU ordinal,
// failing when no GPU can be used; auto, cuda when a driver and the device
// are there, else cpu, logging why.
func OpenDevice(backend string, ordinal int, log *slog.Logger) (*Device, error) {
	if backend == BackendCPU {
		return CPUDevice(), nil
	}
	dev, err := openGPU(ordinal)
	switch {
	case err == nil:
		log.Info("using CUDA backend", "device", dev.Name, "ordinal", ordinal, "memory_bytes", dev.Total, "free_bytes", dev.Free)
		return dev, nil
	case backend == BackendCUDA:
		return nil, fmt.Errorf("stage.backend cuda: %w", err)
	}
	why := "no usable GPU"
	if errors.Is(err, gpu.ErrNoDriver) {
		why = "no CUDA driver"
	}
	log.Info(fmt.Sprintf("using CPU backend: %s (stage.backend auto)", why), "reason", err)
	return CPUDevice(), nil
}

// CPUDevice is the host's CPU and memory (none known when /proc/meminfo
// cannot be read: stage.memory must then say it).
func CPUDevice() *Device {
	d := &Device{Backend: membership.BackendCPU, Name: cpuName()}
	d.Total, d.Free, d.memErr = hostMemory()
	return d
}

// openGPU opens GPU ordinal and reads its memory.
func openGPU(ordinal int) (*Device, error) {
	if err := gpuProbe(); err != nil {
		return nil, err
	}
	n, err := gpu.DeviceCount()
	if err != nil {
		return nil, fmt.Errorf("count CUDA devices: %w", err)
	}
	if ordinal >= n {
		return nil, fmt.Errorf("GPU %d: %d CUDA devices visible (CUDA_VISIBLE_DEVICES=%q)", ordinal, n, os.Getenv("CUDA_VISIBLE_DEVICES"))
	}
	d, err := gpu.Open(ordinal)
	if err != nil {
		return nil, fmt.Errorf("open GPU %d: %w", ordinal, err)
	}
	var free, total int
	if err := d.Do(func() (err error) { free, total, err = gpu.MemInfo(); return err }); err != nil {
		d.Close()
		return nil, fmt.Errorf("GPU %d memory: %w", ordinal, err)
	}
	return &Device{Backend: membership.BackendCUDA, Name: d.Info().Name, Total: uint64(total), Free: uint64(free), gpu: d}, nil
}

// Usable is what the stage may use: the configured amount (when not 0),
// or 90% of what was free at start.
func (d *Device) Usable(configured uint64) (uint64, error) {
	switch {
	case configured > 0:
		return configured, nil
	case d.memErr != nil:
		return 0, fmt.Errorf("%w (set stage.memory)", d.memErr)
	}
	return d.Free / 10 * 9, nil
}

// Close releases the GPU, if one is open.
func (d *Device) Close() error {
	if d == nil || d.gpu == nil {
		return nil
	}
	return d.gpu.Close()
}
