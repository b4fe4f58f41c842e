package randinit

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"sync"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/safetensors"
)

// Standard deviations of the random weights.
const (
	initStd = 0.02 // projections, embeddings and biases, as transformers initialises them
	normStd = 0.1  // noise around 1 on norm weights, so a norm that is skipped shows
)

// The sampling defaults generation_config.json recommends, as instruct
// checkpoints ship them (a request that sets its own wins).
const (
	GenTemperature = 0.6
	GenTopP        = 0.9
	GenTopK        = 50
)

// transformersVersion is the version the written JSON files claim.
const transformersVersion = "5.0.0"

// Write writes a random checkpoint described by o into dir, creating it if
// needed: config.json, generation_config.json, tokenizer.json,
// tokenizer_config.json and the weights (model.safetensors, or shards and
// model.safetensors.index.json). Weight files left in dir by an earlier
// Write are removed first. The output depends only on o: the same options
// give byte-identical files.
func Write(dir string, o Options) error {
	o, err := o.resolve()
	if err != nil {
		return fmt.Errorf("randinit: %w", err)
	}
	tok, err := newTokenizer(o.Vocab)
	if err != nil {
		return fmt.Errorf("randinit: %w", err)
	}
	cfg, err := configJSON(o, tok.bos(), tok.eos())
	if err != nil {
		return fmt.Errorf("randinit: config.json: %w", err)
	}
	// The config must read back as what was asked for.
	if _, err := model.ParseConfig(cfg); err != nil {
		return fmt.Errorf("randinit: generated config.json: %w", err)
	}
	tj, err := tok.tokenizerJSON()
	if err != nil {
		return fmt.Errorf("randinit: tokenizer.json: %w", err)
	}
	tcj, err := tok.tokenizerConfigJSON(o.MaxPositions)
	if err != nil {
		return fmt.Errorf("randinit: tokenizer_config.json: %w", err)
	}
	gen, err := marshalIndent(map[string]any{
		"bos_token_id":         tok.bos(),
		"do_sample":            true,
		"eos_token_id":         []int{tok.eos()},
		"temperature":          GenTemperature,
		"top_k":                GenTopK,
		"top_p":                GenTopP,
		"transformers_version": transformersVersion,
	})
	if err != nil {
		return fmt.Errorf("randinit: generation_config.json: %w", err)
	}

	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("randinit: %w", err)
	}
	if err := removeWeights(dir); err != nil {
		return fmt.Errorf("randinit: %w", err)
	}
	for _, f := range []struct {
		name string
		data []byte
	}{
		{model.ConfigName, cfg},
		{model.GenerationConfigName, gen},
		{"tokenizer.json", tj},
		{"tokenizer_config.json", tcj},
	} {
		if err := os.WriteFile(filepath.Join(dir, f.name), f.data, 0o644); err != nil {
			return fmt.Errorf("randinit: %w", err)
		}
	}
	if err := writeWeights(dir, o); err != nil {
		return fmt.Errorf("randinit: %w", err)
	}
	return nil
}

// removeWeights deletes the weight files an earlier Write may have left.
func removeWeights(dir string) error {
	old, err := filepath.Glob(filepath.Join(dir, "model-*-of-*.safetensors"))
	if err != nil {
		return err
	}
	old = append(old, filepath.Join(dir, model.WeightsName), filepath.Join(dir, safetensors.IndexName))
	for _, p := range old {
		if err := os.Remove(p); err != nil && !os.IsNotExist(err) {
			return err
		}
	}
	return nil
}

// configJSON is config.json as transformers 5 writes it.
func configJSON(o Options, bos, eos int) ([]byte, error) {
	theta, eps := 500000.0, 1e-5
	arch, modelType := model.ArchLlama, "llama"
	if o.Arch == "qwen2" {
		theta, eps = 1000000.0, 1e-6
		arch, modelType = model.ArchQwen2, "qwen2"
	}
	rope := map[string]any{"rope_theta": theta, "rope_type": "default"}
	if o.RopeScaling {
		rope = map[string]any{
			"rope_theta":                       theta,
			"rope_type":                        "llama3",
			"factor":                           8.0,
			"low_freq_factor":                  1.0,
			"high_freq_factor":                 4.0,
			"original_max_position_embeddings": max(o.MaxPositions/4, 1),
		}
	}
	c := map[string]any{
		"architectures":           []string{string(arch)},
		"model_type":              modelType,
		"attention_dropout":       0.0,
		"bos_token_id":            bos,
		"eos_token_id":            eos,
		"dtype":                   dtypes[o.DType].config,
		"head_dim":                o.HeadDim,
		"hidden_act":              "silu",
		"hidden_size":             o.Hidden,
		"initializer_range":       initStd,
		"intermediate_size":       o.Intermediate,
		"max_position_embeddings": o.MaxPositions,
		"num_attention_heads":     o.Heads,
		"num_hidden_layers":       o.Layers,
		"num_key_value_heads":     o.KVHeads,
		"rms_norm_eps":            eps,
		"rope_parameters":         rope,
		"tie_word_embeddings":     o.Tied,
		"transformers_version":    transformersVersion,
		"use_cache":               true,
		"vocab_size":              o.Vocab,
	}
	if o.Arch == "qwen2" {
		layerTypes := make([]string, o.Layers)
		for i := range layerTypes {
			layerTypes[i] = "full_attention"
		}
		c["use_sliding_window"] = false
		c["sliding_window"] = nil
		c["max_window_layers"] = o.Layers
		c["layer_types"] = layerTypes
	} else {
		c["attention_bias"] = false
		c["mlp_bias"] = false
		c["pretraining_tp"] = 1
	}
	return marshalIndent(c)
}

// initKind says how a tensor is initialised.
type initKind int

const (
	initNormal initKind = iota // N(0, initStd)
	initNorm                   // 1 + N(0, normStd)
)

type tensorSpec struct {
	name  string
	shape []int
	kind  initKind
}

// tensors lists the checkpoint's tensors in the order transformers
// registers them: embedding, layers, final norm, LM head.
func tensors(o Options) []tensorSpec {
	h, q, kv, inter := o.Hidden, o.Heads*o.HeadDim, o.KVHeads*o.HeadDim, o.Intermediate
	ts := []tensorSpec{{model.EmbedName, []int{o.Vocab, h}, initNormal}}
	for i := 0; i < o.Layers; i++ {
		l := func(suffix string, kind initKind, shape ...int) tensorSpec {
			return tensorSpec{model.LayerTensor(i, suffix), shape, kind}
		}
		ts = append(ts, l(model.QProj, initNormal, q, h))
		if o.Arch == "qwen2" {
			ts = append(ts, l(model.QBias, initNormal, q))
		}
		ts = append(ts, l(model.KProj, initNormal, kv, h))
		if o.Arch == "qwen2" {
			ts = append(ts, l(model.KBias, initNormal, kv))
		}
		ts = append(ts, l(model.VProj, initNormal, kv, h))
		if o.Arch == "qwen2" {
			ts = append(ts, l(model.VBias, initNormal, kv))
		}
		ts = append(ts,
			l(model.OProj, initNormal, h, q),
			l(model.GateProj, initNormal, inter, h),
			l(model.UpProj, initNormal, inter, h),
			l(model.DownProj, initNormal, h, inter),
			l(model.InputNorm, initNorm, h),
			l(model.PostNorm, initNorm, h),
		)
	}
	ts = append(ts, tensorSpec{model.NormName, []int{h}, initNorm})
	if !o.Tied {
		ts = append(ts, tensorSpec{model.LMHeadName, []int{o.Vocab, h}, initNormal})
	}
	return ts
}

// chunkElems is how many elements one PCG stream draws.
const chunkElems = 1 << 16

// writeTensor is the safetensors entry of spec. Its values come in chunks of
// chunkElems, each drawn from a PCG stream keyed by the seed, the tensor's
// name and the chunk's index, so a tensor's values do not depend on
// sharding or on the other tensors, and chunks are drawn in parallel.
func writeTensor(spec tensorSpec, o Options) safetensors.WriteTensor {
	dt := dtypes[o.DType].st
	n := 1
	for _, d := range spec.shape {
		n *= d
	}
	fill := func(buf []byte, c int) []byte {
		h := fnv.New64a()
		h.Write([]byte(spec.name))
		h.Write(binary.LittleEndian.AppendUint64(nil, uint64(c)))
		r := rand.New(rand.NewPCG(o.Seed, h.Sum64()))
		for i := c * chunkElems; i < min(n, (c+1)*chunkElems); i++ {
			z := r.NormFloat64()
			v := float32(z * initStd)
			if spec.kind == initNorm {
				v = float32(1 + z*normStd)
			}
			switch dt {
			case safetensors.BF16:
				buf = binary.LittleEndian.AppendUint16(buf, safetensors.Float32ToBF16(v))
			case safetensors.F16:
				buf = binary.LittleEndian.AppendUint16(buf, safetensors.Float32ToF16(v))
			default:
				buf = binary.LittleEndian.AppendUint32(buf, math.Float32bits(v))
			}
		}
		return buf
	}
	return safetensors.WriteTensor{
		Name:  spec.name,
		DType: dt,
		Shape: spec.shape,
		Stream: func(w io.Writer) error {
			chunks := (n + chunkElems - 1) / chunkElems
			bufs := make([][]byte, min(runtime.GOMAXPROCS(0), chunks))
			for first := 0; first < chunks; first += len(bufs) {
				k := min(len(bufs), chunks-first)
				var wg sync.WaitGroup
				for j := range k {
					wg.Go(func() { bufs[j] = fill(bufs[j][:0], first+j) })
				}
				wg.Wait()
				for _, b := range bufs[:k] {
					if _, err := w.Write(b); err != nil {
						return err
					}
				}
			}
			return nil
		},
	}
}

// writeWeights writes model.safetensors, or shards and their index.
func writeWeights(dir string, o Options) error {
	var shards [][]safetensors.WriteTensor
	var cur []safetensors.WriteTensor
	var curBytes, total, params int64
	for _, spec := range tensors(o) {
		t := writeTensor(spec, o)
		n := t.Bytes()
		if o.ShardBytes > 0 && len(cur) > 0 && curBytes+n > o.ShardBytes {
			shards = append(shards, cur)
			cur, curBytes = nil, 0
		}
		cur = append(cur, t)
		curBytes += n
		total += n
		params += n / int64(t.DType.Size())
	}
	shards = append(shards, cur)
	if len(shards) == 1 {
		return writeFile(filepath.Join(dir, model.WeightsName), shards[0])
	}
	weightMap := map[string]string{}
	for i, ts := range shards {
		name := fmt.Sprintf("model-%05d-of-%05d.safetensors", i+1, len(shards))
		if err := writeFile(filepath.Join(dir, name), ts); err != nil {
			return err
		}
		for _, t := range ts {
			weightMap[t.Name] = name
		}
	}
	index, err := marshalIndent(map[string]any{
		"metadata":   map[string]any{"total_parameters": params, "total_size": total},
		"weight_map": weightMap,
	})
	if err != nil {
		return fmt.Errorf("%s: %w", safetensors.IndexName, err)
	}
	return os.WriteFile(filepath.Join(dir, safetensors.IndexName), index, 0o644)
}

// writeFile writes one safetensors file.
func writeFile(path string, ts []safetensors.WriteTensor) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := bufio.NewWriterSize(f, 1<<20)
	err = safetensors.Write(w, ts, map[string]string{"format": "pt"})
	if err == nil {
		err = w.Flush()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}
