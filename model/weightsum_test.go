package model_test

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/randinit"
)

// identity opens dir and returns its identity.
func identity(t *testing.T, dir string) string {
	t.Helper()
	ck, err := model.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	return ck.Identity()
}

// copyDir copies the regular files of src into a new directory.
func copyDir(t *testing.T, src string) string {
	t.Helper()
	dst := t.TempDir()
	entries, err := os.ReadDir(src)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(src, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dst, e.Name()), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dst
}

// TestIdentityHashesWeights: checkpoints of the same shape whose weights
// differ (model init --seed 1 and --seed 2, or one byte of a tensor) have
// different identities, single-file and sharded; the same files elsewhere
// have the same. (The identity used to hash only config.json and the
// weights' layout: seeds 1 and 2 shared it.)
func TestIdentityHashesWeights(t *testing.T) {
	t.Setenv(model.CacheEnv, t.TempDir())
	for _, sharded := range []bool{false, true} {
		o := randinit.DefaultOptions()
		if sharded {
			o = shardedOptions()
		}
		o.Seed = 1
		one := write(t, o)
		o.Seed = 2
		two := write(t, o)
		idOne, idTwo := identity(t, one), identity(t, two)
		if idOne == idTwo {
			t.Errorf("sharded %v: seeds 1 and 2 share the identity %s", sharded, idOne)
		}
		if got := identity(t, copyDir(t, one)); got != idOne {
			t.Errorf("sharded %v: a copy of the checkpoint has identity %s, the original %s", sharded, got, idOne)
		}
		// One byte of the last weight file flipped (its size unchanged,
		// its modification time not).
		files, _ := filepath.Glob(filepath.Join(one, "*.safetensors"))
		f := files[len(files)-1]
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		b[len(b)-3] ^= 0x40
		if err := os.WriteFile(f, b, 0o644); err != nil {
			t.Fatal(err)
		}
		later := time.Now().Add(time.Second)
		if err := os.Chtimes(f, later, later); err != nil {
			t.Fatal(err)
		}
		if got := identity(t, one); got == idOne {
			t.Errorf("sharded %v: a flipped weight byte kept the identity %s", sharded, got)
		}
	}
}

// TestIdentityCache: the digest of a weight file is cached by path, size
// and modification time: a second open uses the cached entry (a doctored
// entry shows through), and a new modification time makes it stale. With
// no cache directory writable the identity is computed all the same.
func TestIdentityCache(t *testing.T) {
	cache := t.TempDir()
	t.Setenv(model.CacheEnv, cache)
	dir := write(t, randinit.DefaultOptions())
	want := identity(t, dir)
	entries, _ := filepath.Glob(filepath.Join(cache, "weights", "*.json"))
	if len(entries) != 1 {
		t.Fatalf("%d cache entries after the first open, want 1: %v", len(entries), entries)
	}
	b, err := os.ReadFile(entries[0])
	if err != nil {
		t.Fatal(err)
	}
	var e struct {
		Path    string `json:"path"`
		Size    int64  `json:"size"`
		MtimeNs int64  `json:"mtime_ns"`
		SHA256  string `json:"sha256"`
	}
	if err := json.Unmarshal(b, &e); err != nil {
		t.Fatal(err)
	}
	abs, _ := filepath.Abs(filepath.Join(dir, model.WeightsName))
	if st, _ := os.Stat(abs); e.Path != abs || e.Size != st.Size() || e.MtimeNs != st.ModTime().UnixNano() || len(e.SHA256) != 64 {
		t.Errorf("cache entry %s does not name the file's path, size and time", b)
	}
	if st, _ := os.Stat(entries[0]); st.Mode().Perm() != 0o600 {
		t.Errorf("cache entry mode %v, want 0600", st.Mode().Perm())
	}
	// Doctor the cached digest: the next open must use it.
	e.SHA256 = strings.Repeat("0", 62) + "ff"
	doctored, _ := json.Marshal(e)
	if err := os.WriteFile(entries[0], doctored, 0o600); err != nil {
		t.Fatal(err)
	}
	if got := identity(t, dir); got == want {
		t.Error("the second open hashed the file again instead of using the cache")
	}
	// A new modification time makes the entry stale: the file is hashed
	// again and the identity is the true one.
	later := time.Now().Add(time.Second)
	if err := os.Chtimes(filepath.Join(dir, model.WeightsName), later, later); err != nil {
		t.Fatal(err)
	}
	if got := identity(t, dir); got != want {
		t.Errorf("after touching the weights: identity %s, want %s", got, want)
	}
	// An unusable cache directory changes nothing but the time taken.
	t.Setenv(model.CacheEnv, filepath.Join(dir, model.WeightsName)) // a file, not a directory
	if got := identity(t, dir); got != want {
		t.Errorf("without a usable cache: identity %s, want %s", got, want)
	}
}

// BenchmarkFileDigest measures the hashing rate of a weight file with no
// cache (MB/s): what a first start-up pays per byte of the checkpoint.
func BenchmarkFileDigest(b *testing.B) {
	dir := b.TempDir()
	o := randinit.DefaultOptions()
	o.Hidden, o.Intermediate, o.Vocab, o.Layers = 512, 1536, 32000, 8 // about 120 MB of f32
	if err := randinit.Write(dir, o); err != nil {
		b.Fatal(err)
	}
	st, err := os.Stat(filepath.Join(dir, model.WeightsName))
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(st.Size())
	for b.Loop() {
		b.Setenv(model.CacheEnv, b.TempDir()) // empty: every open hashes
		ck, err := model.Open(dir)
		if err != nil {
			b.Fatal(err)
		}
		ck.Close()
	}
}

// TestIdentityCachePruned: past 256 entries the cache drops those of files
// that are gone, and keeps the others.
func TestIdentityCachePruned(t *testing.T) {
	cache := t.TempDir()
	t.Setenv(model.CacheEnv, cache)
	dir := write(t, randinit.DefaultOptions())
	identity(t, dir)
	for i := range 300 {
		e := fmt.Sprintf(`{"path":"/nonexistent/%d","size":1,"mtime_ns":1,"sha256":"%064d"}`, i, 0)
		if err := os.WriteFile(filepath.Join(cache, "weights", fmt.Sprintf("gone%03d.json", i)), []byte(e), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	identity(t, write(t, randinit.DefaultOptions())) // a new file: an entry is written
	entries, _ := filepath.Glob(filepath.Join(cache, "weights", "*.json"))
	if len(entries) != 2 {
		t.Errorf("%d cache entries after pruning, want the 2 of existing files", len(entries))
	}
}
