package safetensors

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
)

// writeSet writes two shards and an index placing a, b in the first and c
// in the second, and returns the index path.
func writeSet(t *testing.T, dir string) string {
	t.Helper()
	writeFile(t, dir, "model-00001-of-00002.safetensors", []WriteTensor{
		{Name: "a", DType: F32, Shape: []int{1}, Data: f32Bytes(1)},
		{Name: "b", DType: F32, Shape: []int{1}, Data: f32Bytes(2)},
	})
	writeFile(t, dir, "model-00002-of-00002.safetensors", []WriteTensor{
		{Name: "c", DType: F32, Shape: []int{2}, Data: f32Bytes(3, 4)},
	})
	index := `{"metadata": {"total_size": 16},
 "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
  "c": "model-00002-of-00002.safetensors"}}`
	path := filepath.Join(dir, IndexName)
	if err := os.WriteFile(path, []byte(index), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestSetLazy(t *testing.T) {
	path := writeSet(t, t.TempDir())
	s, err := OpenIndex(path)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if got := s.Names(); !slices.Equal(got, []string{"a", "b", "c"}) {
		t.Errorf("Names = %v", got)
	}
	if got := s.Shards(); !slices.Equal(got, []string{"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}) {
		t.Errorf("Shards = %v", got)
	}
	if got := s.Opened(); len(got) != 0 {
		t.Fatalf("Opened before any tensor = %v", got)
	}
	c, err := s.Tensor("c")
	if err != nil {
		t.Fatal(err)
	}
	if v, _ := c.Float32(); !slices.Equal(v, []float32{3, 4}) {
		t.Errorf("c = %v", v)
	}
	if got := s.Opened(); !slices.Equal(got, []string{"model-00002-of-00002.safetensors"}) {
		t.Fatalf("Opened after c = %v", got)
	}
	if _, err := s.Tensor("a"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Tensor("b"); err != nil {
		t.Fatal(err)
	}
	if got := len(s.Opened()); got != 2 {
		t.Errorf("%d shards opened, want 2", got)
	}
	if _, err := s.Tensor("zzz"); err == nil || !strings.Contains(err.Error(), `no tensor "zzz"`) {
		t.Errorf("unknown tensor: %v", err)
	}
}

func TestSetErrors(t *testing.T) {
	t.Run("missing shard", func(t *testing.T) {
		dir := t.TempDir()
		path := writeSet(t, dir)
		if err := os.Remove(filepath.Join(dir, "model-00002-of-00002.safetensors")); err != nil {
			t.Fatal(err)
		}
		_, err := OpenIndex(path)
		if err == nil || !strings.Contains(err.Error(), "shard model-00002-of-00002.safetensors") || !strings.Contains(err.Error(), "no such file") {
			t.Errorf("error %v", err)
		}
	})
	t.Run("tensor not in shard", func(t *testing.T) {
		dir := t.TempDir()
		path := writeSet(t, dir)
		index := `{"weight_map": {"a": "model-00002-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}}`
		if err := os.WriteFile(path, []byte(index), 0o644); err != nil {
			t.Fatal(err)
		}
		s, err := OpenIndex(path)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		_, err = s.Tensor("a")
		if err == nil || !strings.Contains(err.Error(), `tensor "a"`) || !strings.Contains(err.Error(), "shard model-00002-of-00002.safetensors, which does not hold it") {
			t.Errorf("error %v", err)
		}
	})
	t.Run("truncated shard", func(t *testing.T) {
		dir := t.TempDir()
		path := writeSet(t, dir)
		shard := filepath.Join(dir, "model-00001-of-00002.safetensors")
		data, err := os.ReadFile(shard)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(shard, data[:len(data)-1], 0o644); err != nil {
			t.Fatal(err)
		}
		s, err := OpenIndex(path)
		if err != nil {
			t.Fatalf("stat-only open failed: %v", err)
		}
		defer s.Close()
		if _, err := s.Tensor("c"); err != nil {
			t.Errorf("intact shard: %v", err)
		}
		_, err = s.Tensor("a")
		if err == nil || !strings.Contains(err.Error(), `tensor "a"`) || !strings.Contains(err.Error(), shard) {
			t.Errorf("error %v", err)
		}
	})
	t.Run("closed", func(t *testing.T) {
		s, err := OpenIndex(writeSet(t, t.TempDir()))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.Tensor("a"); err != nil {
			t.Fatal(err)
		}
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Tensor("c"); err == nil || !strings.Contains(err.Error(), "closed") {
			t.Errorf("Tensor after Close: %v", err)
		}
	})
}

func TestParseIndexErrors(t *testing.T) {
	tests := []struct{ index, want string }{
		{`{"metadata": {}}`, "no weight_map"},
		{`{"weight_map": {}}`, "empty weight_map"},
		{`{"weight_map": null}`, "not a JSON object"},
		{`{"weight_map": {"a": 3}}`, `tensor "a": shard is not a string`},
		{`{"weight_map": {"a": "../x.safetensors"}}`, `tensor "a": shard "../x.safetensors" is not a plain file name`},
		{`{"weight_map": {"a": "/etc/passwd"}}`, "not a plain file name"},
		{`{"weight_map": {"a": ".."}}`, "not a plain file name"},
		{`{"weight_map": {"a": "x", "a": "y"}}`, `duplicate key "a"`},
		{`{"weight_map": {"a": "x"}, "weight_map": {"a": "x"}}`, `duplicate key "weight_map"`},
		{`{"weight_map": {"a": "x"}`, "invalid JSON"},
	}
	for _, tt := range tests {
		_, err := ParseIndex([]byte(tt.index))
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("ParseIndex(%s) error %v, want one containing %q", tt.index, err, tt.want)
		}
	}
}

func FuzzParseIndex(f *testing.F) {
	f.Add([]byte(`{"metadata": {"total_size": 16}, "weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors"}}`))
	f.Add([]byte(`{"weight_map": {"a": "../m.safetensors"}}`))
	f.Add([]byte(`{"weight_map": {"a": "x", "a": "y"}}`))
	f.Add([]byte(`{"weight_map": {}}`))
	f.Add([]byte(`[`))
	f.Fuzz(func(t *testing.T, data []byte) {
		ix, err := ParseIndex(data)
		if err != nil {
			return
		}
		if len(ix.WeightMap) == 0 {
			t.Fatal("accepted an empty weight_map")
		}
		for name, shard := range ix.WeightMap {
			if shard == "" || filepath.Base(shard) != shard || shard == ".." || strings.ContainsAny(shard, `/\`) {
				t.Fatalf("tensor %q: accepted shard %q", name, shard)
			}
		}
	})
}

// Concurrent first uses of a shard map it once and all see the same data.
func TestSetConcurrent(t *testing.T) {
	s, err := OpenIndex(writeSet(t, t.TempDir()))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for i := range 16 {
		wg.Go(func() {
			name := []string{"a", "b", "c"}[i%3]
			tt, err := s.Tensor(name)
			if err == nil && len(tt.Data) == 0 {
				err = errors.New("empty data")
			}
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if got := s.Opened(); len(got) != 2 {
		t.Errorf("Opened = %v", got)
	}
}
