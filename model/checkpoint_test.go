package model_test

import (
	"encoding/binary"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/randinit"
	"github.com/tandem-llm/tandem/model/safetensors"
)

func write(t *testing.T, o randinit.Options) string {
	t.Helper()
	dir := t.TempDir()
	if err := randinit.Write(dir, o); err != nil {
		t.Fatal(err)
	}
	return dir
}

func open(t *testing.T, dir string) *model.Checkpoint {
	t.Helper()
	ck, err := model.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ck.Close() })
	return ck
}

func shardedOptions() randinit.Options {
	o := randinit.DefaultOptions()
	o.ShardBytes = 48 << 10 // layers are ~90 KiB, the embedding 64 KiB: 10 shards
	return o
}

func TestCheckpointSingle(t *testing.T) {
	for _, arch := range []string{"llama", "qwen2"} {
		t.Run(arch, func(t *testing.T) {
			o := randinit.DefaultOptions()
			o.Arch = arch
			o.Tied = arch == "qwen2"
			ck := open(t, write(t, o))
			cfg := ck.Config()
			if cfg.NumLayers != 4 || cfg.HiddenSize != 64 || cfg.VocabSize != 512 || cfg.HeadDim != 16 ||
				cfg.AttentionBias != (arch == "qwen2") || cfg.TieEmbedding != o.Tied {
				t.Fatalf("config %+v", *cfg)
			}
			if err := ck.CheckLayers(0, 4, true, true); err != nil {
				t.Fatal(err)
			}
			if got := ck.Mapped(); !slices.Equal(got, []string{model.WeightsName}) {
				t.Errorf("Mapped = %v", got)
			}
			q, err := ck.Tensor(model.LayerTensor(3, model.QProj))
			if err != nil {
				t.Fatal(err)
			}
			if q.DType != safetensors.BF16 || !slices.Equal(q.Shape, []int{64, 64}) {
				t.Errorf("q_proj %s %v", q.DType, q.Shape)
			}
			if _, err := ck.Tensor(model.LMHeadName); (err == nil) == o.Tied {
				t.Errorf("lm_head with tied=%v: %v", o.Tied, err)
			}
		})
	}
}

// shardsOf is the set of shards the index places names in.
func shardsOf(t *testing.T, dir string, names []string) []string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, safetensors.IndexName))
	if err != nil {
		t.Fatal(err)
	}
	ix, err := safetensors.ParseIndex(data)
	if err != nil {
		t.Fatal(err)
	}
	set := map[string]bool{}
	for _, n := range names {
		set[ix.WeightMap[n]] = true
	}
	var out []string
	for s := range set {
		out = append(out, s)
	}
	sort.Strings(out)
	return out
}

func TestCheckpointShardedLazy(t *testing.T) {
	dir := write(t, shardedOptions())
	ck := open(t, dir)
	if got := ck.Mapped(); len(got) != 0 {
		t.Fatalf("Open mapped %v", got)
	}
	if err := ck.CheckLayers(2, 4, false, true); err != nil {
		t.Fatal(err)
	}
	var needed []string
	for i := 2; i < 4; i++ {
		for _, s := range []string{model.InputNorm, model.PostNorm, model.QProj, model.KProj, model.VProj, model.OProj, model.GateProj, model.UpProj, model.DownProj} {
			needed = append(needed, model.LayerTensor(i, s))
		}
	}
	needed = append(needed, model.NormName, model.LMHeadName)
	want := shardsOf(t, dir, needed)
	if got := ck.Mapped(); !slices.Equal(got, want) {
		t.Errorf("Mapped = %v, want %v", got, want)
	}
	if all := shardsOf(t, dir, ck.Names()); len(want) >= len(all) {
		t.Errorf("layers 2-3 need %d of %d shards: the test does not exercise laziness", len(want), len(all))
	}
}

// Sharding changes the files but not the tensors.
func TestCheckpointShardedMatchesSingle(t *testing.T) {
	single := open(t, write(t, randinit.DefaultOptions()))
	sharded := open(t, write(t, shardedOptions()))
	if !slices.Equal(single.Names(), sharded.Names()) {
		t.Fatalf("names differ:\n%v\n%v", single.Names(), sharded.Names())
	}
	for _, n := range single.Names() {
		a, err := single.Tensor(n)
		if err != nil {
			t.Fatal(err)
		}
		b, err := sharded.Tensor(n)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(a.Data, b.Data) || !slices.Equal(a.Shape, b.Shape) {
			t.Errorf("tensor %s differs", n)
		}
	}
}

func TestCheckpointIdentity(t *testing.T) {
	o := randinit.DefaultOptions()
	a := open(t, write(t, o)).Identity()
	b := open(t, write(t, o)).Identity()
	if a != b || len(a) != 64 {
		t.Fatalf("same files, identities %q and %q", a, b)
	}
	o.Tied = true
	if c := open(t, write(t, o)).Identity(); c == a {
		t.Error("a different config has the same identity")
	}
	s1 := open(t, write(t, shardedOptions())).Identity()
	s2 := open(t, write(t, shardedOptions())).Identity()
	if s1 != s2 || s1 == a {
		t.Errorf("sharded identities %q %q (single %q)", s1, s2, a)
	}
}

// rewriteHeader edits the JSON header of a safetensors file in place.
func rewriteHeader(t *testing.T, path string, edit func(h map[string]map[string]any)) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	n := binary.LittleEndian.Uint64(data)
	var h map[string]map[string]any
	if err := json.Unmarshal(data[8:8+n], &h); err != nil {
		t.Fatal(err)
	}
	edit(h)
	js, err := json.Marshal(h)
	if err != nil {
		t.Fatal(err)
	}
	out := binary.LittleEndian.AppendUint64(nil, uint64(len(js)))
	out = append(append(out, js...), data[8+n:]...)
	if err := os.WriteFile(path, out, 0o644); err != nil {
		t.Fatal(err)
	}
}

func editJSON(t *testing.T, path string, edit func(m map[string]any)) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(data, &m); err != nil {
		t.Fatal(err)
	}
	edit(m)
	if data, err = json.Marshal(m); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestCheckpointCorrupt(t *testing.T) {
	q0 := model.LayerTensor(0, model.QProj)
	k0 := model.LayerTensor(0, model.KProj)
	tests := []struct {
		name    string
		sharded bool
		corrupt func(t *testing.T, dir string)
		// openErr: Open fails; otherwise CheckLayers(0, 4, true, true) does.
		openErr bool
		want    []string
	}{
		{"truncated shard", true, func(t *testing.T, dir string) {
			p := filepath.Join(dir, shardsOf(t, dir, []string{model.LMHeadName})[0])
			st, err := os.Stat(p)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.Truncate(p, st.Size()-10); err != nil {
				t.Fatal(err)
			}
		}, false, []string{"model-00010-of-00010.safetensors", model.LMHeadName, "beyond the", "data section"}},
		{"overlapping offsets", false, func(t *testing.T, dir string) {
			rewriteHeader(t, filepath.Join(dir, model.WeightsName), func(h map[string]map[string]any) {
				q := h[q0]["data_offsets"].([]any)
				k := h[k0]["data_offsets"].([]any)
				size := k[1].(float64) - k[0].(float64)
				h[k0]["data_offsets"] = []any{q[0], q[0].(float64) + size}
			})
		}, true, []string{model.WeightsName, q0, k0, "overlaps"}},
		{"unknown dtype", false, func(t *testing.T, dir string) {
			rewriteHeader(t, filepath.Join(dir, model.WeightsName), func(h map[string]map[string]any) {
				h[k0]["dtype"] = "Q4_K"
			})
		}, true, []string{model.WeightsName, k0, `unknown dtype "Q4_K"`}},
		{"integer dtype", false, func(t *testing.T, dir string) {
			rewriteHeader(t, filepath.Join(dir, model.WeightsName), func(h map[string]map[string]any) {
				h[k0]["dtype"] = "I16"
			})
		}, false, []string{model.WeightsName, k0, "dtype I16"}},
		{"index names a missing file", true, func(t *testing.T, dir string) {
			editJSON(t, filepath.Join(dir, safetensors.IndexName), func(m map[string]any) {
				m["weight_map"].(map[string]any)[k0] = "model-00009-of-00009.safetensors"
			})
		}, true, []string{safetensors.IndexName, "model-00009-of-00009.safetensors", "no such file"}},
		{"tensor missing from shard", true, func(t *testing.T, dir string) {
			editJSON(t, filepath.Join(dir, safetensors.IndexName), func(m map[string]any) {
				m["weight_map"].(map[string]any)[model.EmbedName] = "model-00010-of-00010.safetensors"
			})
		}, false, []string{model.EmbedName, "model-00010-of-00010.safetensors", "does not hold it"}},
		{"shape mismatch", true, func(t *testing.T, dir string) {
			editJSON(t, filepath.Join(dir, model.ConfigName), func(m map[string]any) { m["intermediate_size"] = 128 })
		}, false, []string{model.LayerTensor(0, model.GateProj), "model-0000", "shape [172 64]", "implies [128 64]"}},
		{"untied config, tied weights", false, func(t *testing.T, dir string) {
			editJSON(t, filepath.Join(dir, model.ConfigName), func(m map[string]any) { m["tie_word_embeddings"] = false })
			if err := os.Remove(filepath.Join(dir, model.WeightsName)); err != nil {
				t.Fatal(err)
			}
			o := randinit.DefaultOptions()
			o.Tied = true
			tmp := t.TempDir()
			if err := randinit.Write(tmp, o); err != nil {
				t.Fatal(err)
			}
			if err := os.Rename(filepath.Join(tmp, model.WeightsName), filepath.Join(dir, model.WeightsName)); err != nil {
				t.Fatal(err)
			}
		}, false, []string{model.WeightsName, `no tensor "lm_head.weight"`}},
		{"bad config", false, func(t *testing.T, dir string) {
			editJSON(t, filepath.Join(dir, model.ConfigName), func(m map[string]any) { m["num_key_value_heads"] = 3 })
		}, true, []string{model.ConfigName, "num_key_value_heads"}},
		{"no weights", false, func(t *testing.T, dir string) {
			if err := os.Remove(filepath.Join(dir, model.WeightsName)); err != nil {
				t.Fatal(err)
			}
		}, true, []string{"no model.safetensors", safetensors.IndexName}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := randinit.DefaultOptions()
			if tt.sharded {
				o = shardedOptions()
			}
			dir := write(t, o)
			tt.corrupt(t, dir)
			ck, err := model.Open(dir)
			if !tt.openErr {
				if err != nil {
					t.Fatalf("Open: %v", err)
				}
				defer ck.Close()
				err = ck.CheckLayers(0, 4, true, true)
			} else if err == nil {
				ck.Close()
			}
			if err == nil {
				t.Fatal("no error")
			}
			t.Log(err)
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
		})
	}
}

func TestCheckLayersRange(t *testing.T) {
	ck := open(t, write(t, randinit.DefaultOptions()))
	for _, r := range [][2]int{{-1, 2}, {0, 5}, {3, 2}} {
		if err := ck.CheckLayers(r[0], r[1], false, false); err == nil || !strings.Contains(err.Error(), "outside the model's 4 layers") {
			t.Errorf("CheckLayers(%d, %d): %v", r[0], r[1], err)
		}
	}
	if err := ck.CheckLayers(4, 4, false, true); err != nil {
		t.Errorf("head-only stage: %v", err)
	}
}
