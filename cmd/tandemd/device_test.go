package main

import (
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/tandem-llm/tandem/stage"
	"github.com/tandem-llm/tandem/stage/stagetest"
)

// The test binary run as tandemd (asDaemonEnv) puts an emulated device
// around its stages when deviceStepEnv holds a step time ("1ms"): each
// stage is a stagetest.Timed, whose steps take that long, and a
// stage.Launcher unless deviceSyncEnv is "1". scripts/leader-path.sh
// measures the leader's path with it: the inter-token latency through the
// gRPC API against a known step time, on the CPU.
const (
	deviceStepEnv = "TANDEMD_TEST_DEVICE_STEP"
	deviceSyncEnv = "TANDEMD_TEST_DEVICE_SYNC"
)

// emulateDevice sets wrapStage from the environment; the returned function
// prints, on stderr, how each emulated device was used.
func emulateDevice() (report func()) {
	v := os.Getenv(deviceStepEnv)
	if v == "" {
		return func() {}
	}
	step, err := time.ParseDuration(v)
	if err != nil || step < 0 {
		fmt.Fprintf(os.Stderr, "tandemd test: %s=%q: want a duration\n", deviceStepEnv, v)
		os.Exit(2)
	}
	syncOnly := os.Getenv(deviceSyncEnv) == "1"
	var (
		mu    sync.Mutex
		timed []*stagetest.Timed
	)
	wrapStage = func(st stage.Stage) stage.Stage {
		t := stagetest.NewTimed(st, step)
		mu.Lock()
		timed = append(timed, t)
		mu.Unlock()
		if syncOnly {
			return t.Synchronous()
		}
		return t
	}
	return func() {
		mu.Lock()
		defer mu.Unlock()
		for _, t := range timed {
			s := t.Stats()
			per := time.Duration(0)
			if s.Steps > 0 {
				per = s.Idle / time.Duration(s.Steps)
			}
			late := time.Duration(0)
			if s.Steps > 0 {
				late = s.Late / time.Duration(s.Steps)
			}
			fmt.Fprintf(os.Stderr, "emulated device: step %v, launch ahead %v: %d steps, %d launched behind another, idle %v a step, seen done %v late a step\n",
				step, !syncOnly, s.Steps, s.Ahead, per.Round(100*time.Nanosecond), late.Round(100*time.Nanosecond))
		}
	}
}
