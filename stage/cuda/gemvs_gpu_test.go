package cuda

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/stage"
)

// TestGemvsKernel checks gemvs_nt* against a float64 product on random
// bf16 inputs at the 1B and 8B shapes' q|k|v and o and the 1B shape's
// down: the planes, poisoned first, add up to x·Wᵀ for every row count's
// n-tiles and every split the products take (1B down and 8B q|k|v: 2,048
// k).
func TestGemvsKernel(t *testing.T) {
	r := newKernelRig(t)
	rng := rand.New(rand.NewPCG(3, 3))
	for _, p := range []struct {
		name    string
		out, in int
	}{{"1B qkv", 3072, 2048}, {"1B o", 2048, 2048}, {"8B qkv", 6144, 4096}, {"8B o", 4096, 4096}, {"1B down", 2048, 8192}} {
		w, wv := r.randBF16(t, p.out*p.in, 0.05, 0)
		for _, tc := range []struct{ tokens, lo int }{{2, 2}, {3, 3}, {8, 8}, {13, 13}, {16, 16}, {5, 0}, {20, 0}, {32, 0}} {
			rows := tc.tokens + tc.lo
			x, xv := r.randBF16(t, rows*p.in, 1, 0)
			for _, kb := range []int{256, 512, 1024, 2048} {
				if kb > p.in || (kb > 1024 && p.in < 4096) {
					continue
				}
				t.Run(fmt.Sprintf("%s/t%d_lo%d/kb%d", p.name, tc.tokens, tc.lo, kb), func(t *testing.T) {
					nt := gemvsNTFor(tc.tokens, tc.lo)
					name, sm := gemvsName(nt), gemvsSmem(nt, kb)
					if sm > r.dev.Info().MaxSharedPerBlockOptin {
						t.Skipf("%d bytes of shared memory: more than a block has", sm)
					}
					splits := p.in / kb
					y := r.alloc(t, splits*tc.tokens*p.out*4)
					r.poison(t, y, splits*tc.tokens*p.out*4)
					a := r.args.Reset().Ptr(w).Ptr(x).Ptr(y).Int32(int32(p.out)).Int32(int32(p.in)).
						Int32(int32(tc.tokens)).Int32(int32(tc.lo)).Int32(int32(kb))
					r.launch(t, name, gpu.Dim3{X: uint32(p.out / gemvsRowBlock), Y: uint32(splits)}, gemvsThreads, sm, a)
					yv := r.f32s(t, y, splits*tc.tokens*p.out)
					worst := 0.0
					for i := 0; i < 400; i++ {
						tok, f := rng.IntN(tc.tokens), rng.IntN(p.out)
						if i < 4 { // the corners
							tok, f = (i&1)*(tc.tokens-1), (i>>1)*(p.out-1)
						}
						var want, scale float64
						for k := 0; k < p.in; k++ {
							xk := xv[tok*p.in+k]
							if tc.lo > 0 {
								xk += xv[(tok+tc.lo)*p.in+k]
							}
							v := xk * wv[f*p.in+k]
							want += v
							scale += v * v
						}
						var got float64
						for s := 0; s < splits; s++ {
							got += float64(yv[(s*tc.tokens+tok)*p.out+f])
						}
						e := math.Abs(got-want) / math.Sqrt(scale)
						if !(e <= 1e-5) {
							t.Fatalf("token %d feature %d: got %v, want %v (error %.3g of the terms' norm)", tok, f, got, want, e)
						}
						worst = max(worst, e)
					}
					t.Logf("worst error %.3g of the terms' norm", worst)
				})
			}
		}
	}
}

// TestGemvsStep runs decode steps of the bench shapes (TANDEM_BENCH_SHAPES)
// on two stages of the same weights, one with the small products on gemvs
// (and the gate|up product with SiLU·mul on gemvg where it applies) and
// one on cuBLAS (and silu_mul), from FULL and PIECEWISE graphs in turn (the latter
// running attention eagerly between captured products), and compares
// their logits: within tuneTol for compensated steps, within bf16Tol for
// steps past CompensatedTokens, whose bf16-rounded activations turn the
// two paths' last-bit differences into bf16 steps that grow layer by
// layer and step by step (NOTES.md, phase 18: 0.0096 at 32 tokens, where
// compensated steps stay under 0.003).
func TestGemvsStep(t *testing.T) {
	models := benchModels(t)
	if len(models) == 0 {
		t.Skip("TANDEM_BENCH_SHAPES is not set: no shape to run")
	}
	for _, bm := range models {
		t.Run(bm.name, func(t *testing.T) {
			cfg := bm.cfg
			const prompt = 64
			c := Config{Model: cfg, Lo: 0, Hi: cfg.NumLayers, Weights: bm.weights, MaxTokens: 512, MaxSeqs: 32,
				MaxSeqLen: 1024, MaxLogitRows: 64}
			sts := []*Stage{openTestStage(t, c), openTestStage(t, c)}
			if !sts[0].gemvs {
				t.Skip("the device cannot run gemvs")
			}
			sts[1].gemvs = false
			ds := []*graphs.Dispatcher{
				mustDispatcher(t, graphs.Config{Mode: graphs.Full, MaxCaptureSize: 64, MaxNumSeqs: 32}),
				mustDispatcher(t, graphs.Config{Mode: graphs.Piecewise, MaxCaptureSize: 64, MaxNumSeqs: 32}),
			}
			keys := append(ds[0].Keys(), ds[1].Keys()...)
			for _, st := range sts {
				if err := st.Capture(keys); err != nil {
					t.Fatal(err)
				}
			}
			tables := tablesFor(sts...)
			rng := rand.New(rand.NewPCG(7, 7))
			ctx := context.Background()
			next := uint64(1)
			for _, batch := range []int{2, 3, 8, 16, 32} {
				ids, last := prefillGroups(t, sts, tables, &next, batch, prompt, func(_, _ int) int32 { return int32(rng.IntN(cfg.VocabSize)) })
				worst := 0.0
				for step := 0; step < 8; step++ {
					b := decodeBatch(t, tables, next, ids, last, prompt, step)
					next++
					for k := range b.Seqs {
						b.Seqs[k].Logits = true
					}
					m, desc := ds[step%2].Dispatch(batch, true, batch)
					b.Graph = graphs.Step{Mode: m, Desc: desc}
					var outs [2]*stage.Output
					for i, st := range sts {
						out, err := st.Forward(ctx, b)
						if err != nil {
							t.Fatal(err)
						}
						outs[i] = out
					}
					for k := range outs[0].Logits {
						g, c := outs[0].Logits[k].Rows[0], outs[1].Logits[k].Rows[0]
						var num, den float64
						for v := range g {
							num += (float64(g[v]) - float64(c[v])) * (float64(g[v]) - float64(c[v]))
							den += float64(c[v]) * float64(c[v])
						}
						worst = max(worst, math.Sqrt(num/den))
						last[k] = outs[1].Sampled[k].Token
					}
				}
				t.Logf("%s batch %d: logits on gemvs and on cuBLAS at most %.3g apart (relative L2)", bm.name, batch, worst)
				tol := tuneTol
				if batch > sts[0].compTokens {
					tol = bf16Tol
				}
				if !(worst < tol) {
					t.Errorf("%s batch %d: logits %.3g apart", bm.name, batch, worst)
				}
				for _, id := range ids {
					for _, st := range sts {
						st.Free(id)
					}
					tables.Free(id)
				}
			}
		})
	}
}

// TestGemvgKernel checks gemvg_nt* against a float64 SwiGLU of float64
// products on random bf16 inputs at the 1B shape's gate|up (and a k of
// 512): every feature's output, poisoned first, with its remainder row
// for compensated steps, within the bf16 rounding of the output (plain)
// or of its remainder (compensated) plus fp32 accumulation's share of the
// terms' norms.
func TestGemvgKernel(t *testing.T) {
	r := newKernelRig(t)
	info := r.dev.Info()
	for _, p := range []struct {
		name      string
		inter, in int
	}{{"1B gate_up", 8192, 2048}, {"k512", 512, 512}} {
		w, wv := r.randBF16(t, 2*p.inter*p.in, 0.05, 0)
		for _, tc := range []struct{ tokens, lo int }{{2, 2}, {3, 3}, {5, 5}, {8, 8}, {13, 13}, {16, 16}, {1, 0}, {5, 0}, {13, 0}, {16, 0}, {24, 0}, {32, 0}} {
			t.Run(fmt.Sprintf("%s/t%d_lo%d", p.name, tc.tokens, tc.lo), func(t *testing.T) {
				if nt := gemvsNTFor(tc.tokens, tc.lo); nt == 0 || gemvgSmem(nt, p.in) > info.MaxSharedPerBlockOptin {
					t.Skipf("gemvg has no entry for %d tokens of this shape on this device", tc.tokens)
				}
				rows := tc.tokens + tc.lo
				x, xv := r.randBF16(t, rows*p.in, 1, 0)
				out := r.alloc(t, rows*p.inter*2)
				r.poison(t, out, rows*p.inter*2)
				nt := gemvsNTFor(tc.tokens, tc.lo)
				a := r.args.Reset().Ptr(w).Ptr(x).Ptr(out).Int32(int32(p.inter)).Int32(int32(p.in)).
					Int32(int32(tc.tokens)).Int32(int32(tc.lo))
				r.launch(t, gemvgName(nt), gpu.Dim3{X: uint32(p.inter / gemvgFeatures)}, gemvgThreads, gemvgSmem(nt, p.in), a)
				ov := r.bf16s(t, out, rows*p.inter)
				round := 1.0 / 256 // a bf16 output: half a unit is 2^-9 of it
				if tc.lo > 0 {
					round = 1.0 / (1 << 15) // value plus rounded remainder
				}
				worst := 0.0 // the largest error as a fraction of its bound
				// Every feature of the first, a middle and the last token.
				xs := make([]float64, p.in)
				for _, tok := range slices.Compact([]int{0, tc.tokens / 2, tc.tokens - 1}) {
					for k := range xs {
						xs[k] = xv[tok*p.in+k]
						if tc.lo > 0 {
							xs[k] += xv[(tok+tc.lo)*p.in+k]
						}
					}
					for f := 0; f < p.inter; f++ {
						wg, wu := wv[f*p.in:(f+1)*p.in], wv[(p.inter+f)*p.in:(p.inter+f+1)*p.in]
						var g, u, ng, nu float64
						for k, xk := range xs {
							tg, tu := xk*wg[k], xk*wu[k]
							g, u = g+tg, u+tu
							ng, nu = ng+tg*tg, nu+tu*tu
						}
						sig := 1 / (1 + math.Exp(-g))
						want := g * sig * u
						got := ov[tok*p.inter+f]
						if tc.lo > 0 {
							got += ov[(tok+tc.lo)*p.inter+f]
						}
						// d(silu(g) u) = (sig + g sig (1 - sig)) u dg + silu(g) du
						acc := 1e-5 * (math.Abs((sig+g*sig*(1-sig))*u)*math.Sqrt(ng) + math.Abs(g*sig)*math.Sqrt(nu))
						e, bound := math.Abs(got-want), round*math.Abs(want)+acc
						if !(e <= bound) {
							t.Fatalf("token %d feature %d: got %v, want %v (bound %.3g)", tok, f, got, want, bound)
						}
						worst = max(worst, e/bound)
					}
				}
				t.Logf("worst error %.3g of its bound", worst)
			})
		}
	}
}
