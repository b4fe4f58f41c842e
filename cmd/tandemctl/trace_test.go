package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// TestTraceCommand records steps of a daemon serving a benchmark with the
// trace command: it writes the trace file (JSON with trace events and the
// summary) and prints the summary with a row for the stage; with
// --summary-json it prints the summary only.
func TestTraceCommand(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "m")
	if _, err := run(t, "", "model", "init", "--out", dir); err != nil {
		t.Fatal(err)
	}
	addr := startDaemon(t, dir, "tok-trace")
	t.Setenv(addrEnv, addr)
	t.Setenv(tokenEnv, "tok-trace")
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	wg.Go(func() {
		for ctx.Err() == nil {
			cmd := newRootCmd()
			cmd.SetArgs([]string{"bench", "--concurrency", "4", "--requests", "8", "--max-tokens", "16"})
			cmd.SetOut(new(strings.Builder))
			cmd.ExecuteContext(ctx)
		}
	})

	file := filepath.Join(t.TempDir(), "t.json")
	out, err := run(t, "", "trace", "--steps", "20", "--out", file)
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{"trace: 20 steps of pipeline epoch", "STAGE", "BUSY", "wrote " + file, "ui.perfetto.dev"} {
		if !strings.Contains(out, w) {
			t.Errorf("trace output lacks %q:\n%s", w, out)
		}
	}
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var tr struct {
		TraceEvents []struct{ Name, Ph string }
		OtherData   struct {
			Steps  int
			Stages []struct{ Node string }
		}
	}
	if err := json.Unmarshal(b, &tr); err != nil || tr.OtherData.Steps != 20 || len(tr.OtherData.Stages) != 1 || tr.OtherData.Stages[0].Node != "solo" {
		t.Errorf("trace file: %v, summary %+v", err, tr.OtherData)
	}
	forward := 0
	for _, e := range tr.TraceEvents {
		if e.Name == "forward" && e.Ph == "X" {
			forward++
		}
	}
	if forward != 20 {
		t.Errorf("%d forward spans in the trace, want 20", forward)
	}
	out, err = run(t, "", "trace", "--steps", "5", "--summary-json")
	if err != nil {
		t.Fatal(err)
	}
	var sum struct{ Steps int }
	if err := json.Unmarshal([]byte(out), &sum); err != nil || sum.Steps != 5 {
		t.Errorf("trace --summary-json: %v: %s", err, out)
	}
}
