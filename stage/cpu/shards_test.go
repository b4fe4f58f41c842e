package cpu_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/randinit"
	"github.com/tandem-llm/tandem/stage/cpu"
)

// TestStageMapsOnlyItsShards loads a middle stage from a sharded checkpoint
// and checks that exactly the shards holding its layers were mapped: a
// stage never touches shards it does not need.
func TestStageMapsOnlyItsShards(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "m")
	o := randinit.DefaultOptions()
	o.Layers = 6
	o.ShardBytes = 48 << 10 // about one shard per layer
	if err := randinit.Write(dir, o); err != nil {
		t.Fatal(err)
	}
	ckpt, err := model.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ckpt.Close()
	st, err := cpu.New(cpu.Config{Model: ckpt.Config(), Lo: 2, Hi: 4, Weights: ckpt, MaxTokens: 8, MaxSeqs: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()

	// The shards that hold layers 2 and 3, from the index itself.
	data, err := os.ReadFile(filepath.Join(dir, "model.safetensors.index.json"))
	if err != nil {
		t.Fatal(err)
	}
	var ix struct {
		WeightMap map[string]string `json:"weight_map"`
	}
	if err := json.Unmarshal(data, &ix); err != nil {
		t.Fatal(err)
	}
	need, all := map[string]bool{}, map[string]bool{}
	for name, shard := range ix.WeightMap {
		all[shard] = true
		for _, l := range []int{2, 3} {
			if strings.HasPrefix(name, model.LayerTensor(l, "")) {
				need[shard] = true
			}
		}
	}
	var want []string
	for s := range need {
		want = append(want, s)
	}
	sort.Strings(want)
	if len(want) == 0 || len(want) >= len(all) {
		t.Fatalf("layers 2-3 live in %d of %d shards: the test does not exercise laziness", len(want), len(all))
	}
	if got := ckpt.Mapped(); !slices.Equal(got, want) {
		t.Errorf("stage of layers 2-3 mapped %v, want exactly %v", got, want)
	}
}
