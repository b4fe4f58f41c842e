package main

import (
	"strings"
	"testing"

	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// TestPrintGraphs: in mode NONE no capture size is listed (it listed 65);
// with graphs the sizes are.
func TestPrintGraphs(t *testing.T) {
	sizes := []uint32{1, 2, 4, 8, 16}
	for _, c := range []struct {
		mode, want, not string
	}{
		{"NONE", "capture sizes: none (mode NONE captures no graphs)", "1 2 4 8 16"},
		{"FULL_AND_PIECEWISE", "capture sizes: 1 2 4 8 16", "none"},
	} {
		var b strings.Builder
		if err := printGraphs(&b, &tandemv1.GraphsResponse{Mode: c.mode, ConfiguredMode: c.mode, CaptureSizes: sizes}); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(b.String(), c.want) || strings.Contains(b.String(), c.not) {
			t.Errorf("mode %s: printed\n%s\nwant %q and not %q", c.mode, b.String(), c.want, c.not)
		}
	}
}
