package graphs

import (
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

func mustDispatcher(t testing.TB, c Config) *Dispatcher {
	t.Helper()
	d, err := NewDispatcher(c)
	if err != nil {
		t.Fatalf("NewDispatcher(%+v): %v", c, err)
	}
	return d
}

func decodeDesc(tokens, q int) BatchDescriptor {
	return BatchDescriptor{NumTokens: tokens, NumReqs: tokens / q, UniformDecode: true, QueryLen: q}
}

func TestDispatchTable(t *testing.T) {
	sizes := []int{1, 2, 4, 8, 16}
	type call struct {
		tokens  int
		uniform bool
		reqs    int
		want    Step
	}
	tests := []struct {
		name  string
		cfg   Config
		calls []call
	}{
		{"FULL_AND_PIECEWISE", Config{Mode: FullAndPiecewise, CaptureSizes: sizes}, []call{
			{1, true, 1, Step{Full, decodeDesc(1, 1)}},
			{3, true, 3, Step{Full, decodeDesc(4, 1)}},
			{16, true, 16, Step{Full, decodeDesc(16, 1)}},
			{3, false, 2, Step{Piecewise, BatchDescriptor{NumTokens: 4}}},
			{9, false, 1, Step{Piecewise, BatchDescriptor{NumTokens: 16}}},
			// A uniform claim that does not add up is a mixed batch.
			{5, true, 3, Step{Piecewise, BatchDescriptor{NumTokens: 8}}},
			{17, true, 17, Step{None, BatchDescriptor{NumTokens: 17}}},
			{17, false, 3, Step{None, BatchDescriptor{NumTokens: 17}}},
			{0, false, 0, Step{None, BatchDescriptor{}}},
			{0, true, 0, Step{None, BatchDescriptor{}}},
			{-3, false, 1, Step{None, BatchDescriptor{NumTokens: -3}}},
		}},
		{"FULL_DECODE_ONLY", Config{Mode: FullDecodeOnly, CaptureSizes: sizes}, []call{
			{3, true, 3, Step{Full, decodeDesc(4, 1)}},
			{3, false, 2, Step{None, BatchDescriptor{NumTokens: 3}}},
			{20, true, 20, Step{None, BatchDescriptor{NumTokens: 20}}},
		}},
		{"FULL", Config{Mode: Full, CaptureSizes: sizes}, []call{
			{3, true, 3, Step{Full, decodeDesc(4, 1)}},
			{3, false, 2, Step{Full, BatchDescriptor{NumTokens: 4}}},
			{16, false, 2, Step{Full, BatchDescriptor{NumTokens: 16}}},
			{17, false, 2, Step{None, BatchDescriptor{NumTokens: 17}}},
		}},
		{"PIECEWISE", Config{Mode: Piecewise, CaptureSizes: sizes}, []call{
			{3, true, 3, Step{Piecewise, BatchDescriptor{NumTokens: 4}}},
			{7, false, 2, Step{Piecewise, BatchDescriptor{NumTokens: 8}}},
			{17, true, 17, Step{None, BatchDescriptor{NumTokens: 17}}},
		}},
		{"NONE", Config{Mode: None, CaptureSizes: sizes}, []call{
			{3, true, 3, Step{None, BatchDescriptor{NumTokens: 3}}},
			{8, false, 2, Step{None, BatchDescriptor{NumTokens: 8}}},
		}},
		{"spec decode q=2", Config{Mode: FullAndPiecewise, CaptureSizes: sizes, UniformDecodeQueryLen: 2}, []call{
			{2, true, 1, Step{Full, decodeDesc(2, 2)}},
			{4, true, 2, Step{Full, decodeDesc(4, 2)}},
			{6, true, 3, Step{Full, decodeDesc(8, 2)}},
			{1, true, 1, Step{Piecewise, BatchDescriptor{NumTokens: 1}}}, // one token per request is not q=2
			{3, false, 2, Step{Piecewise, BatchDescriptor{NumTokens: 4}}},
		}},
		{"spec decode q=3", Config{Mode: FullAndPiecewise, CaptureSizes: []int{1, 2, 4, 6, 8, 12}, UniformDecodeQueryLen: 3}, []call{
			{3, true, 1, Step{Full, decodeDesc(6, 3)}},
			{9, true, 3, Step{Full, decodeDesc(12, 3)}},
			{3, false, 1, Step{Piecewise, BatchDescriptor{NumTokens: 4}}},
		}},
		{"max num seqs", Config{Mode: FullAndPiecewise, CaptureSizes: sizes, MaxNumSeqs: 4}, []call{
			{4, true, 4, Step{Full, decodeDesc(4, 1)}},
			{5, true, 5, Step{Piecewise, BatchDescriptor{NumTokens: 8}}},
		}},
		{"max num seqs, FULL", Config{Mode: Full, CaptureSizes: sizes, MaxNumSeqs: 4}, []call{
			{5, true, 5, Step{Full, BatchDescriptor{NumTokens: 8}}},
		}},
		{"max num seqs, FULL_DECODE_ONLY", Config{Mode: FullDecodeOnly, CaptureSizes: sizes, MaxNumSeqs: 4}, []call{
			{5, true, 5, Step{None, BatchDescriptor{NumTokens: 5}}},
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d := mustDispatcher(t, tc.cfg)
			for _, c := range tc.calls {
				m, desc := d.Dispatch(c.tokens, c.uniform, c.reqs)
				if got := (Step{m, desc}); got != c.want {
					t.Errorf("Dispatch(%d, %v, %d) = %s, want %s", c.tokens, c.uniform, c.reqs, got, c.want)
				}
			}
		})
	}
}

func TestKeys(t *testing.T) {
	sizes := []int{1, 2, 4, 8}
	pw := func(n int) Step { return Step{Piecewise, BatchDescriptor{NumTokens: n}} }
	fm := func(n int) Step { return Step{Full, BatchDescriptor{NumTokens: n}} }
	fd := func(n, q int) Step { return Step{Full, decodeDesc(n, q)} }
	tests := []struct {
		name string
		cfg  Config
		want []Step
	}{
		{"NONE", Config{Mode: None, CaptureSizes: sizes}, nil},
		{"PIECEWISE", Config{Mode: Piecewise, CaptureSizes: sizes}, []Step{pw(8), pw(4), pw(2), pw(1)}},
		{"FULL", Config{Mode: Full, CaptureSizes: sizes}, []Step{fd(8, 1), fd(4, 1), fd(2, 1), fd(1, 1), fm(8), fm(4), fm(2), fm(1)}},
		{"FULL_DECODE_ONLY", Config{Mode: FullDecodeOnly, CaptureSizes: sizes}, []Step{fd(8, 1), fd(4, 1), fd(2, 1), fd(1, 1)}},
		{"FULL_AND_PIECEWISE", Config{Mode: FullAndPiecewise, CaptureSizes: sizes}, []Step{fd(8, 1), fd(4, 1), fd(2, 1), fd(1, 1), pw(8), pw(4), pw(2), pw(1)}},
		{"q=2", Config{Mode: FullAndPiecewise, CaptureSizes: sizes, UniformDecodeQueryLen: 2}, []Step{fd(8, 2), fd(4, 2), fd(2, 2), pw(8), pw(4), pw(2), pw(1)}},
		{"max num seqs 2", Config{Mode: FullDecodeOnly, CaptureSizes: sizes, MaxNumSeqs: 2}, []Step{fd(2, 1), fd(1, 1)}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d := mustDispatcher(t, tc.cfg)
			got := d.Keys()
			if !slices.Equal(got, tc.want) {
				t.Errorf("Keys() = %v\nwant %v", got, tc.want)
			}
			for _, k := range got {
				if k.Mode == Piecewise && k.Desc != k.Desc.Relaxed() {
					t.Errorf("piecewise key %s is not relaxed", k)
				}
			}
			if len(got) > 0 {
				got[0].Mode = None
				if d.Keys()[0].Mode == None {
					t.Error("Keys() shares the dispatcher's slice")
				}
			}
		})
	}
}

func TestRelaxed(t *testing.T) {
	d := decodeDesc(8, 2)
	if got, want := d.Relaxed(), (BatchDescriptor{NumTokens: 8}); got != want {
		t.Errorf("Relaxed() = %v, want %v", got, want)
	}
	if d.String() != "tokens=8 reqs=4 uniform q=2" || d.Relaxed().String() != "tokens=8" {
		t.Errorf("String: %q, %q", d, d.Relaxed())
	}
	m := map[BatchDescriptor]int{d: 1, d.Relaxed(): 2}
	if len(m) != 2 || m[decodeDesc(8, 2)] != 1 || m[BatchDescriptor{NumTokens: 8}] != 2 {
		t.Errorf("descriptors as map keys: %v", m)
	}
}

func TestNewDispatcherDefaults(t *testing.T) {
	d := mustDispatcher(t, Config{Mode: DefaultMode})
	if !slices.Equal(d.CaptureSizes(), DefaultCaptureSizes(DefaultMaxCaptureSize)) || d.MaxCaptureSize() != DefaultMaxCaptureSize || d.UniformDecodeQueryLen() != 1 || d.Mode() != FullAndPiecewise {
		t.Errorf("zero config: sizes %v, max %d, q %d, mode %s", d.CaptureSizes(), d.MaxCaptureSize(), d.UniformDecodeQueryLen(), d.Mode())
	}
	d = mustDispatcher(t, Config{Mode: Piecewise, CaptureSizes: []int{1, 2, 3}})
	if d.MaxCaptureSize() != 3 {
		t.Errorf("sizes [1 2 3]: max %d, want 3", d.MaxCaptureSize())
	}
	d = mustDispatcher(t, Config{Mode: Piecewise, MaxCaptureSize: 20})
	if !slices.Equal(d.CaptureSizes(), []int{1, 2, 4, 8, 16}) || d.MaxCaptureSize() != 16 {
		t.Errorf("max 20: sizes %v, max %d", d.CaptureSizes(), d.MaxCaptureSize())
	}
	if m, _ := d.Dispatch(18, false, 1); m != None {
		t.Errorf("max 20: 18 tokens dispatched as %s, want NONE past the largest size", m)
	}
	// The dispatcher keeps its own copy of the sizes.
	sizes := []int{1, 2, 4}
	d = mustDispatcher(t, Config{Mode: Piecewise, CaptureSizes: sizes})
	sizes[2] = 3
	if _, desc := d.Dispatch(3, false, 1); desc.NumTokens != 4 {
		t.Errorf("after the caller changed its sizes, 3 tokens pad to %d", desc.NumTokens)
	}
}

func TestNewDispatcherErrors(t *testing.T) {
	tests := []struct {
		cfg  Config
		want string
	}{
		{Config{Mode: Mode(5)}, "invalid mode 5"},
		{Config{Mode: Full, UniformDecodeQueryLen: -1}, "query length -1"},
		{Config{Mode: Full, UniformDecodeQueryLen: MaxCaptureSizeLimit + 1}, "query length"},
		{Config{Mode: Full, MaxNumSeqs: -2}, "max num seqs -2"},
		{Config{Mode: Full, CaptureSizes: []int{}}, "no capture sizes"},
		{Config{Mode: Full, CaptureSizes: []int{}, MaxCaptureSize: 8}, "no capture sizes"},
		{Config{Mode: Full, CaptureSizes: []int{1, 8, 4}}, "capture size 4 (index 2) follows 8"},
		{Config{Mode: Full, CaptureSizes: []int{1, 16}, MaxCaptureSize: 8}, "capture size 16 (index 1) exceeds the max capture size 8"},
		{Config{Mode: Full, MaxCaptureSize: -1}, "max capture size -1"},
		{Config{Mode: Full, MaxCaptureSize: MaxCaptureSizeLimit + 1}, "out of range"},
		{Config{Mode: FullAndPiecewise, CaptureSizes: []int{1, 2, 4, 8}, UniformDecodeQueryLen: 3}, "no capture size is a multiple of the uniform decode query length 3"},
		{Config{Mode: FullDecodeOnly, CaptureSizes: []int{8, 16}, MaxNumSeqs: 4}, "of at most 4 requests"},
	}
	for _, tc := range tests {
		_, err := NewDispatcher(tc.cfg)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("NewDispatcher(%+v) error = %v, want one containing %q", tc.cfg, err, tc.want)
		}
	}
	// Without full decode graphs, the query length need not divide a size.
	mustDispatcher(t, Config{Mode: Piecewise, CaptureSizes: []int{1, 2, 4, 8}, UniformDecodeQueryLen: 3})
}

// refDispatch dispatches the way vLLM's dispatcher does, by looking keys up
// in the set rather than padding through tables: the exact uniform decode
// key among the full keys (the smallest capture size that has one), then
// the relaxed key among the full keys, then among the piecewise keys.
func refDispatch(keys KeySet, sizes []int, q, n int, uniform bool, reqs int) Step {
	if uniform && n >= 1 && n == reqs*q {
		for _, s := range sizes {
			k := Step{Full, decodeDesc(s, q)}
			if s >= n && s%q == 0 && keys.Has(k) {
				return k
			}
		}
	}
	if p := refPad(sizes, n); p != 0 {
		for _, m := range []Mode{Full, Piecewise} {
			if k := (Step{m, BatchDescriptor{NumTokens: p}}); keys.Has(k) {
				return k
			}
		}
	}
	return Step{None, BatchDescriptor{NumTokens: n}}
}

func randomConfig(r *rand.Rand) Config {
	c := Config{Mode: allModes[r.IntN(len(allModes))], UniformDecodeQueryLen: 1 + r.IntN(4)}
	switch r.IntN(3) {
	case 0:
		c.MaxCaptureSize = 1 + r.IntN(300)
	case 1:
		for s := 1 + r.IntN(3); s <= 300; s += 1 + r.IntN(24) {
			c.CaptureSizes = append(c.CaptureSizes, s)
		}
	case 2:
		c.CaptureSizes = []int{c.UniformDecodeQueryLen * (1 + r.IntN(10))}
	}
	if r.IntN(2) == 0 {
		c.MaxNumSeqs = 1 + r.IntN(64)
	}
	return c
}

// TestDispatchProperties checks random configurations at every token
// count against refDispatch and the rules: padding never shrinks a batch,
// it goes to the smallest capture size that has a key, Full serves mixed
// batches only in mode Full, and every stage that captured Keys() can
// replay every step.
func TestDispatchProperties(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	configs := 0
	for configs < 300 {
		c := randomConfig(r)
		d, err := NewDispatcher(c)
		if err != nil {
			// Only one configuration error can be drawn.
			if !strings.Contains(err.Error(), "no capture size is a multiple") {
				t.Fatalf("NewDispatcher(%+v): %v", c, err)
			}
			continue
		}
		configs++
		keys := NewKeySet(d.Keys())
		sizes := d.CaptureSizes()
		q := d.UniformDecodeQueryLen()
		for n := 0; n <= d.MaxCaptureSize()+2; n++ {
			for _, uniform := range []bool{false, true} {
				reqs := max(1, n/q)
				if !uniform {
					reqs = 1 + r.IntN(max(1, n))
				}
				m, desc := d.Dispatch(n, uniform, reqs)
				step := Step{m, desc}
				if want := refDispatch(keys, sizes, q, n, uniform, reqs); step != want {
					t.Fatalf("config %+v: Dispatch(%d, %v, %d) = %s, want %s", c, n, uniform, reqs, step, want)
				}
				isUniform := uniform && n == reqs*q
				switch {
				case m == None && desc.NumTokens != n:
					t.Fatalf("config %+v: eager step of %d tokens describes %d", c, n, desc.NumTokens)
				case m != None && (desc.NumTokens < n || !slices.Contains(sizes, desc.NumTokens)):
					t.Fatalf("config %+v: %d tokens padded to %d", c, n, desc.NumTokens)
				case m != None && !desc.UniformDecode && desc.NumTokens != refPad(sizes, n):
					t.Fatalf("config %+v: %d tokens padded to %d, not the smallest capture size", c, n, desc.NumTokens)
				case m == Full && !isUniform && c.Mode != Full:
					t.Fatalf("config %+v: mixed batch of %d tokens dispatched FULL", c, n)
				case desc.UniformDecode && (!isUniform || m != Full || c.Mode.DecodeMode() != Full):
					t.Fatalf("config %+v: Dispatch(%d, %v, %d) = %s", c, n, uniform, reqs, step)
				case m == Piecewise && !c.Mode.HasPiecewise():
					t.Fatalf("config %+v: piecewise step %s", c, step)
				case m == None && n >= 1 && n <= d.MaxCaptureSize() && c.Mode.MixedMode() != None:
					t.Fatalf("config %+v: %d tokens within the capture sizes run eagerly", c, n)
				}
				if n >= 1 {
					if err := step.Validate("s", n, reqs, keys); err != nil {
						t.Fatalf("config %+v: step %s for %d tokens of %d requests: %v", c, step, n, reqs, err)
					}
				}
			}
		}
	}
}

func TestStepValidate(t *testing.T) {
	d := mustDispatcher(t, Config{Mode: FullAndPiecewise, CaptureSizes: []int{1, 2, 4, 8}})
	all := NewKeySet(d.Keys())
	piecewiseOnly := NewKeySet([]Step{{Piecewise, BatchDescriptor{NumTokens: 4}}})
	tests := []struct {
		name         string
		step         Step
		tokens, reqs int
		captured     KeySet
		want         string // error substring; "" for none
	}{
		{"eager", Step{None, BatchDescriptor{NumTokens: 3}}, 3, 2, nil, ""},
		{"eager, wrong tokens", Step{None, BatchDescriptor{NumTokens: 4}}, 3, 2, nil, "eager step describes 4 tokens, the batch has 3"},
		{"piecewise", Step{Piecewise, BatchDescriptor{NumTokens: 4}}, 3, 2, all, ""},
		{"full decode", Step{Full, decodeDesc(4, 1)}, 3, 3, all, ""},
		{"full decode not captured", Step{Full, decodeDesc(4, 1)}, 3, 3, piecewiseOnly, "stage s1 cannot replay key FULL tokens=4 reqs=4 uniform q=1"},
		{"nothing captured", Step{Piecewise, BatchDescriptor{NumTokens: 4}}, 3, 2, nil, "stage s1 cannot replay key PIECEWISE tokens=4"},
		{"unknown size", Step{Piecewise, BatchDescriptor{NumTokens: 5}}, 3, 2, all, "cannot replay key"},
		{"too many tokens", Step{Piecewise, BatchDescriptor{NumTokens: 4}}, 5, 2, all, "batch of 5 tokens exceeds"},
		{"too many requests", Step{Full, decodeDesc(4, 1)}, 4, 5, all, "batch of 5 requests exceeds"},
		{"not uniform", Step{Full, decodeDesc(4, 1)}, 4, 2, all, "is not a uniform decode of 1 tokens per request"},
		{"dual mode", Step{FullAndPiecewise, BatchDescriptor{NumTokens: 4}}, 4, 2, all, "FULL_AND_PIECEWISE is not a runtime mode"},
		{"invalid mode", Step{Mode(77), BatchDescriptor{NumTokens: 4}}, 4, 2, all, "Mode(77) is not a runtime mode"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.step.Validate("s1", tc.tokens, tc.reqs, tc.captured)
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("Validate: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("Validate error = %v, want one containing %q", err, tc.want)
			}
		})
	}
}

// FuzzStepValidate feeds Validate steps as a peer could send them: it
// must not panic, and it accepts a replayed step only when the stage
// captured its key and the batch fits it.
func FuzzStepValidate(f *testing.F) {
	f.Add(uint8(Full), 4, 4, true, 1, 3, 3)
	f.Add(uint8(Piecewise), 8, 0, false, 0, 7, 2)
	f.Add(uint8(None), 5, 0, false, 0, 5, 1)
	f.Add(uint8(200), -1, -1, true, -1, -1, -1)
	d, err := NewDispatcher(Config{Mode: Full, CaptureSizes: []int{1, 2, 4, 8}})
	if err != nil {
		f.Fatal(err)
	}
	keys := NewKeySet(d.Keys())
	f.Fuzz(func(t *testing.T, mode uint8, tokens, reqs int, uniform bool, q, numTokens, numReqs int) {
		s := Step{Mode(mode), BatchDescriptor{NumTokens: tokens, NumReqs: reqs, UniformDecode: uniform, QueryLen: q}}
		if err := s.Validate("s", numTokens, numReqs, keys); err == nil && s.Mode != None {
			if !keys.Has(s) || numTokens > tokens {
				t.Errorf("Validate accepted %s for %d tokens of %d requests", s, numTokens, numReqs)
			}
		}
	})
}

func BenchmarkDispatch(b *testing.B) {
	d, err := NewDispatcher(Config{Mode: FullAndPiecewise})
	if err != nil {
		b.Fatal(err)
	}
	r := rand.New(rand.NewPCG(3, 4))
	type in struct {
		n       int
		uniform bool
	}
	ins := make([]in, 1024)
	for i := range ins {
		ins[i] = in{1 + r.IntN(600), r.IntN(2) == 0}
	}
	for i := 0; b.Loop(); i++ {
		c := ins[i&1023]
		d.Dispatch(c.n, c.uniform, c.n)
	}
}
