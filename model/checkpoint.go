package model

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"

	"github.com/tandem-llm/tandem/model/safetensors"
)

// WeightsName is the file name of a single-file checkpoint's weights.
const WeightsName = "model.safetensors"

// tensorSource is where a checkpoint's tensors come from: one mapped file or
// a lazily mapped sharded set.
type tensorSource interface {
	Tensor(name string) (*safetensors.Tensor, error)
	Names() []string
	Close() error
}

// Checkpoint is a Hugging Face checkpoint directory: config.json and
// safetensors weights, one file or shards behind an index.
type Checkpoint struct {
	dir      string
	config   *Config
	single   *safetensors.File // set for a single-file checkpoint
	set      *safetensors.Set  // set for a sharded one
	src      tensorSource
	identity string
}

// Open opens the checkpoint in dir: it parses config.json and opens
// model.safetensors (mapped at once) or, when there is none,
// model.safetensors.index.json (shards are only stat'ed here and mapped when
// first used).
func Open(dir string) (*Checkpoint, error) {
	cfgBytes, err := os.ReadFile(filepath.Join(dir, ConfigName))
	if err != nil {
		return nil, fmt.Errorf("open checkpoint: %w", err)
	}
	cfg, err := ParseConfig(cfgBytes)
	if err != nil {
		return nil, fmt.Errorf("open checkpoint %s: %s: %w", dir, ConfigName, err)
	}
	c := &Checkpoint{dir: dir, config: cfg}
	cache := hashCacheDir()
	h := sha256.New()
	writeField(h.Write, cfgBytes)

	single := filepath.Join(dir, WeightsName)
	if _, err := os.Stat(single); err == nil {
		f, err := safetensors.Open(single)
		if err != nil {
			return nil, fmt.Errorf("open checkpoint %s: %w", dir, err)
		}
		c.single, c.src = f, f
		d, err := fileDigest(single, cache)
		if err != nil {
			f.Close()
			return nil, fmt.Errorf("open checkpoint %s: %w", dir, err)
		}
		writeField(h.Write, d)
	} else if errors.Is(err, os.ErrNotExist) {
		indexPath := filepath.Join(dir, safetensors.IndexName)
		indexBytes, err := os.ReadFile(indexPath)
		if err != nil {
			return nil, fmt.Errorf("open checkpoint %s: no %s, and %w", dir, WeightsName, err)
		}
		s, err := safetensors.OpenIndex(indexPath)
		if err != nil {
			return nil, fmt.Errorf("open checkpoint %s: %w", dir, err)
		}
		c.set, c.src = s, s
		writeField(h.Write, indexBytes)
		for _, shard := range s.Shards() {
			d, err := fileDigest(filepath.Join(dir, shard), cache)
			if err != nil {
				s.Close()
				return nil, fmt.Errorf("open checkpoint %s: %w", dir, err)
			}
			writeField(h.Write, []byte(shard))
			writeField(h.Write, d)
		}
	} else {
		return nil, fmt.Errorf("open checkpoint %s: %w", dir, err)
	}
	c.identity = hex.EncodeToString(h.Sum(nil))
	return c, nil
}

// writeField hashes b prefixed with its length, so that field boundaries
// cannot shift between two different inputs.
func writeField(write func([]byte) (int, error), b []byte) {
	_, _ = write(binary.LittleEndian.AppendUint64(nil, uint64(len(b))))
	_, _ = write(b)
}

// Dir is the checkpoint's directory.
func (c *Checkpoint) Dir() string { return c.dir }

// Config is the parsed configuration. It must not be modified.
func (c *Checkpoint) Config() *Config { return c.config }

// Identity is a hex SHA-256 over config.json and the weights: the bytes of
// model.safetensors, or the index and each shard's name and bytes. Hosts
// holding the same files agree on it; another fine-tune, another random
// init or a corrupted byte gives another identity. Each weight file is read
// once to hash it (several cores at a time, see BenchmarkFileDigest) and
// its digest cached by absolute path, size and modification time under
// CacheDir("weights") ($TANDEM_CACHE_DIR, systemd's $CACHE_DIRECTORY or
// the user cache directory), so later opens read nothing: a file rewritten in place
// with the same size and modification time would keep its old digest.
func (c *Checkpoint) Identity() string { return c.identity }

// Names lists every tensor of the checkpoint in sorted order.
func (c *Checkpoint) Names() []string { return c.src.Names() }

// Tensor returns the tensor called name; for a sharded checkpoint this maps
// its shard on first use. The tensor's Data is valid until Close.
func (c *Checkpoint) Tensor(name string) (*safetensors.Tensor, error) {
	t, err := c.src.Tensor(name)
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", c.dir, err)
	}
	return t, nil
}

// Mapped lists the weight files mapped so far, in sorted order: the single
// file, or the shards whose tensors have been asked for.
func (c *Checkpoint) Mapped() []string {
	if c.single != nil {
		return []string{WeightsName}
	}
	return c.set.Opened()
}

// fileOf names the file holding tensor name, for error messages.
func (c *Checkpoint) fileOf(name string) string {
	if c.single != nil {
		return WeightsName
	}
	shard, _ := c.set.ShardOf(name)
	return shard
}

// Close unmaps the weights. Tensors obtained from the checkpoint must not be
// used after.
func (c *Checkpoint) Close() error {
	if err := c.src.Close(); err != nil {
		return fmt.Errorf("close checkpoint %s: %w", c.dir, err)
	}
	return nil
}

// CheckLayers checks that the checkpoint holds, with the shapes Config
// implies, every tensor a stage running layers [lo, hi) needs: each layer's
// norms, projections and (AttentionBias) q/k/v biases; the embedding when
// first; the final norm and the LM head (the embedding when tied) when
// last. Errors name the tensor, its file and both shapes.
func (c *Checkpoint) CheckLayers(lo, hi int, first, last bool) error {
	wants, err := c.stageTensors(lo, hi, first, last)
	if err != nil {
		return err
	}
	for _, w := range wants {
		t, err := c.Tensor(w.name)
		if err != nil {
			return err
		}
		if !slices.Equal(t.Shape, w.shape) {
			return fmt.Errorf("checkpoint %s: tensor %q in %s has shape %v, config.json implies %v", c.dir, w.name, c.fileOf(w.name), t.Shape, w.shape)
		}
	}
	return nil
}

// StageBytes is the size of the tensors a stage running layers [lo, hi)
// reads (those CheckLayers checks), as stored: what loading it reads, for
// a progress display.
func (c *Checkpoint) StageBytes(lo, hi int, first, last bool) (int64, error) {
	wants, err := c.stageTensors(lo, hi, first, last)
	if err != nil {
		return 0, err
	}
	var n int64
	for _, w := range wants {
		t, err := c.Tensor(w.name)
		if err != nil {
			return 0, err
		}
		n += int64(len(t.Data))
	}
	return n, nil
}

// tensorWant is a tensor a stage needs and the shape Config implies.
type tensorWant struct {
	name  string
	shape []int
}

// stageTensors lists the tensors a stage running layers [lo, hi) needs,
// each once.
func (c *Checkpoint) stageTensors(lo, hi int, first, last bool) ([]tensorWant, error) {
	cfg := c.config
	if lo < 0 || hi > cfg.NumLayers || lo > hi {
		return nil, fmt.Errorf("checkpoint %s: layer range [%d, %d) outside the model's %d layers", c.dir, lo, hi, cfg.NumLayers)
	}
	h, q, kv, inter, vocab := cfg.HiddenSize, cfg.QDim(), cfg.KVDim(), cfg.IntermediateSize, cfg.VocabSize
	var wants []tensorWant
	if first || last && cfg.TieEmbedding {
		wants = append(wants, tensorWant{EmbedName, []int{vocab, h}})
	}
	for i := lo; i < hi; i++ {
		wants = append(wants,
			tensorWant{LayerTensor(i, InputNorm), []int{h}},
			tensorWant{LayerTensor(i, QProj), []int{q, h}},
			tensorWant{LayerTensor(i, KProj), []int{kv, h}},
			tensorWant{LayerTensor(i, VProj), []int{kv, h}},
			tensorWant{LayerTensor(i, OProj), []int{h, q}},
			tensorWant{LayerTensor(i, PostNorm), []int{h}},
			tensorWant{LayerTensor(i, GateProj), []int{inter, h}},
			tensorWant{LayerTensor(i, UpProj), []int{inter, h}},
			tensorWant{LayerTensor(i, DownProj), []int{h, inter}},
		)
		if cfg.AttentionBias {
			wants = append(wants,
				tensorWant{LayerTensor(i, QBias), []int{q}},
				tensorWant{LayerTensor(i, KBias), []int{kv}},
				tensorWant{LayerTensor(i, VBias), []int{kv}},
			)
		}
	}
	if last {
		wants = append(wants, tensorWant{NormName, []int{h}})
		if !cfg.TieEmbedding {
			wants = append(wants, tensorWant{LMHeadName, []int{vocab, h}})
		}
	}
	return wants, nil
}
