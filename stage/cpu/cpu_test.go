package cpu

import (
	"context"
	"errors"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/safetensors"
	"github.com/tandem-llm/tandem/stage"
	"github.com/tandem-llm/tandem/stage/stagetest"
)

func shape(t testing.TB, name string) stagetest.Shape {
	t.Helper()
	for _, s := range stagetest.Shapes() {
		if s.Name == name {
			return s
		}
	}
	t.Fatalf("no shape %s", name)
	return stagetest.Shape{}
}

func TestNewErrors(t *testing.T) {
	sh := shape(t, "qwen2-bias-gqa7-tied-bf16")
	good := sh.Model
	cases := []struct {
		name   string
		edit   func(*Config, stagetest.Weights)
		errHas string
	}{
		{"missing tensor", func(c *Config, w stagetest.Weights) { delete(w, "model.layers.1.mlp.up_proj.weight") }, "model.layers.1.mlp.up_proj.weight"},
		{"missing bias", func(c *Config, w stagetest.Weights) { delete(w, "model.layers.0.self_attn.k_proj.bias") }, "model.layers.0.self_attn.k_proj.bias"},
		{"wrong shape", func(c *Config, w stagetest.Weights) {
			w["model.layers.0.self_attn.o_proj.weight"].Shape = []int{112, 111}
		}, "model.layers.0.self_attn.o_proj.weight"},
		{"short data", func(c *Config, w stagetest.Weights) {
			t := w["model.norm.weight"]
			t.Data = t.Data[:len(t.Data)-2]
		}, "model.norm.weight"},
		{"unsupported dtype", func(c *Config, w stagetest.Weights) { w["model.embed_tokens.weight"].DType = "I8" }, "model.embed_tokens.weight"},
		{"no model", func(c *Config, w stagetest.Weights) { c.Model = nil }, "model config"},
		{"empty range", func(c *Config, w stagetest.Weights) { c.Lo = 1; c.Hi = 1 }, "layer range"},
		{"range past the model", func(c *Config, w stagetest.Weights) { c.Hi = 3 }, "layer range"},
		{"heads not a multiple of kv heads", func(c *Config, w stagetest.Weights) { c.Model.NumKVHeads = 3 }, "key/value heads"},
		{"odd head dim", func(c *Config, w stagetest.Weights) { c.Model.HeadDim = 7 }, "head dim"},
		{"unknown rope scaling", func(c *Config, w stagetest.Weights) {
			c.Model.RopeScaling = &model.RopeScaling{Type: "yarn", Factor: 4}
		}, "yarn"},
		{"bad llama3 factors", func(c *Config, w stagetest.Weights) {
			c.Model.RopeScaling = &model.RopeScaling{Type: "llama3", Factor: 8, LowFreqFactor: 4, HighFreqFactor: 1, OriginalMaxPositions: 32}
		}, "llama3"},
		{"no max tokens", func(c *Config, w stagetest.Weights) { c.MaxTokens = 0 }, "max tokens"},
		{"negative threads", func(c *Config, w stagetest.Weights) { c.Threads = -1 }, "threads"},
		{"negative KV blocks", func(c *Config, w stagetest.Weights) { c.NumBlocks = -1 }, "KV cache of -1 blocks"},
		{"negative block size", func(c *Config, w stagetest.Weights) { c.BlockSize = -4 }, "blocks of -4 positions"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			m := good
			w := stagetest.RandomWeights(&m, sh.DType, 1)
			cfg := Config{Model: &m, Lo: 0, Hi: m.NumLayers, Weights: w, MaxTokens: 8, MaxSeqs: 2}
			tc.edit(&cfg, w)
			st, err := New(cfg)
			if err == nil {
				st.Close()
				t.Fatal("New succeeded")
			}
			if !strings.Contains(err.Error(), tc.errHas) {
				t.Errorf("error %q does not mention %q", err, tc.errHas)
			}
		})
	}
}

// recorder records which tensors a stage reads.
type recorder struct {
	stagetest.Weights
	read []string
}

func (r *recorder) Tensor(name string) (*safetensors.Tensor, error) {
	r.read = append(r.read, name)
	return r.Weights.Tensor(name)
}

func TestLoadsOnlyItsTensors(t *testing.T) {
	tied := shape(t, "llama-gqa2-tied-bf16").Model
	tied.NumLayers = 4
	untied := shape(t, "llama-4layers").Model
	layer := func(i int) []string {
		var names []string
		for _, s := range []string{model.InputNorm, model.PostNorm, model.QProj, model.KProj, model.VProj, model.OProj, model.GateProj, model.UpProj, model.DownProj} {
			names = append(names, model.LayerTensor(i, s))
		}
		return names
	}
	cases := []struct {
		name   string
		m      model.Config
		lo, hi int
		want   []string
	}{
		{"first", untied, 0, 2, slices.Concat(layer(0), layer(1), []string{model.EmbedName})},
		{"middle", untied, 1, 3, slices.Concat(layer(1), layer(2))},
		{"last", untied, 3, 4, slices.Concat(layer(3), []string{model.NormName, model.LMHeadName})},
		{"last tied", tied, 2, 4, slices.Concat(layer(2), layer(3), []string{model.EmbedName, model.NormName})},
		{"whole tied", tied, 0, 4, slices.Concat(layer(0), layer(1), layer(2), layer(3), []string{model.EmbedName, model.NormName})},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := &recorder{Weights: stagetest.RandomWeights(&tc.m, safetensors.BF16, 2)}
			st, err := New(Config{Model: &tc.m, Lo: tc.lo, Hi: tc.hi, Weights: r, MaxTokens: 4, MaxSeqs: 1})
			if err != nil {
				t.Fatal(err)
			}
			defer st.Close()
			slices.Sort(r.read)
			slices.Sort(tc.want)
			if !slices.Equal(r.read, tc.want) {
				t.Errorf("read %v\nwant %v", r.read, tc.want)
			}
			// Memory: the tensors read, in float32; the KV cache of its
			// layers.
			var weights int64
			for _, name := range tc.want {
				tn, err := r.Weights.Tensor(name)
				if err != nil {
					t.Fatal(err)
				}
				n := int64(4)
				for _, d := range tn.Shape {
					n *= int64(d)
				}
				weights += n
			}
			info := st.Info()
			kv := int64(info.KVBlocks*info.BlockSize) * int64(tc.m.NumKVHeads*tc.m.HeadDim) * 2 * int64(tc.hi-tc.lo) * 4
			if mem := st.Memory(); mem.WeightBytes != weights || mem.KVBytes != kv || mem.WorkspaceBytes <= 0 {
				t.Errorf("memory %+v, want %d bytes of weights, %d of KV cache, some workspace", mem, weights, kv)
			}
		})
	}
}

// logitsOf runs one batch on a fresh whole-model stage with the given
// number of threads and KV block size, in block tables scrambled by seed,
// and returns every logits row and the samples.
func logitsOf(t *testing.T, sh stagetest.Shape, w stagetest.Weights, threads, blockSize int, seed uint64, b *stage.Batch) ([][]float32, []stage.Sampled) {
	t.Helper()
	m := sh.Model
	st, err := New(Config{Model: &m, Lo: 0, Hi: m.NumLayers, Weights: w, MaxTokens: 128, MaxSeqs: 8, BlockSize: blockSize, Threads: threads})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if err := stagetest.TablesFor([]stage.Stage{st}, seed).Fill(b); err != nil {
		t.Fatal(err)
	}
	out, err := st.Forward(context.Background(), b)
	if err != nil {
		t.Fatal(err)
	}
	var rows [][]float32
	for _, sl := range out.Logits {
		for _, r := range sl.Rows {
			rows = append(rows, slices.Clone(r))
		}
	}
	return rows, out.Sampled
}

// TestThreadsBitIdentical checks that the number of threads does not change
// a single bit of the logits: every sum is taken in the same order.
func TestThreadsBitIdentical(t *testing.T) {
	sh := shape(t, "qwen2-bias-gqa7-tied-bf16")
	w := stagetest.RandomWeights(&sh.Model, sh.DType, 3)
	rng := rand.New(rand.NewPCG(3, 3))
	b := &stage.Batch{ID: 1}
	for i, n := range []int{70, 3, 1, 20} {
		toks := make([]int32, n)
		for j := range toks {
			toks[j] = int32(rng.IntN(sh.Model.VocabSize))
		}
		b.Seqs = append(b.Seqs, stage.Seq{ID: uint64(i), Tokens: toks, Logits: true})
	}
	want, _ := logitsOf(t, sh, w, 1, 16, 1, b)
	for _, threads := range []int{2, 5, 16} {
		got, _ := logitsOf(t, sh, w, threads, 16, 1, b)
		for i := range want {
			if !slices.Equal(got[i], want[i]) {
				t.Fatalf("threads %d: logits row %d differs from one thread", threads, i)
			}
		}
	}
}

// TestBlocksBitIdentical checks that the KV block size and which blocks a
// sequence is given do not change a single bit of the logits: attention
// gathers the same keys and values in the same order.
func TestBlocksBitIdentical(t *testing.T) {
	sh := shape(t, "llama-gqa2-tied-bf16")
	w := stagetest.RandomWeights(&sh.Model, sh.DType, 6)
	rng := rand.New(rand.NewPCG(6, 6))
	b := &stage.Batch{ID: 1}
	for i, n := range []int{50, 1, 17, 33} {
		toks := make([]int32, n)
		for j := range toks {
			toks[j] = int32(rng.IntN(sh.Model.VocabSize))
		}
		b.Seqs = append(b.Seqs, stage.Seq{ID: uint64(i), Tokens: toks, Logits: true})
	}
	want, _ := logitsOf(t, sh, w, 2, 512, 1, b) // one block per sequence
	for _, tc := range []struct{ blockSize, seed int }{{1, 2}, {3, 3}, {16, 4}, {16, 5}} {
		got, _ := logitsOf(t, sh, w, 2, tc.blockSize, uint64(tc.seed), b)
		for i := range want {
			if !slices.Equal(got[i], want[i]) {
				t.Fatalf("block size %d, tables scrambled by %d: logits row %d differs from contiguous blocks", tc.blockSize, tc.seed, i)
			}
		}
	}
}

// TestSamplingIndependentOfBatch checks that a seeded draw depends on the
// sequence's own logits, seed and index only, not on the other sequences
// of the batch or on its place in it.
func TestSamplingIndependentOfBatch(t *testing.T) {
	sh := shape(t, "llama-mha-f32")
	w := stagetest.RandomWeights(&sh.Model, sh.DType, 4)
	prompt := []int32{5, 17, 33, 2, 90}
	seq := func(id uint64, index int) stage.Seq {
		return stage.Seq{ID: id, Tokens: prompt, Sample: true, Index: index,
			Sampling: stage.Sampling{Temperature: 1.3, TopK: 50, TopP: 0.97, Seed: 42, Logprobs: 2}}
	}
	for index := range 8 {
		_, alone := logitsOf(t, sh, w, 2, 16, 1, &stage.Batch{ID: 1, Seqs: []stage.Seq{seq(7, index)}})
		other := seq(8, index+1)
		other.Sampling.Seed = 5
		_, mixed := logitsOf(t, sh, w, 2, 16, 2, &stage.Batch{ID: 2, Seqs: []stage.Seq{
			{ID: 1, Tokens: []int32{1, 2, 3}, Logits: true}, other, seq(9, index),
		}})
		a, m := alone[0], mixed[1]
		if a.Token != m.Token || a.Logprob != m.Logprob || !slices.Equal(a.Top, m.Top) {
			t.Errorf("index %d: alone %+v, in a batch %+v", index, a, m)
		}
	}
}

func TestToFloat32(t *testing.T) {
	cases := []struct {
		name  string
		dtype safetensors.DType
		data  []byte
		want  []float32
		err   bool
	}{
		{"F32", safetensors.F32, []byte{0, 0, 0x80, 0x3f, 0, 0, 0, 0xc0, 1, 0, 0, 0}, []float32{1, -2, 0x1p-149}, false},
		{"BF16", safetensors.BF16, []byte{0x80, 0x3f, 0x00, 0xc0, 0x49, 0x40}, []float32{1, -2, 3.140625}, false},
		{"F16", safetensors.F16, []byte{0x00, 0x3c, 0x00, 0xc0, 0x01, 0x00, 0xff, 0x7b}, []float32{1, -2, 0x1p-24, 65504}, false},
		{"short", safetensors.BF16, []byte{0x80, 0x3f, 0x00}, make([]float32, 2), true},
		{"long", safetensors.F32, make([]byte, 12), make([]float32, 2), true},
		{"unsupported", "I32", make([]byte, 8), make([]float32, 2), true},
	}
	for _, tc := range cases {
		got := make([]float32, len(tc.want))
		err := toFloat32(got, tc.dtype, tc.data)
		switch {
		case tc.err && err == nil:
			t.Errorf("%s: no error", tc.name)
		case !tc.err && err != nil:
			t.Errorf("%s: %v", tc.name, err)
		case !tc.err && !slices.Equal(got, tc.want):
			t.Errorf("%s: %v, want %v", tc.name, got, tc.want)
		}
	}
}

// bench measures batch-1 decoding at positions 64 to 127 of a model of
// shape m with random F32 weights.
func bench(b *testing.B, m *model.Config) {
	w := stagetest.RandomWeights(m, safetensors.F32, 1)
	st, err := New(Config{Model: m, Lo: 0, Hi: m.NumLayers, Weights: w, MaxTokens: 64, MaxSeqs: 1})
	if err != nil {
		b.Fatal(err)
	}
	defer st.Close()
	ctx := context.Background()
	prompt := make([]int32, 64)
	for i := range prompt {
		prompt[i] = int32(i * 7 % m.VocabSize)
	}
	var pos int
	var next int32
	blocks := make([]int32, st.Info().KVBlocks) // covers every position
	for i := range blocks {
		blocks[i] = int32(i)
	}
	b.ResetTimer()
	for i := range b.N {
		if i%64 == 0 {
			b.StopTimer()
			st.Free(1)
			out, err := st.Forward(ctx, &stage.Batch{Seqs: []stage.Seq{{ID: 1, Tokens: prompt, Blocks: blocks, Sample: true}}})
			if err != nil {
				b.Fatal(err)
			}
			pos, next = len(prompt), out.Sampled[0].Token
			b.StartTimer()
		}
		out, err := st.Forward(ctx, &stage.Batch{Seqs: []stage.Seq{{ID: 1, Pos: pos, Tokens: []int32{next}, Blocks: blocks, Sample: true}}})
		if err != nil {
			b.Fatal(err)
		}
		pos, next = pos+1, out.Sampled[0].Token
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "tokens/s")
}

func BenchmarkDecodeTiny(b *testing.B) {
	m := shape(b, "llama-4layers").Model
	bench(b, &m)
}

// BenchmarkDecode100M decodes with a ~125M-parameter Llama shape: 75M in
// the layers, 25M in the embedding and 25M in the untied LM head.
func BenchmarkDecode100M(b *testing.B) {
	m := model.Config{
		Arch: model.ArchLlama, HiddenSize: 768, NumLayers: 12, NumHeads: 12, NumKVHeads: 4, HeadDim: 64,
		IntermediateSize: 2048, VocabSize: 32000, RMSNormEps: 1e-5, RopeTheta: 10000, MaxPositions: 2048,
	}
	bench(b, &m)
}

// cancelAfter is a context whose Err starts reporting cancellation after a
// number of calls, to cut a Forward short between layers.
type cancelAfter struct {
	context.Context
	calls, limit int
}

func (c *cancelAfter) Err() error {
	c.calls++
	if c.calls > c.limit {
		return context.Canceled
	}
	return nil
}

// TestCancelBetweenLayers cuts a Forward short after its first layer and
// checks that the cached lengths are as before: the new sequence is
// forgotten and the old one continues where it was, matching the reference.
func TestCancelBetweenLayers(t *testing.T) {
	sh := shape(t, "llama-4layers")
	m := sh.Model
	w := stagetest.RandomWeights(&m, sh.DType, 5)
	ref, err := stagetest.NewReference(&m, w)
	if err != nil {
		t.Fatal(err)
	}
	st, err := New(Config{Model: &m, Lo: 0, Hi: m.NumLayers, Weights: w, MaxTokens: 32, MaxSeqs: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	prompt := []int32{9, 8, 7, 6, 5, 4, 3, 2}
	tables := stagetest.TablesFor([]stage.Stage{st}, 1)
	first := &stage.Batch{Seqs: []stage.Seq{{ID: 1, Tokens: prompt[:4]}}}
	batch := &stage.Batch{Seqs: []stage.Seq{
		{ID: 1, Pos: 4, Tokens: prompt[4:], Logits: true},
		{ID: 2, Tokens: prompt, Logits: true},
	}}
	if err := errors.Join(tables.Fill(first), tables.Fill(batch)); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Forward(context.Background(), first); err != nil {
		t.Fatal(err)
	}
	// Err is asked once on entry and once before each layer: fail at the second layer.
	_, err = st.Forward(&cancelAfter{Context: context.Background(), limit: 2}, batch)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Forward cut short: error %v, want context.Canceled", err)
	}
	if len(st.seqs) != 1 || st.seqs[1].n != 4 {
		t.Fatalf("after a cancelled Forward: %d sequences, seq 1 holds %d tokens; want 1 sequence of 4", len(st.seqs), st.seqs[1].n)
	}
	out, err := st.Forward(context.Background(), batch)
	if err != nil {
		t.Fatalf("the same batch after the cancelled one: %v", err)
	}
	want := ref.Logits(prompt)
	for i, rows := range [][][]float32{out.Logits[0].Rows, out.Logits[1].Rows} {
		for j, row := range rows {
			p := j + len(prompt) - len(rows)
			if e := stagetest.RelErr(row, want[p]); !(e <= 1e-5) {
				t.Errorf("seq %d position %d: relative error %.3g against the reference", i+1, p, e)
			}
		}
	}
}
