package graphs

import (
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestImportsNothingOurs keeps the package plain data: no cgo, nothing
// CUDA, and no package of this module (the layering test at the module
// root bans gpu, daemon, proto and cmd; this is stricter).
func TestImportsNothingOurs(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		src, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		f, err := parser.ParseFile(token.NewFileSet(), name, src, parser.ImportsOnly)
		if err != nil {
			t.Fatalf("parse %s: %v", name, err)
		}
		checked++
		for _, imp := range f.Imports {
			path, err := strconv.Unquote(imp.Path.Value)
			if err != nil {
				t.Fatalf("%s: import %s: %v", name, imp.Path.Value, err)
			}
			if path == "C" || strings.HasPrefix(path, "github.com/tandem-llm/tandem") || strings.Contains(path, "cuda") || strings.Contains(path, "purego") {
				t.Errorf("%s imports %s", name, path)
			}
		}
	}
	if checked < 5 {
		t.Fatalf("checked %d source files, want the package's", checked)
	}
}
