package model

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"slices"
)

// GenerationConfigName is the file of a checkpoint's generation defaults.
const GenerationConfigName = "generation_config.json"

// GenerationConfig is the sampling a checkpoint's authors recommend, read
// from generation_config.json: the defaults of a request that leaves them
// unset (the request always wins). A nil field is not set by the file.
//
// As in vLLM, do_sample is not interpreted: a temperature set here applies
// whatever do_sample says, and a request that wants greedy decoding sets
// temperature 0.
type GenerationConfig struct {
	Temperature *float64
	TopP        *float64
	TopK        *int // 0: no top-k cut
	// EOS are the ids that end generation (eos_token_id: an id or a
	// list); nil when the file does not set them.
	EOS []int
}

// rawGenerationConfig mirrors the fields read; raw messages tell absent and
// null apart.
type rawGenerationConfig struct {
	Temperature json.RawMessage `json:"temperature"`
	TopP        json.RawMessage `json:"top_p"`
	TopK        json.RawMessage `json:"top_k"`
	EOS         json.RawMessage `json:"eos_token_id"`
}

// LoadGenerationConfig reads dir/generation_config.json; a checkpoint
// without one has no defaults (an empty config, no error). vocab bounds the
// token ids.
func LoadGenerationConfig(dir string, vocab int) (*GenerationConfig, error) {
	path := filepath.Join(dir, GenerationConfigName)
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return &GenerationConfig{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("load generation config: %w", err)
	}
	g, err := ParseGenerationConfig(data, vocab)
	if err != nil {
		return nil, fmt.Errorf("load generation config %s: %w", path, err)
	}
	return g, nil
}

// ParseGenerationConfig parses the contents of a generation_config.json:
// temperature (a finite number ≥ 0), top_p (in (0, 1]), top_k (≥ 0; -1, as
// some files write "no cut", reads as 0) and eos_token_id (an id or a list
// of ids in [0, vocab)). Other fields are ignored; a field of the wrong
// type or range is an error naming it.
func ParseGenerationConfig(data []byte, vocab int) (*GenerationConfig, error) {
	var r rawGenerationConfig
	if err := json.Unmarshal(data, &r); err != nil {
		return nil, fmt.Errorf("parse generation config: %w", err)
	}
	g := &GenerationConfig{}
	fail := func(field string, raw json.RawMessage, want string) error {
		return fmt.Errorf("parse generation config: %s: %s is not %s", field, raw, want)
	}
	if !isNull(r.Temperature) {
		var t float64
		if err := json.Unmarshal(r.Temperature, &t); err != nil || t < 0 || math.IsInf(t, 0) {
			return nil, fail("temperature", r.Temperature, "a number ≥ 0")
		}
		g.Temperature = &t
	}
	if !isNull(r.TopP) {
		var p float64
		if err := json.Unmarshal(r.TopP, &p); err != nil || p <= 0 || p > 1 {
			return nil, fail("top_p", r.TopP, "a number in (0, 1]")
		}
		g.TopP = &p
	}
	if !isNull(r.TopK) {
		var k int
		if err := json.Unmarshal(r.TopK, &k); err != nil || k < -1 {
			return nil, fail("top_k", r.TopK, "an integer ≥ 0")
		}
		k = max(k, 0)
		g.TopK = &k
	}
	if !isNull(r.EOS) {
		var one int
		if err := json.Unmarshal(r.EOS, &one); err == nil {
			g.EOS = []int{one}
		} else if err := json.Unmarshal(r.EOS, &g.EOS); err != nil {
			return nil, fail("eos_token_id", r.EOS, "a token id or a list of them")
		}
		for _, id := range g.EOS {
			if id < 0 || id >= vocab {
				return nil, fmt.Errorf("parse generation config: eos_token_id: %d is outside the vocabulary of %d", id, vocab)
			}
		}
	}
	return g, nil
}

// EOSIDs are the ids that end generation: config.json's eos_token_id and
// generation_config.json's, together (as vLLM joins them), in ascending
// order.
func EOSIDs(c *Config, g *GenerationConfig) []int {
	ids := slices.Clone(c.EOS)
	if g != nil {
		ids = append(ids, g.EOS...)
	}
	slices.Sort(ids)
	return slices.Compact(ids)
}
