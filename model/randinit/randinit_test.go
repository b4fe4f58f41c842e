package randinit

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"strings"
	"testing"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/safetensors"
)

func writeDir(t *testing.T, o Options) string {
	t.Helper()
	dir := t.TempDir()
	if err := Write(dir, o); err != nil {
		t.Fatal(err)
	}
	return dir
}

// readDir maps file name to contents.
func readDir(t *testing.T, dir string) map[string][]byte {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	files := map[string][]byte{}
	for _, e := range entries {
		data, err := os.ReadFile(filepath.Join(dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		files[e.Name()] = data
	}
	return files
}

func TestDeterministic(t *testing.T) {
	for _, shard := range []int64{0, 100 << 10} {
		o := DefaultOptions()
		o.ShardBytes = shard
		a, b := readDir(t, writeDir(t, o)), readDir(t, writeDir(t, o))
		if len(a) != len(b) || len(a) < 5 {
			t.Fatalf("shard %d: %d and %d files", shard, len(a), len(b))
		}
		for name, data := range a {
			if !bytes.Equal(data, b[name]) {
				t.Errorf("shard %d: %s differs between two writes", shard, name)
			}
		}
	}
	// Chunks are drawn in parallel; the result must not depend on how many
	// run at once. The embedding spans 3 chunks here.
	o := DefaultOptions()
	o.Layers, o.Vocab = 1, 2100
	prev := runtime.GOMAXPROCS(1)
	one := readDir(t, writeDir(t, o))
	runtime.GOMAXPROCS(4)
	four := readDir(t, writeDir(t, o))
	runtime.GOMAXPROCS(prev)
	if !bytes.Equal(one[model.WeightsName], four[model.WeightsName]) {
		t.Error("weights depend on GOMAXPROCS")
	}

	o = DefaultOptions()
	a := readDir(t, writeDir(t, o))
	o.Seed = 2
	b := readDir(t, writeDir(t, o))
	if bytes.Equal(a[model.WeightsName], b[model.WeightsName]) {
		t.Error("seeds 1 and 2 give the same weights")
	}
	if !bytes.Equal(a["tokenizer.json"], b["tokenizer.json"]) || !bytes.Equal(a["config.json"], b["config.json"]) {
		t.Error("the seed changed the tokenizer or the config")
	}
}

// stats returns the mean and standard deviation of a tensor's values.
func stats(t *testing.T, ck *model.Checkpoint, name string) (mean, std float64) {
	t.Helper()
	tt, err := ck.Tensor(name)
	if err != nil {
		t.Fatal(err)
	}
	v, err := tt.Float32()
	if err != nil {
		t.Fatal(err)
	}
	var s, s2 float64
	for _, x := range v {
		if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) {
			t.Fatalf("%s holds %g", name, x)
		}
		s += float64(x)
		s2 += float64(x) * float64(x)
	}
	n := float64(len(v))
	mean = s / n
	return mean, math.Sqrt(s2/n - mean*mean)
}

func TestReadBack(t *testing.T) {
	qwen := Options{Arch: "qwen2", Layers: 2, Hidden: 96, Heads: 6, KVHeads: 2, HeadDim: 32, Intermediate: 200,
		Vocab: 700, MaxPositions: 4096, Tied: true, RopeScaling: true, Seed: 7, DType: "f32"}
	f16 := DefaultOptions()
	f16.DType = "f16"
	tests := []struct {
		name string
		o    Options
		want model.Config
		dt   safetensors.DType
	}{
		{"default", DefaultOptions(), model.Config{
			Arch: model.ArchLlama, HiddenSize: 64, NumLayers: 4, NumHeads: 4, NumKVHeads: 2, HeadDim: 16,
			IntermediateSize: 172, VocabSize: 512, RMSNormEps: 1e-5, RopeTheta: 500000, MaxPositions: 2048,
			BOS: 510, EOS: []int{511}, DType: "bfloat16",
		}, safetensors.BF16},
		{"qwen2", qwen, model.Config{
			Arch: model.ArchQwen2, HiddenSize: 96, NumLayers: 2, NumHeads: 6, NumKVHeads: 2, HeadDim: 32,
			IntermediateSize: 200, VocabSize: 700, RMSNormEps: 1e-6, RopeTheta: 1e6, MaxPositions: 4096,
			RopeScaling:  &model.RopeScaling{Type: "llama3", Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositions: 1024},
			TieEmbedding: true, AttentionBias: true, BOS: 698, EOS: []int{699}, DType: "float32",
		}, safetensors.F32},
		{"f16", f16, model.Config{
			Arch: model.ArchLlama, HiddenSize: 64, NumLayers: 4, NumHeads: 4, NumKVHeads: 2, HeadDim: 16,
			IntermediateSize: 172, VocabSize: 512, RMSNormEps: 1e-5, RopeTheta: 500000, MaxPositions: 2048,
			BOS: 510, EOS: []int{511}, DType: "float16",
		}, safetensors.F16},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ck, err := model.Open(writeDir(t, tt.o))
			if err != nil {
				t.Fatal(err)
			}
			defer ck.Close()
			if got := ck.Config(); !reflect.DeepEqual(got, &tt.want) {
				t.Fatalf("config %+v, want %+v", *got, tt.want)
			}
			if err := ck.CheckLayers(0, tt.o.Layers, true, true); err != nil {
				t.Fatal(err)
			}
			for _, n := range ck.Names() {
				if tensor, _ := ck.Tensor(n); tensor.DType != tt.dt {
					t.Fatalf("%s is %s", n, tensor.DType)
				}
			}
			// N(0, 0.02) weights, 1 + N(0, 0.1) norms.
			for _, c := range []struct {
				name      string
				mean, std float64
			}{
				{model.EmbedName, 0, 0.02},
				{model.LayerTensor(1, model.DownProj), 0, 0.02},
				{model.LayerTensor(0, model.InputNorm), 1, 0.1},
			} {
				mean, std := stats(t, ck, c.name)
				if math.Abs(mean-c.mean) > 0.03 || math.Abs(std-c.std) > 0.25*c.std {
					t.Errorf("%s: mean %.4f std %.4f, want about %g and %g", c.name, mean, std, c.mean, c.std)
				}
			}
		})
	}
}

func TestSharded(t *testing.T) {
	o := DefaultOptions()
	o.ShardBytes = 100 << 10
	dir := writeDir(t, o)
	files := readDir(t, dir)
	if _, ok := files[model.WeightsName]; ok {
		t.Fatal("sharded write left model.safetensors")
	}
	ix, err := safetensors.ParseIndex(files[safetensors.IndexName])
	if err != nil {
		t.Fatal(err)
	}
	shards := ix.Shards()
	for i, s := range shards {
		if want := fmt.Sprintf("model-%05d-of-%05d.safetensors", i+1, len(shards)); s != want {
			t.Errorf("shard %d named %s, want %s", i, s, want)
		}
	}
	if len(shards) < 3 {
		t.Fatalf("%d shards", len(shards))
	}
	ck, err := model.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	var total int64
	for _, n := range ck.Names() {
		tensor, err := ck.Tensor(n)
		if err != nil {
			t.Fatal(err)
		}
		total += int64(len(tensor.Data))
	}
	var meta struct {
		Metadata struct {
			TotalSize int64 `json:"total_size"`
		} `json:"metadata"`
	}
	if err := json.Unmarshal(files[safetensors.IndexName], &meta); err != nil {
		t.Fatal(err)
	}
	if meta.Metadata.TotalSize != total {
		t.Errorf("index total_size %d, tensors hold %d bytes", meta.Metadata.TotalSize, total)
	}
	// Each shard stays under the limit (plus its header), unless it holds a
	// single larger tensor.
	for _, s := range shards {
		f, err := safetensors.Open(filepath.Join(dir, s))
		if err != nil {
			t.Fatal(err)
		}
		if size := int64(len(files[s])) - f.Header().DataOffset; size > o.ShardBytes && len(f.Names()) > 1 {
			t.Errorf("%s holds %d bytes in %d tensors", s, size, len(f.Names()))
		}
		f.Close()
	}

	// Writing unsharded into the same directory removes the shards.
	o.ShardBytes = 0
	if err := Write(dir, o); err != nil {
		t.Fatal(err)
	}
	for name := range readDir(t, dir) {
		if strings.HasPrefix(name, "model-") || name == safetensors.IndexName {
			t.Errorf("stale %s left behind", name)
		}
	}
}
