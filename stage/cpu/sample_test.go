package cpu

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/tandem-llm/tandem/stage"
)

// mustSample samples a row of finite logits.
func mustSample(t *testing.T, sp *sampler, logits []float32, p *stage.Sampling, index int) stage.Sampled {
	t.Helper()
	got, err := sp.sample(logits, p, index)
	if err != nil {
		t.Fatalf("sample(%v, %+v, %d): %v", logits, *p, index, err)
	}
	return got
}

func TestGreedy(t *testing.T) {
	cases := []struct {
		name   string
		logits []float32
		want   int32
	}{
		{"single", []float32{0.5}, 0},
		{"max in the middle", []float32{-1, 3, 2.5, 0}, 1},
		{"max last", []float32{-1, 0, 2.5, 7}, 3},
		{"tie goes to the lowest id", []float32{1, 4, 2, 4, 4}, 1},
		{"all equal", []float32{2, 2, 2}, 0},
		{"negative", []float32{-5, -3, -4}, 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			sp := newSampler(len(tc.logits))
			for _, p := range []stage.Sampling{
				{},                        // greedy
				{TopK: 1, Temperature: 1}, // top-k 1
				{TopK: 1, Temperature: 5, Seed: 3},
				{TopP: 1e-6, Temperature: 1}, // tiny nucleus
				{TopP: 1e-6, Temperature: 0.3, Seed: 9},
			} {
				for index := range 5 {
					got := mustSample(t, &sp, tc.logits, &p, index)
					if got.Token != tc.want {
						t.Errorf("%+v index %d: token %d, want %d", p, index, got.Token, tc.want)
					}
				}
			}
		})
	}
}

func TestLogprobs(t *testing.T) {
	logits := []float32{1, 3, -2, 3, 0.5, 2}
	lse := 0.0
	for _, v := range logits {
		lse += math.Exp(float64(v))
	}
	lse = math.Log(lse)
	sp := newSampler(len(logits))
	got := mustSample(t, &sp, logits, &stage.Sampling{Logprobs: 4}, 0)
	wantTop := []int32{1, 3, 5, 0} // descending, the tie 1/3 by id
	if got.Token != 1 {
		t.Fatalf("token %d, want 1", got.Token)
	}
	if d := math.Abs(float64(got.Logprob) - (3 - lse)); d > 1e-6 {
		t.Errorf("logprob %v, want %v", got.Logprob, 3-lse)
	}
	if len(got.Top) != len(wantTop) {
		t.Fatalf("top %+v, want tokens %v", got.Top, wantTop)
	}
	for i, tl := range got.Top {
		want := float64(logits[wantTop[i]]) - lse
		if tl.Token != wantTop[i] || math.Abs(float64(tl.Logprob)-want) > 1e-6 {
			t.Errorf("top[%d] = %+v, want token %d logprob %v", i, tl, wantTop[i], want)
		}
	}
	// A tempered draw still reports the raw log-probability.
	hot := mustSample(t, &sp, logits, &stage.Sampling{Temperature: 2, Seed: 1}, 0)
	if want := float64(logits[hot.Token]) - lse; math.Abs(float64(hot.Logprob)-want) > 1e-6 {
		t.Errorf("tempered draw of %d: logprob %v, want the raw %v", hot.Token, hot.Logprob, want)
	}
}

// TestDistribution draws many times from a 3-token vocabulary and compares
// the frequencies with the tempered, filtered softmax.
func TestDistribution(t *testing.T) {
	logits := []float32{1, 2, 0.5}
	softmax := func(ids []int, temp float64) map[int32]float64 {
		p := map[int32]float64{}
		var z float64
		for _, id := range ids {
			z += math.Exp(float64(logits[id]) / temp)
		}
		for _, id := range ids {
			p[int32(id)] = math.Exp(float64(logits[id])/temp) / z
		}
		return p
	}
	// At temperature 1 the probabilities are 0.231, 0.628, 0.140: the
	// nucleus 0.7 is {1, 0}, the nucleus 0.5 is {1}.
	cases := []struct {
		name string
		p    stage.Sampling
		want map[int32]float64
	}{
		{"temperature 0.7", stage.Sampling{Temperature: 0.7}, softmax([]int{0, 1, 2}, 0.7)},
		{"temperature 1", stage.Sampling{Temperature: 1}, softmax([]int{0, 1, 2}, 1)},
		{"temperature 3", stage.Sampling{Temperature: 3}, softmax([]int{0, 1, 2}, 3)},
		{"top-k 2", stage.Sampling{Temperature: 1, TopK: 2}, softmax([]int{0, 1}, 1)},
		{"top-k 3 is off", stage.Sampling{Temperature: 1, TopK: 3}, softmax([]int{0, 1, 2}, 1)},
		{"top-p 0.7", stage.Sampling{Temperature: 1, TopP: 0.7}, softmax([]int{0, 1}, 1)},
		{"top-p 0.5", stage.Sampling{Temperature: 1, TopP: 0.5}, softmax([]int{1}, 1)},
		{"top-p 1 is off", stage.Sampling{Temperature: 1, TopP: 1}, softmax([]int{0, 1, 2}, 1)},
		{"top-k 2 then top-p 0.7", stage.Sampling{Temperature: 1, TopK: 2, TopP: 0.7}, softmax([]int{1}, 1)},
		{"top-k 2 then top-p 0.8", stage.Sampling{Temperature: 1, TopK: 2, TopP: 0.8}, softmax([]int{0, 1}, 1)},
	}
	const n = 20000
	sp := newSampler(len(logits))
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			count := map[int32]int{}
			for i := range n {
				p := tc.p
				// half the draws vary the seed, half the index
				p.Seed = uint64(i)
				index := 0
				if i%2 == 1 {
					p.Seed, index = 12345, i
				}
				count[mustSample(t, &sp, logits, &p, index).Token]++
			}
			for id := range int32(len(logits)) {
				got := float64(count[id]) / n
				want := tc.want[id]
				// five standard deviations of a binomial frequency
				tol := 5 * math.Sqrt(want*(1-want)/n)
				if math.Abs(got-want) > tol || (want == 0 && count[id] > 0) {
					t.Errorf("token %d: frequency %.4f, want %.4f ± %.4f", id, got, want, tol)
				}
			}
		})
	}
}

func TestSeedDeterminism(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	logits := make([]float32, 50)
	for i := range logits {
		logits[i] = float32(rng.NormFloat64())
	}
	p := stage.Sampling{Temperature: 1.5, TopK: 40, TopP: 0.95, Seed: 77}
	sp := newSampler(len(logits))
	var first []int32
	for index := range 64 {
		first = append(first, mustSample(t, &sp, logits, &p, index).Token)
	}
	// Same seed and index, fresh sampler, reverse order: same tokens.
	other := newSampler(len(logits))
	for index := 63; index >= 0; index-- {
		if got := mustSample(t, &other, logits, &p, index).Token; got != first[index] {
			t.Errorf("index %d: token %d, first run gave %d", index, got, first[index])
		}
	}
	// Another seed gives another sequence.
	p.Seed = 78
	same := 0
	for index := range 64 {
		if mustSample(t, &sp, logits, &p, index).Token == first[index] {
			same++
		}
	}
	if same == 64 {
		t.Error("seeds 77 and 78 drew the same 64 tokens")
	}
	// Varying the index varies the draw.
	if slices.Min(first) == slices.Max(first) {
		t.Errorf("64 draws at temperature 1.5 all gave token %d", first[0])
	}
}

func TestCheckSampling(t *testing.T) {
	cases := []struct {
		name string
		p    stage.Sampling
		ok   bool
	}{
		{"greedy", stage.Sampling{}, true},
		{"full", stage.Sampling{Temperature: 0.8, TopK: 50, TopP: 0.9, Seed: 1, Logprobs: 5}, true},
		{"top-p 1", stage.Sampling{Temperature: 1, TopP: 1}, true},
		{"logprobs = vocab", stage.Sampling{Logprobs: 10}, true},
		{"top-k past vocab", stage.Sampling{Temperature: 1, TopK: 11}, true},
		{"negative temperature", stage.Sampling{Temperature: -0.1}, false},
		{"NaN temperature", stage.Sampling{Temperature: float32(math.NaN())}, false},
		{"infinite temperature", stage.Sampling{Temperature: float32(math.Inf(1))}, false},
		{"negative top-k", stage.Sampling{TopK: -1}, false},
		{"negative top-p", stage.Sampling{TopP: -0.5}, false},
		{"top-p above 1", stage.Sampling{TopP: 1.01}, false},
		{"NaN top-p", stage.Sampling{TopP: float32(math.NaN())}, false},
		{"negative logprobs", stage.Sampling{Logprobs: -1}, false},
		{"logprobs past vocab", stage.Sampling{Logprobs: 11}, false},
	}
	for _, tc := range cases {
		if err := tc.p.Validate(10); (err == nil) != tc.ok {
			t.Errorf("%s: error %v, want ok=%v", tc.name, err, tc.ok)
		}
	}
}

// TestTopN compares the heap selection with a full sort, on logits with many
// ties.
func TestTopN(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for trial := range 200 {
		logits := make([]float32, 1+rng.IntN(60))
		for i := range logits {
			logits[i] = float32(rng.IntN(8))
		}
		n := 1 + rng.IntN(len(logits))
		want := make([]int32, len(logits))
		for i := range want {
			want[i] = int32(i)
		}
		slices.SortFunc(want, func(a, b int32) int {
			return cmp.Or(cmp.Compare(logits[b], logits[a]), cmp.Compare(a, b))
		})
		got := topN(logits, n, make([]int32, 0, len(logits)))
		if !slices.Equal(got, want[:n]) {
			t.Fatalf("trial %d: topN(%v, %d) = %v, want %v", trial, logits, n, got, want[:n])
		}
	}
}

// TestNucleus compares the pre-filtered nucleus with the smallest prefix of
// the fully sorted distribution reaching top-p.
func TestNucleus(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for trial := range 500 {
		cands := make([]candidate, 1+rng.IntN(200))
		var total float64
		for i := range cands {
			p := math.Exp(4 * rng.NormFloat64())
			if rng.IntN(5) == 0 && i > 0 {
				p = cands[rng.IntN(i)].p // ties
			}
			cands[i] = candidate{id: int32(i), p: p}
			total += p
		}
		topP := rng.Float64()
		sorted := slices.Clone(cands)
		slices.SortFunc(sorted, func(a, b candidate) int {
			return cmp.Or(cmp.Compare(b.p, a.p), cmp.Compare(a.id, b.id))
		})
		var want []candidate
		var cum float64
		for _, c := range sorted {
			want = append(want, c)
			cum += c.p
			if cum >= topP*total {
				break
			}
		}
		got, gotTotal := nucleus(slices.Clone(cands), total, topP)
		if !slices.Equal(got, want) || gotTotal != cum {
			t.Fatalf("trial %d (top-p %v): nucleus kept %d tokens (total %v), want %d (total %v)", trial, topP, len(got), gotTotal, len(want), cum)
		}
	}
}

// TestNonFinite: a row holding NaN or an infinity is refused with an error
// naming the first bad token, under every kind of sampling (at temperature
// 0.8 and top-p 0.9 a NaN row once panicked with index out of range [-1];
// greedily it gave token 0 with log-probability NaN).
func TestNonFinite(t *testing.T) {
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	rows := []struct {
		name   string
		logits []float32
		first  int
	}{
		{"all NaN", []float32{nan, nan, nan, nan}, 0},
		{"one NaN", []float32{1, 2, nan, 0}, 2},
		{"+Inf", []float32{1, inf, 2, 0}, 1},
		{"-Inf", []float32{1, 2, -inf, 0}, 2},
		{"+Inf and -Inf", []float32{-inf, inf, 0, 0}, 0},
		{"all +Inf", []float32{inf, inf, inf, inf}, 0},
	}
	params := []stage.Sampling{
		{},
		{Logprobs: 3},
		{Temperature: 0.8, TopP: 0.9},
		{Temperature: 0.8, TopP: 0.9, TopK: 2, Logprobs: 2},
		{Temperature: 1, TopK: 3},
		{Temperature: 1.5},
	}
	sp := newSampler(4)
	for _, r := range rows {
		for _, p := range params {
			got, err := sp.sample(r.logits, &p, 0)
			if err == nil {
				t.Errorf("%s, %+v: sampled %+v, want an error", r.name, p, got)
				continue
			}
			if want := fmt.Sprintf("token %d", r.first); !strings.Contains(err.Error(), want) {
				t.Errorf("%s, %+v: error %q does not name %s", r.name, p, err, want)
			}
		}
	}
}

// FuzzSample feeds the sampler rows of arbitrary float32 bit patterns (NaN,
// ±Inf, subnormals, extremes) with arbitrary valid parameters: it must
// never panic; a row with a non-finite value is refused, and any other row
// gives a token in the vocabulary with a finite log-probability ≤ 0 and
// alternatives in order.
func FuzzSample(f *testing.F) {
	row := func(v ...float32) []byte {
		b := make([]byte, 4*len(v))
		for i, x := range v {
			binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
		}
		return b
	}
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	f.Add(row(nan, nan, nan), float32(0.8), 0, float32(0.9), uint64(1), 0, 0)
	f.Add(row(1, inf, 2), float32(0), 0, float32(0), uint64(0), 0, 2)
	f.Add(row(-inf, -inf, 3), float32(1), 2, float32(0.5), uint64(5), 3, 1)
	f.Add(row(3e38, -3e38, 1e-45, 0), float32(1e-30), 0, float32(0.99), uint64(7), 1, 4)
	f.Add(row(1, 2, 3, 4, 5), float32(2), 3, float32(1), uint64(9), 9, 5)
	f.Fuzz(func(t *testing.T, raw []byte, temp float32, topK int, topP float32, seed uint64, index, logprobs int) {
		n := len(raw) / 4
		if n == 0 || n > 4096 {
			return
		}
		logits := make([]float32, n)
		finite := true
		for i := range logits {
			logits[i] = math.Float32frombits(binary.LittleEndian.Uint32(raw[4*i:]))
			finite = finite && !math.IsNaN(float64(logits[i])) && !math.IsInf(float64(logits[i]), 0)
		}
		p := stage.Sampling{Temperature: temp, TopK: topK, TopP: topP, Seed: seed, Logprobs: logprobs}
		if p.Validate(n) != nil {
			return
		}
		sp := newSampler(n)
		got, err := sp.sample(logits, &p, index)
		if !finite {
			if err == nil {
				t.Fatalf("row %v: sampled %+v, want an error", logits, got)
			}
			return
		}
		if err != nil {
			t.Fatalf("finite row %v: %v", logits, err)
		}
		okLP := func(lp float32) bool { return !math.IsNaN(float64(lp)) && !math.IsInf(float64(lp), 0) && lp <= 1e-6 }
		if got.Token < 0 || int(got.Token) >= n || !okLP(got.Logprob) {
			t.Fatalf("row %v, %+v: token %d logprob %v", logits, p, got.Token, got.Logprob)
		}
		if len(got.Top) != p.Logprobs {
			t.Fatalf("row %v: %d alternatives, want %d", logits, len(got.Top), p.Logprobs)
		}
		for i, tl := range got.Top {
			if tl.Token < 0 || int(tl.Token) >= n || !okLP(tl.Logprob) || i > 0 && tl.Logprob > got.Top[i-1].Logprob {
				t.Fatalf("row %v: alternatives %+v", logits, got.Top)
			}
		}
	})
}
