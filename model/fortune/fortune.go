// Package fortune embeds tandem's own small trained model, so that the demo
// serves a model that writes readable text from a fresh clone or an
// installed binary, with nothing to download.
//
// The model is a 6-layer Llama (hidden 256, 5.5M parameters, bfloat16,
// tied embeddings) with a 4096-token byte-level BPE, trained on the fortune
// cookies of Debian's fortunes package (BSD licence). checkpoint/ holds it
// in exactly the Hugging Face layout (config.json, model.safetensors,
// tokenizer.json, tokenizer_config.json, generation_config.json) with its
// model card, README.md: data, licence, figures and the training command
// (scripts/train-fortune.sh). testdata/golden.json holds greedy
// continuations recorded from transformers in float32 when it was trained.
//
// Usage:
//
//	err := fortune.Write(dir) // the checkpoint's files into dir
//	ck, err := model.Open(dir)
//
// Concurrency: Write keeps no state; concurrent calls must use different
// directories.
package fortune

import (
	"embed"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

//go:embed checkpoint
var files embed.FS

// root is the checkpoint's folder inside files.
const root = "checkpoint"

// Name names the model in messages.
const Name = "fortune"

// Files lists the checkpoint's files in sorted order.
func Files() []string {
	entries, err := files.ReadDir(root)
	if err != nil {
		panic(err) // the embedded folder is there at build time
	}
	names := make([]string, len(entries))
	for i, e := range entries {
		names[i] = e.Name()
	}
	return names
}

// Size is the checkpoint's size in bytes.
func Size() int64 {
	var n int64
	for _, name := range Files() {
		fi, err := fs.Stat(files, root+"/"+name)
		if err != nil {
			panic(err)
		}
		n += fi.Size()
	}
	return n
}

// Write writes the checkpoint's files into dir, creating it.
func Write(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("write the %s model: %w", Name, err)
	}
	for _, name := range Files() {
		b, err := files.ReadFile(root + "/" + name)
		if err != nil {
			return fmt.Errorf("write the %s model: %w", Name, err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			return fmt.Errorf("write the %s model: %w", Name, err)
		}
	}
	return nil
}
