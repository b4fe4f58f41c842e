package placement

import (
	"fmt"
	"math"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/tandem-llm/tandem/model"
)

const gib = 1 << 30

// TestCostOf checks the weight bytes against the published parameter
// counts of two real checkpoints (tied embeddings, so the whole model is
// the embedding, the layers and the final norm).
func TestCostOf(t *testing.T) {
	tests := []struct {
		name   string
		cfg    model.Config
		params uint64
		kv     uint64 // bytes per token per layer at 2 bytes
	}{
		{"Llama-3.2-1B", model.Config{HiddenSize: 2048, NumLayers: 16, NumHeads: 32, NumKVHeads: 8, HeadDim: 64,
			IntermediateSize: 8192, VocabSize: 128256, TieEmbedding: true}, 1_235_814_400, 2 * 8 * 64 * 2},
		{"Qwen2-0.5B", model.Config{HiddenSize: 896, NumLayers: 24, NumHeads: 14, NumKVHeads: 2, HeadDim: 64,
			IntermediateSize: 4864, VocabSize: 151936, TieEmbedding: true, AttentionBias: true}, 494_032_768, 2 * 2 * 64 * 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := CostOf(&tt.cfg, 2)
			// One stage holding everything stores the tied matrix once.
			whole := c.fixed(true, true) + uint64(c.Layers)*c.LayerBytes
			if whole != 2*tt.params {
				t.Errorf("weights of one stage: %d bytes, want %d (2 × %d parameters)", whole, 2*tt.params, tt.params)
			}
			if c.KVBytesPerToken != tt.kv {
				t.Errorf("KV per token per layer %d, want %d", c.KVBytesPerToken, tt.kv)
			}
			// Split, the last stage holds its own copy of the head.
			split := c.fixed(true, false) + c.fixed(false, true) + uint64(c.Layers)*c.LayerBytes
			if want := whole + c.EmbedBytes; split != want {
				t.Errorf("weights over two stages %d, want %d", split, want)
			}
		})
	}
}

func TestWorkspace(t *testing.T) {
	cfg := model.Config{HiddenSize: 8, NumHeads: 2, NumKVHeads: 1, HeadDim: 4, IntermediateSize: 16, VocabSize: 100}
	// Per row: 3 × 8 + 8 (q) + 2 × 4 (k, v) + 2 × 16 = 72 floats.
	want := uint64(10*72*4 + 3*100*4 + 64<<20)
	if got := Workspace(&cfg, 10, 3); got != want {
		t.Errorf("Workspace = %d, want %d", got, want)
	}
}

// TestUsableKVTokens: every sequence of a full batch at the context
// length, each in whole blocks.
func TestUsableKVTokens(t *testing.T) {
	for _, tt := range []struct{ ctx, seqs, block, want int }{
		{4096, 8, 16, 8 * 4096},
		{17, 3, 16, 3 * 32},
		{2, 16, 16, 16 * 16},
	} {
		if got := UsableKVTokens(&model.Config{MaxPositions: tt.ctx}, tt.seqs, tt.block); got != tt.want {
			t.Errorf("context %d, %d sequences, blocks of %d: %d tokens, want %d", tt.ctx, tt.seqs, tt.block, got, tt.want)
		}
	}
}

// simple is a cost with round numbers: 1 GiB layers, 1 MiB of KV per
// token per layer.
func simple(layers int, embed, head uint64) Cost {
	return Cost{Layers: layers, LayerBytes: gib, EmbedBytes: embed, HeadBytes: head, KVBytesPerToken: 1 << 20}
}

func nodes(sizes ...uint64) []Node {
	ns := make([]Node, len(sizes))
	for i, s := range sizes {
		ns[i] = Node{Name: fmt.Sprintf("n%d", i), UsableBytes: s, Backend: "cuda"}
	}
	return ns
}

func counts(p Plan) []int {
	c := make([]int, len(p.Stages))
	for i, s := range p.Stages {
		c[i] = s.Hi - s.Lo
	}
	return c
}

func TestBalance(t *testing.T) {
	tests := []struct {
		name   string
		nodes  []Node
		cost   Cost
		counts []int
		kv     int
		left   []LeftOut
	}{
		{name: "equal nodes", nodes: nodes(40*gib, 40*gib, 40*gib, 40*gib), cost: simple(32, 0, 0), counts: []int{8, 8, 8, 8}, kv: 32 * 1024 / 8},
		// 10 layers over 3: the extra layer goes to the earlier stage.
		{name: "equal nodes, uneven", nodes: nodes(10*gib, 10*gib, 10*gib), cost: simple(10, 0, 0), counts: []int{4, 3, 3}, kv: 6 * 1024 / 4},
		// Capacity T with k layers needs k(1 GiB + T MiB): 8 GiB and 24 GiB
		// over 16 layers balance at 4 and 12 (T = 1024).
		{name: "big node gets more", nodes: nodes(8*gib, 24*gib), cost: simple(16, 0, 0), counts: []int{4, 12}, kv: 1024},
		// 6 GiB of embedding and of head take layers off the ends: 7 GiB
		// for KV over 7 layers, and 10 over 10 in the middle.
		{name: "first and last extras", nodes: nodes(20*gib, 20*gib, 20*gib), cost: simple(24, 6*gib, 6*gib), counts: []int{7, 10, 7}, kv: 1024},
		{name: "one node", nodes: nodes(20 * gib), cost: simple(8, 2*gib, 2*gib), counts: []int{8}, kv: 8 * 1024 / 8},
		{name: "one node, tied head", nodes: nodes(20 * gib), cost: Cost{Layers: 8, LayerBytes: gib, EmbedBytes: 2 * gib, HeadBytes: 2 * gib, Tied: true, KVBytesPerToken: 1 << 20},
			counts: []int{8}, kv: 10 * 1024 / 8},
		{name: "workspace", nodes: nodes(10*gib, 10*gib), cost: Cost{Layers: 4, LayerBytes: gib, WorkspaceBytes: 2 * gib, KVBytesPerToken: 1 << 20}, counts: []int{2, 2}, kv: 6 * 1024 / 2},
		// A node that cannot hold one layer (1 GiB and 1 MiB of KV) is left
		// out; the others hold the model.
		{name: "too small for a layer", nodes: nodes(10*gib, gib/2, 10*gib), cost: simple(4, 0, 0), counts: []int{2, 2}, kv: 8 * 1024 / 2,
			left: []LeftOut{{"n1", fmt.Sprintf("(middle stage) cannot hold one layer: has %d bytes usable, needs %d: short by %d", gib/2, gib+1<<20, gib/2+1<<20)}}},
		// First in name order, n0 would hold the 3 GiB embedding: it cannot
		// hold a layer besides it. n1 takes the first stage.
		{name: "too small for the embedding", nodes: nodes(3*gib, 10*gib, 10*gib), cost: simple(4, 3*gib, 0), counts: []int{2, 2}, kv: 5 * 1024 / 2,
			left: []LeftOut{{"n0", fmt.Sprintf("(first stage: embedding) cannot hold one layer: has %d bytes usable, needs %d: short by %d", 3*gib, 4*gib+1<<20, gib+1<<20)}}},
		// One node holds the whole model; its neighbours by name would be
		// the first and the last stage.
		{name: "one node holds it all", nodes: nodes(gib/2, 10*gib, gib/2), cost: simple(4, 0, 0), counts: []int{4}, kv: 6 * 1024 / 4,
			left: []LeftOut{
				{"n0", "(first stage: embedding) cannot hold one layer: has 536870912 bytes usable, needs 1074790400: short by 537919488"},
				{"n2", "(last stage: head) cannot hold one layer: has 536870912 bytes usable, needs 1074790400: short by 537919488"},
			}},
		// n1 holds one layer, with 512 tokens of KV cache (0.5 GiB): the
		// pipeline would hold at most that; without it, 768 (3 GiB of KV
		// over 4 layers on each end).
		{name: "small node would lower the capacity", nodes: nodes(8*gib, gib*3/2, 8*gib), cost: simple(8, gib, gib), counts: []int{4, 4}, kv: 768,
			left: []LeftOut{{"n1", "would lower the KV capacity: with one layer (middle stage) it holds 512 tokens, the pipeline 768 without it"}}},
		// With room for only 500 tokens in use, it lowers nothing that
		// counts: it takes part, and the ends take the rest as the memory
		// allows.
		{name: "small node within MaxKVTokens", nodes: nodes(8*gib, gib*3/2, 8*gib), cost: func() Cost { c := simple(8, gib, gib); c.MaxKVTokens = 500; return c }(),
			counts: []int{4, 1, 3}, kv: 512},
		// As large as the other two, n1 would hold a layer with more KV
		// cache than they: it takes part, at the same capacity.
		{name: "a tie takes more nodes", nodes: nodes(8*gib, 2*gib, 8*gib), cost: simple(8, gib, gib), counts: []int{4, 1, 3}, kv: 768},
		// Equal nodes, more than layers: the earliest names.
		{name: "not needed", nodes: nodes(10*gib, 10*gib, 10*gib, 10*gib), cost: simple(3, 0, 0), counts: []int{1, 1, 1}, kv: 9 * 1024,
			left: []LeftOut{{"n3", "is not needed: the model's 3 layers have a stage each"}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := Balance(tt.nodes, tt.cost)
			if err != nil {
				t.Fatal(err)
			}
			if got := counts(p); !reflect.DeepEqual(got, tt.counts) || p.KVTokens != tt.kv {
				t.Errorf("layers %v KV %d, want %v KV %d", got, p.KVTokens, tt.counts, tt.kv)
			}
			if !reflect.DeepEqual(p.LeftOut, tt.left) {
				t.Errorf("left out %q, want %q", p.LeftOut, tt.left)
			}
			checkPlan(t, p, tt.nodes, tt.cost)
		})
	}
}

func TestBalanceDeterministic(t *testing.T) {
	ns := []Node{{Name: "b", UsableBytes: 30 * gib}, {Name: "c", UsableBytes: 10 * gib}, {Name: "a", UsableBytes: 20 * gib}}
	want, err := Balance(ns, simple(20, gib, gib))
	if err != nil {
		t.Fatal(err)
	}
	if want.Stages[0].Node != "a" || want.Stages[1].Node != "b" || want.Stages[2].Node != "c" {
		t.Fatalf("stages not in name order: %+v", want.Stages)
	}
	for range 10 {
		rand.Shuffle(len(ns), func(i, j int) { ns[i], ns[j] = ns[j], ns[i] })
		got, err := Balance(ns, simple(20, gib, gib))
		if err != nil || !reflect.DeepEqual(got, want) {
			t.Fatalf("order %v: %+v %v, want %+v", ns, got, err, want)
		}
	}
}

func TestBalanceMoreNodesThanLayers(t *testing.T) {
	ns := []Node{{Name: "a", UsableBytes: 4 * gib}, {Name: "b", UsableBytes: 9 * gib}, {Name: "c", UsableBytes: 8 * gib}, {Name: "d", UsableBytes: 9 * gib}}
	p, err := Balance(ns, simple(3, 0, 0))
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, s := range p.Stages {
		got = append(got, s.Node)
	}
	if want := []string{"b", "c", "d"}; !reflect.DeepEqual(got, want) {
		t.Errorf("stages on %v, want the three largest in name order %v", got, want)
	}
	// First in name order, a would hold 3 GiB of KV cache with one layer.
	want := []LeftOut{{"a", "would lower the KV capacity: with one layer (first stage: embedding) it holds 3072 tokens, the pipeline 7168 without it"}}
	if !reflect.DeepEqual(p.LeftOut, want) {
		t.Errorf("left out %q, want %q", p.LeftOut, want)
	}
}

func TestBalanceErrors(t *testing.T) {
	tests := []struct {
		name  string
		nodes []Node
		cost  Cost
		want  string
	}{
		{"no nodes", nil, simple(4, 0, 0), "no nodes"},
		{"duplicate", []Node{{Name: "a", UsableBytes: gib}, {Name: "a", UsableBytes: gib}}, simple(4, 0, 0), `node "a" listed twice`},
		{"unnamed", []Node{{UsableBytes: gib}}, simple(4, 0, 0), "empty name"},
		{"no layers", nodes(gib), simple(0, 0, 0), "0 layers"},
		{"no kv", nodes(gib), Cost{Layers: 1}, "zero KV bytes"},
		// No pipeline holds a layer: n0, first in name order, cannot hold
		// the 3 GiB embedding, one 1 GiB layer and 1 MiB of KV, nor n1 alone
		// the embedding and four layers. Given the gigabyte n0 lacks, the
		// two nodes would hold the model.
		{"first stage too small", nodes(3*gib, 4*gib), simple(4, 3*gib, 0),
			fmt.Sprintf(`balance 4 layers over 2 nodes: no pipeline of the nodes holds a layer: node "n0" (first stage: embedding) cannot hold one layer: has %d bytes usable, needs %d: short by %d`, 3*gib, 4*gib+1<<20, gib+1<<20)},
		{"all short", nodes(gib/2, gib/2, gib/2), simple(4, 0, 0),
			`no pipeline of the nodes holds a layer: node "n0" (first stage: embedding) cannot hold one layer: has 536870912 bytes usable, needs 1074790400: short by 537919488; ` +
				`node "n1" (middle stage) cannot hold one layer: has 536870912 bytes usable, needs 1074790400: short by 537919488; node "n2" (last stage: head) cannot`},
		{"one node short", nodes(gib), simple(1, 0, 0), `node "n0" (only stage: embedding and head) cannot hold one layer: has 1073741824 bytes usable, needs 1074790400: short by 1048576`},
		// 1.5 GiB holds one layer of 1 GiB + 1 MiB: 2 of 5 layers.
		{"too few layers fit", nodes(gib*3/2, gib*3/2), simple(5, 0, 0),
			fmt.Sprintf("the nodes hold at most 2 of 5 layers (n0 1, n1 1): short by %d bytes for 3 more layers", 3*(gib+1<<20))},
		// The nodes that cannot join the pipeline holding the most layers
		// are named with what they lack.
		{"too few layers fit, one too small", nodes(gib*3/2, gib/2, gib*3/2), simple(5, 0, 0),
			fmt.Sprintf(`the nodes hold at most 2 of 5 layers (n0 1, n2 1): short by %d bytes for 3 more layers; node "n1" (middle stage) cannot hold one layer: has 536870912 bytes usable, needs 1074790400: short by 537919488`, 3*(gib+1<<20))},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Balance(tt.nodes, tt.cost)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Balance: %v, want an error containing %q", err, tt.want)
			}
		})
	}
}

func TestExplicit(t *testing.T) {
	ns := nodes(20*gib, 20*gib, 2*gib)
	c := simple(8, gib, gib)
	p, err := Explicit(ns, []Range{{"n1", 0, 5}, {"n0", 5, 8}}, c)
	if err != nil {
		t.Fatal(err)
	}
	want := Plan{Stages: []Stage{
		{Node: "n1", Backend: "cuda", Lo: 0, Hi: 5, WeightBytes: 6 * gib, KVTokens: 14 * 1024 / 5},
		{Node: "n0", Backend: "cuda", Lo: 5, Hi: 8, WeightBytes: 4 * gib, KVTokens: 16 * 1024 / 3},
	}, KVTokens: 14 * 1024 / 5, LeftOut: []LeftOut{{"n2", "is not in the explicit plan"}}}
	if !reflect.DeepEqual(p, want) {
		t.Errorf("plan %+v, want %+v", p, want)
	}
	bad := []struct {
		name   string
		ranges []Range
		want   string
	}{
		{"none", nil, "no ranges"},
		{"unknown", []Range{{"zz", 0, 8}}, `node "zz" is not a member`},
		{"twice", []Range{{"n0", 0, 4}, {"n0", 4, 8}}, `node "n0" has two ranges`},
		{"gap", []Range{{"n0", 0, 4}, {"n1", 5, 8}}, "range 1 (n1): starts at layer 5, want 4"},
		{"overlap", []Range{{"n0", 0, 4}, {"n1", 3, 8}}, "starts at layer 3, want 4"},
		{"not from 0", []Range{{"n0", 1, 8}}, "starts at layer 1, want 0"},
		{"empty", []Range{{"n0", 0, 0}, {"n1", 0, 8}}, "empty layer range [0, 0)"},
		{"past end", []Range{{"n0", 0, 9}}, "ends at layer 9, model has 8"},
		{"short", []Range{{"n0", 0, 7}}, "covers layers [0, 7), model has 8"},
		// n2 with 2 GiB cannot hold the head, one layer and its KV.
		{"no fit", []Range{{"n0", 0, 7}, {"n2", 7, 8}}, fmt.Sprintf(`node "n2" (last stage: head) with layers [7, 8) has %d bytes usable, needs %d: short by %d`, 2*gib, 2*gib+1<<20, 1<<20)},
	}
	for _, tt := range bad {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Explicit(ns, tt.ranges, c)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Explicit: %v, want an error containing %q", err, tt.want)
			}
		})
	}
}

// checkPlan checks a plan's invariants against an independent recount:
// contiguous ranges covering every layer, each stage's weights and KV
// capacity as the cost says, and the plan's capacity the minimum.
func checkPlan(t *testing.T, p Plan, ns []Node, c Cost) {
	t.Helper()
	usable := map[string]uint64{}
	for _, n := range ns {
		usable[n.Name] = n.UsableBytes
	}
	next, minKV := 0, math.MaxInt
	for i, s := range p.Stages {
		if s.Lo != next || s.Hi <= s.Lo {
			t.Fatalf("stage %d range [%d, %d) after layer %d", i, s.Lo, s.Hi, next)
		}
		next = s.Hi
		k := uint64(s.Hi - s.Lo)
		w := c.WorkspaceBytes + k*c.LayerBytes
		switch first, last := i == 0, i == len(p.Stages)-1; {
		case first && last && c.Tied:
			w += max(c.EmbedBytes, c.HeadBytes)
		default:
			if first {
				w += c.EmbedBytes
			}
			if last {
				w += c.HeadBytes
			}
		}
		kv := int((usable[s.Node] - w) / (k * c.KVBytesPerToken))
		if s.WeightBytes != w || s.KVTokens != kv || kv < 1 {
			t.Fatalf("stage %d: weights %d KV %d, want %d and %d", i, s.WeightBytes, s.KVTokens, w, kv)
		}
		minKV = min(minKV, kv)
	}
	if next != c.Layers || p.KVTokens != minKV {
		t.Fatalf("plan covers %d of %d layers, KV %d, min over stages %d", next, c.Layers, p.KVTokens, minKV)
	}
}

// bruteBest is the best capacity over every composition of the layers
// into len(ns) positive parts (0 when none fits).
func bruteBest(ns []Node, c Cost) int {
	best := 0
	var rec func(i, lo, minKV int)
	rec = func(i, lo, minKV int) {
		if i == len(ns) {
			if lo == c.Layers {
				best = max(best, minKV)
			}
			return
		}
		for hi := lo + 1; hi <= c.Layers-(len(ns)-1-i); hi++ {
			kv := stageKV(ns[i], c, i == 0, i == len(ns)-1, hi-lo)
			if kv < 1 {
				continue
			}
			rec(i+1, hi, min(minKV, kv))
		}
	}
	rec(0, 0, math.MaxInt)
	return best
}

// stageKV recounts one stage's capacity independently of plan (untied
// costs only).
func stageKV(n Node, c Cost, first, last bool, k int) int {
	w := c.WorkspaceBytes + uint64(k)*c.LayerBytes
	if first {
		w += c.EmbedBytes
	}
	if last {
		w += c.HeadBytes
	}
	if n.UsableBytes <= w {
		return 0
	}
	return int((n.UsableBytes - w) / (uint64(k) * c.KVBytesPerToken))
}

// evenKV is the capacity of the even split (the first layers%n stages one
// layer more), 0 when it does not fit.
func evenKV(ns []Node, c Cost) int {
	kv, lo := math.MaxInt, 0
	for i, n := range ns {
		k := c.Layers / len(ns)
		if i < c.Layers%len(ns) {
			k++
		}
		kv = min(kv, stageKV(n, c, i == 0, i == len(ns)-1, k))
		lo += k
	}
	return kv
}

// bruteChoice is the choice Balance must make, by brute force over every
// non-empty subset of ns (in name order; at most one node per layer): the
// best capacity of each (bruteBest), counted up to MaxKVTokens; of the
// subsets reaching the highest, those with the most nodes; of those, the
// one whose memories, largest first, are largest, then the earliest
// names. value is 0 when no subset fits.
func bruteChoice(ns []Node, c Cost) (set []Node, value int) {
	for mask := 1; mask < 1<<len(ns); mask++ {
		var sub []Node
		for i, n := range ns {
			if mask&(1<<i) != 0 {
				sub = append(sub, n)
			}
		}
		if len(sub) > c.Layers {
			continue
		}
		v := capped(bruteBest(sub, c), c)
		switch {
		case v == 0 || v < value:
			continue
		case v > value, len(sub) > len(set), len(sub) == len(set) && preferred(sub, set):
			set, value = sub, v
		}
	}
	return set, value
}

func capped(kv int, c Cost) int {
	if c.MaxKVTokens > 0 {
		return min(kv, c.MaxKVTokens)
	}
	return kv
}

// preferred reports whether a, of as many nodes as b, has larger
// memories (sorted, largest first), or the same and earlier names.
func preferred(a, b []Node) bool {
	mem := func(ns []Node) []uint64 {
		var m []uint64
		for _, n := range ns {
			m = append(m, n.UsableBytes)
		}
		slices.Sort(m)
		slices.Reverse(m)
		return m
	}
	if d := slices.Compare(mem(a), mem(b)); d != 0 {
		return d > 0
	}
	for i := range a {
		if a[i].Name != b[i].Name {
			return a[i].Name < b[i].Name
		}
	}
	return false
}

// TestBalanceProperties checks random clusters against brute force: the
// plan is valid, uses the nodes bruteChoice chooses, reaches their best
// capacity (so at least the even split's over them), and says why each
// other node is left out, truthfully: it cannot hold one layer where it
// would stand, or with one layer there it holds less KV cache than the
// capacity reached without it (and adding it lowers the best capacity),
// or every layer already has a stage.
func TestBalanceProperties(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	runs := 10000
	if testing.Short() {
		runs = 300
	}
	fitted, kinds := 0, map[string]int{}
	for run := range runs {
		nn := 1 + rng.IntN(4)
		c := Cost{
			Layers:          1 + rng.IntN(nn+8),
			LayerBytes:      uint64(1 + rng.IntN(100)),
			EmbedBytes:      uint64(rng.IntN(300)),
			HeadBytes:       uint64(rng.IntN(300)),
			KVBytesPerToken: uint64(1 + rng.IntN(5)),
			WorkspaceBytes:  uint64(rng.IntN(50)),
		}
		if rng.IntN(3) == 0 {
			c.MaxKVTokens = 1 + rng.IntN(300)
		}
		ns := make([]Node, nn)
		for i := range ns {
			ns[i] = Node{Name: fmt.Sprintf("n%d", i), UsableBytes: uint64(rng.IntN(3000))}
		}
		set, value := bruteChoice(ns, c)
		p, err := Balance(ns, c)
		if value == 0 {
			if err == nil {
				t.Fatalf("run %d: %+v %+v: Balance found %+v where nothing fits", run, ns, c, p)
			}
			continue
		}
		if err != nil {
			t.Fatalf("run %d: %+v %+v: %v, brute force fits %v", run, ns, c, err, set)
		}
		fitted++
		checkPlan(t, p, ns, c)
		var got, want []string
		for _, s := range p.Stages {
			got = append(got, s.Node)
		}
		for _, n := range set {
			want = append(want, n.Name)
		}
		if !slices.Equal(got, want) {
			t.Fatalf("run %d: %+v %+v: stages on %v, brute force chooses %v (capacity %d)", run, ns, c, got, want, value)
		}
		if best := bruteBest(set, c); p.KVTokens != best {
			t.Fatalf("run %d: %+v %+v: KV %d, brute force reaches %d over %v", run, ns, c, p.KVTokens, best, want)
		}
		if even := evenKV(set, c); even > 0 && p.KVTokens < even {
			t.Fatalf("run %d: KV %d below the even split's %d", run, p.KVTokens, even)
		}
		var left []string
		for _, l := range p.LeftOut {
			left = append(left, l.Node)
			checkLeftOut(t, fmt.Sprintf("run %d: %+v %+v: %v", run, ns, c, l), ns, set, value, p, c, l)
			kinds[strings.Fields(l.Why)[0]]++
		}
		var rest []string
		for _, n := range ns {
			if !slices.Contains(want, n.Name) {
				rest = append(rest, n.Name)
			}
		}
		if !slices.Equal(left, rest) {
			t.Fatalf("run %d: left out %v, want %v", run, left, rest)
		}
	}
	if fitted < runs/4 {
		t.Fatalf("only %d of %d random clusters fit: the generator tests little", fitted, runs)
	}
	t.Logf("fitted %d of %d, reasons %v", fitted, runs, kinds)
	if !testing.Short() {
		for _, k := range []string{"(first", "(middle", "(last", "would", "is"} {
			if kinds[k] < 10 {
				t.Fatalf("left-out reasons seen %v: fewer than 10 starting %q: the generator tests little", kinds, k)
			}
		}
	}
}

// checkLeftOut checks the reason for leaving node l out of p, which the
// brute force's set reaches with value: recounted independently.
func checkLeftOut(t *testing.T, what string, ns []Node, set []Node, value int, p Plan, c Cost, l LeftOut) {
	t.Helper()
	i := slices.IndexFunc(ns, func(n Node) bool { return n.Name == l.Node })
	n := ns[i]
	first, last := n.Name < set[0].Name, n.Name > set[len(set)-1].Name
	one := stageKV(n, c, first, last, 1)
	with := append(slices.Clone(set), n)
	slices.SortFunc(with, func(a, b Node) int { return strings.Compare(a.Name, b.Name) })
	switch {
	case strings.Contains(l.Why, "cannot hold one layer"):
		need := c.WorkspaceBytes + c.LayerBytes + c.KVBytesPerToken
		if first {
			need += c.EmbedBytes
		}
		if last {
			need += c.HeadBytes
		}
		if one != 0 || !strings.HasPrefix(l.Why, role(first, last)) || !strings.Contains(l.Why, fmt.Sprintf("needs %d: short by %d", need, need-n.UsableBytes)) {
			t.Fatalf("%s: it holds %d tokens with one layer, needs %d", what, one, need)
		}
	case strings.HasPrefix(l.Why, "would lower the KV capacity"):
		if want := fmt.Sprintf("with one layer %s it holds %d tokens, the pipeline %d without it", role(first, last), one, p.KVTokens); one < 1 || one >= value || !strings.Contains(l.Why, want) {
			t.Fatalf("%s: want %q below %d", what, want, value)
		}
		if v := capped(bruteBest(with, c), c); v >= value && len(with) <= c.Layers {
			t.Fatalf("%s: with it the capacity is %d, not below %d", what, v, value)
		}
	case strings.HasPrefix(l.Why, "is not needed"):
		if len(set) != c.Layers {
			t.Fatalf("%s: %d stages for %d layers", what, len(set), c.Layers)
		}
	default:
		t.Fatalf("%s: unknown reason", what)
	}
}

func BenchmarkBalance(b *testing.B) {
	cfg := model.Config{HiddenSize: 8192, NumLayers: 128, NumHeads: 64, NumKVHeads: 8, HeadDim: 128, IntermediateSize: 28672, VocabSize: 128256}
	c := CostOf(&cfg, 2)
	c.WorkspaceBytes = Workspace(&cfg, 512, 64)
	rng := rand.New(rand.NewPCG(3, 4))
	ns := make([]Node, 64)
	for i := range ns {
		ns[i] = Node{Name: fmt.Sprintf("gpu%02d", i), UsableBytes: uint64(40+rng.IntN(100)) * gib}
	}
	for b.Loop() {
		if _, err := Balance(ns, c); err != nil {
			b.Fatal(err)
		}
	}
}

// TestStageBytes checks StageBytes against the capacity StageKVTokens and
// the plans count: a stage given exactly the bytes of k tokens of KV cache
// holds k tokens, and one byte less holds k-1.
func TestStageBytes(t *testing.T) {
	c := simple(8, 2*gib, 3*gib)
	c.WorkspaceBytes = 64 << 20
	for _, r := range [][2]int{{0, 8}, {0, 3}, {3, 5}, {5, 8}} {
		for _, k := range []int{1, 7, 1000} {
			b := c.StageBytes(r[0], r[1], k)
			if got, err := c.StageKVTokens(b, r[0], r[1]); err != nil || got != k {
				t.Errorf("layers %v: StageKVTokens(StageBytes(%d)) = %d, %v; want %d", r, k, got, err, k)
			}
			if got, _ := c.StageKVTokens(b-1, r[0], r[1]); got != k-1 {
				t.Errorf("layers %v: one byte short of %d tokens holds %d", r, k, got)
			}
		}
	}
}
