package daemon

import (
	"path/filepath"
	"testing"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/randinit"
	"github.com/tandem-llm/tandem/model/tokenizer"
)

// testModel writes a tiny random checkpoint and returns its directory.
func testModel(t testing.TB) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "model")
	o := randinit.DefaultOptions()
	o.Seed = 5
	if err := randinit.Write(dir, o); err != nil {
		t.Fatal(err)
	}
	return dir
}

func openTestModel(t testing.TB, dir string) (*model.Checkpoint, *tokenizer.Tokenizer) {
	t.Helper()
	ckpt, err := model.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ckpt.Close() })
	tok, err := tokenizer.Load(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		t.Fatal(err)
	}
	return ckpt, tok
}
