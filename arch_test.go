package tandem_test

import (
	"encoding/json"
	"io"
	"os/exec"
	"strings"
	"testing"
)

const module = "github.com/tandem-llm/tandem"

// TestImportDirection enforces the layering of DEVELOPERS.md: lower layers
// never import higher ones, directly or through others.
func TestImportDirection(t *testing.T) {
	out, err := exec.Command("go", "list", "-json=ImportPath,Deps", "./...").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	// rules: packages under key never depend on packages under any value.
	rules := map[string][]string{
		"graphs":     {"gpu", "daemon", "proto", "cmd"},
		"sched":      {"gpu", "daemon", "proto", "cmd"},
		"stage":      {"daemon", "cmd"},
		"collective": {"daemon", "cmd"},
		"model":      {"stage", "collective", "pipeline", "gpu", "graphs", "sched", "daemon", "proto", "cmd"},
		"gpu":        {"model", "stage", "collective", "pipeline", "graphs", "sched", "daemon", "proto", "cmd"},
		"pipeline":   {"daemon", "cmd"},
		"linkauth":   {"model", "stage", "collective", "pipeline", "gpu", "graphs", "sched", "daemon", "proto", "cmd"},
	}
	dec := json.NewDecoder(strings.NewReader(string(out)))
	checked := 0
	for {
		var p struct {
			ImportPath string
			Deps       []string
		}
		if err := dec.Decode(&p); err == io.EOF {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		rel, ok := ours(p.ImportPath)
		if !ok {
			continue
		}
		checked++
		for _, d := range p.Deps {
			drel, ok := ours(d)
			if !ok {
				continue
			}
			if under(drel, "cmd") {
				t.Errorf("%s imports %s: nothing imports cmd", rel, drel)
			}
			// daemon wires its subpackages; none of them imports it, and
			// the leader's supervision, the stage host and the request
			// frontend do not import one another.
			if strings.HasPrefix(rel, "daemon/") && drel == "daemon" {
				t.Errorf("%s imports daemon: the package that wires it", rel)
			}
			for _, pair := range [][2]string{
				{"daemon/supervise", "daemon/stagehost"}, {"daemon/supervise", "daemon/frontend"},
				{"daemon/stagehost", "daemon/supervise"}, {"daemon/stagehost", "daemon/frontend"},
				{"daemon/frontend", "daemon/supervise"}, {"daemon/frontend", "daemon/stagehost"},
			} {
				if under(rel, pair[0]) && under(drel, pair[1]) {
					t.Errorf("%s depends on %s: the daemon's parts meet only in package daemon", rel, drel)
				}
			}
			for layer, banned := range rules {
				if !under(rel, layer) {
					continue
				}
				for _, b := range banned {
					if under(drel, b) {
						t.Errorf("%s depends on %s: %s must not depend on %s", rel, drel, layer, b)
					}
				}
			}
		}
	}
	if checked < 5 {
		t.Fatalf("checked only %d packages of ours; go list output unexpected", checked)
	}
}

func ours(path string) (string, bool) {
	if path == module {
		return "", true
	}
	rel, ok := strings.CutPrefix(path, module+"/")
	return rel, ok
}

func under(rel, top string) bool { return rel == top || strings.HasPrefix(rel, top+"/") }
