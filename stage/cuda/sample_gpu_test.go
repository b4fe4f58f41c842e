package cuda

import (
	"log/slog"
	"math"
	"math/rand/v2"
	"sort"
	"testing"

	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/stage"
)

// sampleReq is one sampling request for the sample kernel.
type sampleReq struct {
	row         int
	temperature float32
	topK        int
	topP        float32
	seed        uint64
	index       int
	logprobs    int
}

// statsFrom is where the sample kernel's softmax partials come from in
// runSampleKernel: none (its own passes over each row), blocks of 64
// logits computed here as the skinny LM head makes them, or logit_stats.
type statsFrom int

const (
	statsNone statsFrom = iota
	statsHost
	statsKernel
)

// sampleResult is the kernel's output for one request.
type sampleResult struct {
	token   int32
	logprob float32
	top     []int32
	topLP   []float32
}

// runSampleKernel runs the sample kernel over logits rows (all of one
// vocabulary size) for reqs, request i in hand-off slot 7+i, the odd ones
// applied (sampleApply), and checks the hand-off rows it reports and the
// slot tokens it records, handing it the softmax partials stats says.
func runSampleKernel(t *testing.T, logits [][]float32, reqs []sampleReq, stats statsFrom) []sampleResult {
	t.Helper()
	dev := device(t)
	s := &Stage{dev: dev, log: slog.Default()}
	img, optional, err := s.kernelImage(testDev.cache)
	if err != nil {
		t.Fatal(err)
	}
	vocab := len(logits[0])
	flat := make([]float32, 0, len(logits)*vocab)
	for _, r := range logits {
		flat = append(flat, r...)
	}
	params := make([]int32, 0, len(reqs)*sampleParams)
	for _, q := range reqs {
		params = append(params, int32(q.row), int32(math.Float32bits(q.temperature)), int32(q.topK),
			int32(math.Float32bits(q.topP)), int32(uint32(q.seed)), int32(uint32(q.seed>>32)), int32(q.index), int32(q.logprobs),
			int32(7+len(params)/sampleParams), int32(len(params)/sampleParams%2))
	}
	// The slot tokens start at -1: none recorded.
	slots := make([]int32, 7+len(reqs))
	for i := range slots {
		slots[i] = -1
	}
	stride := 2 + 2*MaxLogprobs
	out := make([]int32, len(reqs)*stride)
	handoff := make([]int32, len(reqs)*stage.HandoffCols)
	err = dev.Do(func() error {
		if err := s.loadModule(img, optional, testDev.cache); err != nil {
			return err
		}
		defer s.mod.Unload()
		var mems []gpu.Mem
		defer func() {
			for _, m := range mems {
				m.Free()
			}
		}()
		up := func(b []byte) (gpu.DevicePtr, error) {
			m, err := gpu.Alloc(len(b))
			if err != nil {
				return 0, err
			}
			mems = append(mems, m)
			return m.Ptr(), gpu.CopyHtoD(m.Ptr(), b)
		}
		lp, err := up(gpu.AsBytes(flat))
		if err != nil {
			return err
		}
		pp, err := up(gpu.AsBytes(params))
		if err != nil {
			return err
		}
		op, err := up(gpu.AsBytes(out))
		if err != nil {
			return err
		}
		tp, err := up(gpu.AsBytes(slots))
		if err != nil {
			return err
		}
		hp, err := up(gpu.AsBytes(handoff))
		if err != nil {
			return err
		}
		var sp gpu.DevicePtr
		nstat := 0
		switch stats {
		case statsKernel:
			nstat = logitStatsPartials(vocab)
			m, err := gpu.Alloc(len(logits) * nstat * 4 * 4)
			if err != nil {
				return err
			}
			mems = append(mems, m)
			sp = m.Ptr()
			var a gpu.KernelArgs
			a.Ptr(lp).Int32(int32(vocab)).Ptr(sp)
			grid := gpu.Dim3{X: uint32(len(logits)), Y: uint32(logitStatsParts(vocab))}
			if err := s.fn[kLogitStats].Launch(grid, gpu.Dim3{X: statsThreads}, 0, 0, &a); err != nil {
				return err
			}
		case statsHost:
			nstat = (vocab + 63) / 64
			st := make([]float32, 0, len(logits)*nstat*4)
			for _, row := range logits {
				for b := 0; b < nstat; b++ {
					blk := row[b*64 : min(vocab, b*64+64)]
					best := 0
					for i, v := range blk {
						if v > blk[best] {
							best = i
						}
					}
					var sum float64
					var bad uint32
					for _, v := range blk {
						sum += math.Exp(float64(v - blk[best]))
						if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
							bad = 1
						}
					}
					st = append(st, blk[best], math.Float32frombits(uint32(b*64+best)), float32(sum), math.Float32frombits(bad))
				}
			}
			if sp, err = up(gpu.AsBytes(st)); err != nil {
				return err
			}
		}
		var a gpu.KernelArgs
		a.Ptr(lp).Int32(int32(vocab)).Ptr(pp).Ptr(op).Int32(MaxLogprobs).Ptr(hp).Ptr(sp).Int32(int32(nstat)).Ptr(tp)
		if err := s.fn[kSample].Launch(gpu.Dim3{X: uint32(len(reqs))}, gpu.Dim3{X: sampleThreads}, 0, 0, &a); err != nil {
			return err
		}
		if err := gpu.CopyDtoH(gpu.AsBytes(handoff), hp); err != nil {
			return err
		}
		if err := gpu.CopyDtoH(gpu.AsBytes(slots), tp); err != nil {
			return err
		}
		return gpu.CopyDtoH(gpu.AsBytes(out), op)
	})
	if err != nil {
		t.Fatalf("sample kernel: %v", err)
	}
	res := make([]sampleResult, len(reqs))
	for i, q := range reqs {
		w := out[i*stride:]
		r := sampleResult{token: w[0], logprob: math.Float32frombits(uint32(w[1]))}
		for k := 0; k < q.logprobs; k++ {
			r.top = append(r.top, w[2+2*k])
			r.topLP = append(r.topLP, math.Float32frombits(uint32(w[3+2*k])))
		}
		res[i] = r
		want := r.token
		if want < 0 { // non-finite logits: the hand-off carries token 0
			want = 0
		}
		if slot, tok := handoff[2*i], handoff[2*i+1]; slot != int32(7+i) || tok != want {
			t.Errorf("request %d: hand-off row (%d, %d), want (%d, %d)", i, slot, tok, 7+i, want)
		}
		if want := map[bool]int32{false: -1, true: want}[i%2 == 1]; slots[7+i] != want {
			t.Errorf("request %d (applied: %v): slot %d holds token %d, want %d", i, i%2 == 1, 7+i, slots[7+i], want)
		}
	}
	return res
}

// logSoftmax64 is the float64 log-softmax of a row.
func logSoftmax64(row []float32) []float64 {
	m := math.Inf(-1)
	for _, v := range row {
		m = math.Max(m, float64(v))
	}
	z := 0.0
	for _, v := range row {
		z += math.Exp(float64(v) - m)
	}
	lz := m + math.Log(z)
	out := make([]float64, len(row))
	for i, v := range row {
		out[i] = float64(v) - lz
	}
	return out
}

// order returns token ids by descending logit, ties by id.
func order(row []float32) []int {
	ids := make([]int, len(row))
	for i := range ids {
		ids[i] = i
	}
	sort.SliceStable(ids, func(a, b int) bool { return row[ids[a]] > row[ids[b]] })
	return ids
}

func TestSampleKernelGreedyAndLogprobs(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	const vocab = 128256
	rows := make([][]float32, 3)
	for i := range rows {
		rows[i] = make([]float32, vocab)
		for j := range rows[i] {
			rows[i][j] = float32(rng.NormFloat64() * 3)
		}
	}
	// Row 2 has a tie for the maximum at ids 70000 and 900: the lower wins.
	rows[2][70000], rows[2][900] = 50, 50
	reqs := []sampleReq{
		{row: 0, logprobs: MaxLogprobs},
		{row: 1, logprobs: 5},
		{row: 2, logprobs: 3},
		{row: 0, temperature: 1, topK: 1, seed: 9},      // top-k 1 is greedy
		{row: 1, temperature: 0.7, topP: 1e-6, seed: 9}, // a tiny nucleus is greedy
	}
	for _, stats := range []statsFrom{statsNone, statsHost, statsKernel} {
		checkGreedy(t, rows, reqs, runSampleKernel(t, rows, reqs, stats))
	}
}

func checkGreedy(t *testing.T, rows [][]float32, reqs []sampleReq, res []sampleResult) {
	t.Helper()
	for i, q := range reqs {
		row := rows[q.row]
		ord := order(row)
		lp := logSoftmax64(row)
		r := res[i]
		if int(r.token) != ord[0] {
			t.Errorf("request %d: token %d; want the arg-max %d", i, r.token, ord[0])
		}
		if d := math.Abs(float64(r.logprob) - lp[r.token]); d > 1e-4 {
			t.Errorf("request %d: logprob %v; float64 log-softmax %v", i, r.logprob, lp[r.token])
		}
		for k := range r.top {
			if int(r.top[k]) != ord[k] {
				t.Errorf("request %d: top %d is %d; want %d", i, k, r.top[k], ord[k])
			}
			if d := math.Abs(float64(r.topLP[k]) - lp[ord[k]]); d > 1e-4 {
				t.Errorf("request %d: top %d logprob %v; want %v", i, k, r.topLP[k], lp[ord[k]])
			}
		}
	}
	if res[2].token != 900 || res[2].top[1] != 70000 {
		t.Errorf("tie: token %d, second %d; want 900 then 70000", res[2].token, res[2].top[1])
	}
}

// TestSampleKernelNonFinite: a row holding NaN or an infinity reports token
// -1 and the count of bad values (hand-off token 0) under every kind of
// sampling, and a finite row sampled in the same launch is unaffected.
func TestSampleKernelNonFinite(t *testing.T) {
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	rows := [][]float32{
		{1, 2, 3, 4, 5, 6, 7, 8},
		{nan, nan, nan, nan, nan, nan, nan, nan},
		{1, inf, 3, 4, 5, 6, 7, 8},
		{1, 2, -inf, 4, nan, 6, 7, 8},
	}
	var reqs []sampleReq
	for _, sp := range []sampleReq{{}, {temperature: 0.8, topP: 0.9, seed: 1, logprobs: 2}, {temperature: 1, topK: 3, seed: 2}} {
		for row := range rows {
			q := sp
			q.row = row
			reqs = append(reqs, q)
		}
	}
	for _, stats := range []statsFrom{statsNone, statsHost, statsKernel} {
		checkNonFinite(t, reqs, runSampleKernel(t, rows, reqs, stats))
	}
}

// checkNonFinite checks the sampler's refusals of the rows of
// TestSampleKernelNonFinite.
func checkNonFinite(t *testing.T, reqs []sampleReq, res []sampleResult) {
	t.Helper()
	wantBad := []int32{0, 8, 1, 2}
	for i, q := range reqs {
		r := res[i]
		switch {
		case wantBad[q.row] > 0 && (r.token != -1 || math.Float32bits(r.logprob) != uint32(wantBad[q.row])):
			t.Errorf("request %d (row %d): token %d, word %d; want -1 and %d bad values", i, q.row, r.token, math.Float32bits(r.logprob), wantBad[q.row])
		case wantBad[q.row] == 0 && (r.token < 0 || r.token >= 8 || math.IsNaN(float64(r.logprob))):
			t.Errorf("request %d (finite row): token %d logprob %v", i, r.token, r.logprob)
		}
	}
}

func TestSampleKernelDistribution(t *testing.T) {
	probs := []float64{0.5, 0.3, 0.2}
	row := make([]float32, len(probs))
	for i, p := range probs {
		row[i] = float32(math.Log(p)) + 4 // a shift changes nothing
	}
	const n = 20000
	tempered := func(temp float64) []float64 {
		w := make([]float64, len(probs))
		sum := 0.0
		for i, p := range probs {
			w[i] = math.Pow(p, 1/temp)
			sum += w[i]
		}
		for i := range w {
			w[i] /= sum
		}
		return w
	}
	tests := []struct {
		name string
		q    sampleReq
		want []float64
	}{
		{"temperature 1", sampleReq{temperature: 1, seed: 42}, probs},
		{"temperature 2", sampleReq{temperature: 2, seed: 43}, tempered(2)},
		{"temperature 0.5", sampleReq{temperature: 0.5, seed: 44}, tempered(0.5)},
		{"top-k 2", sampleReq{temperature: 1, topK: 2, seed: 45}, []float64{0.625, 0.375, 0}},
		{"top-p 0.6", sampleReq{temperature: 1, topP: 0.6, seed: 46}, []float64{0.625, 0.375, 0}},
		{"top-p 0.45", sampleReq{temperature: 1, topP: 0.45, seed: 47}, []float64{1, 0, 0}},
		{"top-k 2 then top-p 0.55", sampleReq{temperature: 1, topK: 2, topP: 0.55, seed: 48}, []float64{1, 0, 0}},
		{"top-k 2 then top-p 0.7", sampleReq{temperature: 1, topK: 2, topP: 0.7, seed: 49}, []float64{0.625, 0.375, 0}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			reqs := make([]sampleReq, n)
			for i := range reqs {
				reqs[i] = tc.q
				reqs[i].index = i
			}
			res := runSampleKernel(t, [][]float32{row}, reqs, statsNone)
			counts := make([]float64, len(probs))
			for _, r := range res {
				counts[r.token]++
			}
			for i := range counts {
				f := counts[i] / n
				// Four standard deviations of a binomial frequency.
				tol := 4*math.Sqrt(tc.want[i]*(1-tc.want[i])/n) + 1e-9
				if math.Abs(f-tc.want[i]) > tol {
					t.Errorf("token %d drawn %.4f of the time; want %.4f ± %.4f", i, f, tc.want[i], tol)
				}
			}
			// The same seed and index give the same token.
			again := runSampleKernel(t, [][]float32{row}, reqs[:200], statsNone)
			for i := range again {
				if again[i].token != res[i].token {
					t.Fatalf("index %d: token %d, then %d with the same seed", i, res[i].token, again[i].token)
				}
			}
		})
	}
}

func TestSampleKernelLargeVocabFilters(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	const vocab = 50000
	row := make([]float32, vocab)
	for j := range row {
		row[j] = float32(rng.NormFloat64() * 2)
	}
	ord := order(row)
	rank := make([]int, vocab)
	for r, id := range ord {
		rank[id] = r
	}
	// The nucleus of p = 0.5 at temperature 0.8, in float64.
	lp := make([]float32, vocab)
	for i, v := range row {
		lp[i] = v / 0.8
	}
	l64 := logSoftmax64(lp)
	nucleus, mass := 0, 0.0
	for mass < 0.5 {
		mass += math.Exp(l64[ord[nucleus]])
		nucleus++
	}
	const n = 500
	var reqs []sampleReq
	for i := 0; i < n; i++ {
		reqs = append(reqs, sampleReq{temperature: 1, topK: 50, seed: 5, index: i})
	}
	for i := 0; i < n; i++ {
		reqs = append(reqs, sampleReq{temperature: 0.8, topP: 0.5, seed: 6, index: i})
	}
	res := runSampleKernel(t, [][]float32{row}, reqs, statsNone)
	seen := map[int32]bool{}
	for i, r := range res {
		limit, what := 50, "top-k 50"
		if i >= n {
			limit, what = nucleus, "top-p 0.5"
		}
		if rank[r.token] >= limit {
			t.Fatalf("%s drew token %d of rank %d; the filter keeps %d", what, r.token, rank[r.token], limit)
		}
		seen[r.token] = true
	}
	if len(seen) < 20 {
		t.Errorf("only %d distinct tokens in %d draws: the draws look degenerate", len(seen), 2*n)
	}
	t.Logf("nucleus of p=0.5 holds %d tokens; %d distinct tokens drawn", nucleus, len(seen))
}
