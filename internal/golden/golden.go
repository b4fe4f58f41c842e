// Package golden runs golden scripts, the tests of tandem's goroutine-free
// cores (sched, daemon/supervise): text files of commands, one a line,
// each followed by the lines it printed, indented by two spaces. A test
// runs a script's commands and returns the script with each command's
// lines replaced by what it printed now; Run compares that with the file.
//
// # Usage
//
//	func TestScripts(t *testing.T) { golden.Run(t, runScript) }
//
// go test -run TestScripts -update rewrites the expected lines.
package golden

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the expected output of testdata scripts")

// Run runs every testdata/*.txt script as a subtest: run returns the
// script with each command's expected lines replaced by what it printed.
// A script whose output differs fails with the lines that differ, or is
// rewritten under -update.
func Run(t *testing.T, run func(t *testing.T, script string) string) {
	t.Helper()
	files, err := filepath.Glob(filepath.Join("testdata", "*.txt"))
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatal("no scripts in testdata")
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			data, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			got := run(t, string(data))
			if got == string(data) {
				return
			}
			if *update {
				if err := os.WriteFile(f, []byte(got), 0o644); err != nil {
					t.Fatal(err)
				}
				return
			}
			t.Errorf("output differs (go test -run TestScripts -update rewrites it):\n%s", diffLines(string(data), got))
		})
	}
}

// diffLines shows the lines of got that differ from want.
func diffLines(want, got string) string {
	w, g := strings.Split(want, "\n"), strings.Split(got, "\n")
	var b strings.Builder
	for i := range max(len(w), len(g)) {
		var wl, gl string
		if i < len(w) {
			wl = w[i]
		}
		if i < len(g) {
			gl = g[i]
		}
		if wl != gl {
			fmt.Fprintf(&b, "line %d:\n  want %q\n  got  %q\n", i+1, wl, gl)
		}
	}
	return b.String()
}
