package safetensors

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
)

// IndexName is the file name Hugging Face gives the index of a sharded
// checkpoint.
const IndexName = "model.safetensors.index.json"

// Index is a parsed model.safetensors.index.json.
type Index struct {
	// WeightMap maps each tensor name to the shard file holding it, a plain
	// file name in the index's directory.
	WeightMap map[string]string
}

// Shards lists the distinct shard files in sorted order.
func (ix *Index) Shards() []string {
	seen := map[string]bool{}
	var shards []string
	for _, s := range ix.WeightMap {
		if !seen[s] {
			seen[s] = true
			shards = append(shards, s)
		}
	}
	sort.Strings(shards)
	return shards
}

// ParseIndex parses and validates the JSON of an index: a "weight_map"
// object from tensor names to shard file names is required, each name a
// plain file name (no directory, so an index cannot point outside its
// directory); "metadata" is optional and not interpreted. Duplicate keys are
// rejected.
func ParseIndex(data []byte) (*Index, error) {
	var ix *Index
	err := decodeObject(data, func(key string, value json.RawMessage) error {
		if key != "weight_map" {
			return nil
		}
		ix = &Index{WeightMap: map[string]string{}}
		return decodeObject(value, func(name string, v json.RawMessage) error {
			var file string
			if err := json.Unmarshal(v, &file); err != nil {
				return fmt.Errorf("weight_map: tensor %q: shard is not a string", name)
			}
			if file == "" || file == "." || file == ".." || strings.ContainsAny(file, `/\`) {
				return fmt.Errorf("weight_map: tensor %q: shard %q is not a plain file name", name, file)
			}
			ix.WeightMap[name] = file
			return nil
		})
	})
	if err != nil {
		return nil, fmt.Errorf("index: %w", err)
	}
	if ix == nil {
		return nil, errors.New("index: no weight_map")
	}
	if len(ix.WeightMap) == 0 {
		return nil, errors.New("index: empty weight_map")
	}
	return ix, nil
}

// Set is a sharded checkpoint: an index and the shard files beside it.
// Opening a Set only stats the shards; each is mapped the first time one of
// its tensors is asked for, so a reader of a few layers never maps shards
// it does not need.
type Set struct {
	indexPath string
	dir       string
	index     *Index
	sizes     map[string]int64 // shard → size at open

	mu     sync.Mutex
	files  map[string]*File // mapped shards
	closed bool
}

// OpenIndex reads the index at path and checks that every shard it names
// exists as a regular file, without mapping any.
func OpenIndex(path string) (*Set, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("open safetensors index: %w", err)
	}
	ix, err := ParseIndex(data)
	if err != nil {
		return nil, fmt.Errorf("open safetensors index %s: %w", path, err)
	}
	s := &Set{
		indexPath: path,
		dir:       filepath.Dir(path),
		index:     ix,
		sizes:     map[string]int64{},
		files:     map[string]*File{},
	}
	for _, shard := range ix.Shards() {
		st, err := os.Stat(filepath.Join(s.dir, shard))
		if err != nil {
			return nil, fmt.Errorf("open safetensors index %s: shard %s: %w", path, shard, err)
		}
		if !st.Mode().IsRegular() {
			return nil, fmt.Errorf("open safetensors index %s: shard %s is not a regular file", path, shard)
		}
		s.sizes[shard] = st.Size()
	}
	return s, nil
}

// Index is the parsed index. It must not be modified.
func (s *Set) Index() *Index { return s.index }

// Names lists every tensor of the set in sorted order.
func (s *Set) Names() []string {
	names := make([]string, 0, len(s.index.WeightMap))
	for n := range s.index.WeightMap {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// Shards lists the shard file names in sorted order.
func (s *Set) Shards() []string { return s.index.Shards() }

// ShardSize is the size in bytes shard had when the set was opened.
func (s *Set) ShardSize(shard string) int64 { return s.sizes[shard] }

// ShardOf names the shard the index says holds tensor name.
func (s *Set) ShardOf(name string) (string, bool) {
	shard, ok := s.index.WeightMap[name]
	return shard, ok
}

// Opened lists, in sorted order, the shards mapped so far.
func (s *Set) Opened() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	opened := make([]string, 0, len(s.files))
	for shard := range s.files {
		opened = append(opened, shard)
	}
	sort.Strings(opened)
	return opened
}

// Tensor returns the tensor called name, mapping its shard if this is the
// first tensor asked of it. It is an error if the shard does not hold the
// tensor the index says it does.
func (s *Set) Tensor(name string) (*Tensor, error) {
	shard, ok := s.index.WeightMap[name]
	if !ok {
		return nil, fmt.Errorf("safetensors index %s: no tensor %q", s.indexPath, name)
	}
	f, err := s.shard(shard)
	if err != nil {
		return nil, fmt.Errorf("tensor %q: %w", name, err)
	}
	if !f.Has(name) {
		return nil, fmt.Errorf("tensor %q: index %s places it in shard %s, which does not hold it", name, s.indexPath, shard)
	}
	return f.Tensor(name)
}

// shard returns the mapped shard, mapping it on first use.
func (s *Set) shard(shard string) (*File, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, fmt.Errorf("safetensors index %s is closed", s.indexPath)
	}
	if f := s.files[shard]; f != nil {
		return f, nil
	}
	f, err := Open(filepath.Join(s.dir, shard))
	if err != nil {
		return nil, err
	}
	s.files[shard] = f
	return f, nil
}

// Close unmaps every mapped shard. Tensors obtained from the set must not be
// used after.
func (s *Set) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return fmt.Errorf("safetensors index %s: already closed", s.indexPath)
	}
	s.closed = true
	var errs []error
	for _, f := range s.files {
		errs = append(errs, f.Close())
	}
	s.files = nil
	return errors.Join(errs...)
}
