package model

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func ptr[T any](v T) *T { return &v }

func TestParseGenerationConfig(t *testing.T) {
	for _, c := range []struct {
		json string
		want GenerationConfig
	}{
		{`{}`, GenerationConfig{}},
		// Llama 3.1 Instruct's file, as shipped.
		{`{"bos_token_id": 128000, "do_sample": true, "eos_token_id": [128001, 128008, 128009], "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.42.3"}`,
			GenerationConfig{Temperature: ptr(0.6), TopP: ptr(0.9), EOS: []int{128001, 128008, 128009}}},
		// Qwen2.5 Instruct's.
		{`{"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": true, "eos_token_id": [151645, 151643], "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20}`,
			GenerationConfig{Temperature: ptr(0.7), TopP: ptr(0.8), TopK: ptr(20), EOS: []int{151645, 151643}}},
		{`{"eos_token_id": 2, "temperature": null, "top_k": -1}`, GenerationConfig{TopK: ptr(0), EOS: []int{2}}},
		{`{"temperature": 0, "top_p": 1}`, GenerationConfig{Temperature: ptr(0.0), TopP: ptr(1.0)}},
	} {
		g, err := ParseGenerationConfig([]byte(c.json), 200000)
		if err != nil {
			t.Errorf("%s: %v", c.json, err)
			continue
		}
		if !reflect.DeepEqual(*g, c.want) {
			t.Errorf("%s: got %+v, want %+v", c.json, *g, c.want)
		}
	}
	for bad, field := range map[string]string{
		`[]`:                        "parse generation config",
		`{"temperature": -1}`:       "temperature",
		`{"temperature": "hot"}`:    "temperature",
		`{"top_p": 0}`:              "top_p",
		`{"top_p": 1.5}`:            "top_p",
		`{"top_k": 2.5}`:            "top_k",
		`{"top_k": -2}`:             "top_k",
		`{"eos_token_id": "x"}`:     "eos_token_id",
		`{"eos_token_id": [1, -1]}`: "eos_token_id",
		`{"eos_token_id": 200000}`:  "eos_token_id: 200000 is outside the vocabulary of 200000",
	} {
		if _, err := ParseGenerationConfig([]byte(bad), 200000); err == nil || !strings.Contains(err.Error(), field) {
			t.Errorf("%s: got %v, want an error naming %s", bad, err, field)
		}
	}
}

func TestLoadGenerationConfig(t *testing.T) {
	dir := t.TempDir()
	g, err := LoadGenerationConfig(dir, 10)
	if err != nil || !reflect.DeepEqual(*g, GenerationConfig{}) {
		t.Fatalf("no file: %+v, %v", g, err)
	}
	if err := os.WriteFile(filepath.Join(dir, GenerationConfigName), []byte(`{"eos_token_id": 3, "temperature": 0.5}`), 0o644); err != nil {
		t.Fatal(err)
	}
	g, err = LoadGenerationConfig(dir, 10)
	if err != nil || !reflect.DeepEqual(*g, GenerationConfig{Temperature: ptr(0.5), EOS: []int{3}}) {
		t.Fatalf("file: %+v, %v", g, err)
	}
	if err := os.WriteFile(filepath.Join(dir, GenerationConfigName), []byte(`{"eos_token_id": 30}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadGenerationConfig(dir, 10); err == nil || !strings.Contains(err.Error(), GenerationConfigName) {
		t.Fatalf("bad file: %v", err)
	}
}

// FuzzParseGenerationConfig: untrusted bytes parse or fail, never panic,
// and what parses is in range.
func FuzzParseGenerationConfig(f *testing.F) {
	f.Add([]byte(`{"eos_token_id": [1, 2], "temperature": 0.6, "top_p": 0.9, "top_k": 20}`))
	f.Add([]byte(`{"eos_token_id": 1}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		g, err := ParseGenerationConfig(data, 100)
		if err != nil {
			return
		}
		if g.Temperature != nil && *g.Temperature < 0 || g.TopP != nil && (*g.TopP <= 0 || *g.TopP > 1) || g.TopK != nil && *g.TopK < 0 {
			t.Fatalf("out of range: %+v", g)
		}
		for _, id := range g.EOS {
			if id < 0 || id >= 100 {
				t.Fatalf("eos %d", id)
			}
		}
	})
}

func TestEOSIDs(t *testing.T) {
	c := &Config{EOS: []int{128009, 128001}}
	if got := EOSIDs(c, &GenerationConfig{EOS: []int{128001, 128008, 128009}}); !reflect.DeepEqual(got, []int{128001, 128008, 128009}) {
		t.Errorf("union: %v", got)
	}
	if got := EOSIDs(c, nil); !reflect.DeepEqual(got, []int{128001, 128009}) {
		t.Errorf("config only: %v", got)
	}
	if !reflect.DeepEqual(c.EOS, []int{128009, 128001}) {
		t.Errorf("EOSIDs changed the config: %v", c.EOS)
	}
}
