package cuda

import (
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/tandem-llm/tandem/gpu"
)

// TestGemvhKernel checks gemvh_nt* on random bf16 inputs: every logit of
// the first two, a middle and the last row against a float64 product (within
// 1e-5 sqrt(k / 128) of the terms' norm: 4e-5 at k 2,048), and each
// row's softmax partials, merged, against the row's logits as written (the
// maximum and its lowest index exactly, the sum of exponentials within
// 1e-5, no value flagged); with a NaN weight, every row's partials flag it.
// The shapes: the 1B shape's head (128,256 x 2,048: 8,016 units of 16
// rows over 1,056 warps on 132 multiprocessors) and a small one whose
// units do not divide among the warps either; rows of every n-tile, and
// n-tiles partly filled (5, 13, 17, 27 rows).
func TestGemvhKernel(t *testing.T) {
	r := newKernelRig(t)
	info := r.dev.Info()
	for _, p := range []struct {
		name     string
		vocab, k int
		rows     []int
	}{{"1B head", 128256, 2048, []int{2, 16, 27, 32}}, {"small", 32000 + 48, 512, []int{1, 2, 5, 8, 13, 16, 17, 27, 32}}} {
		w, wv := r.randBF16(t, p.vocab*p.k, 0.05, 0)
		for _, rows := range p.rows {
			for _, nan := range []bool{false, true} {
				if nan && rows != p.rows[len(p.rows)-1] {
					continue
				}
				t.Run(fmt.Sprintf("%s/rows%d/nan%v", p.name, rows, nan), func(t *testing.T) {
					nt := gemvsNTFor(rows, 0)
					if !gemvhFits(rows, p.k, p.vocab, info.MaxSharedPerBlockOptin) {
						t.Skipf("gemvh does not take %d rows of this shape on this device", rows)
					}
					const nanRow = 12345 // a vocabulary row whose weight 7 is NaN
					if nan {
						// The shape's last case.
						r.upload(t, w+gpu.DevicePtr((nanRow*p.k+7)*2), []byte{0xc0, 0x7f})
					}
					x, xv := r.randBF16(t, rows*p.k, 1, 0)
					out := r.alloc(t, rows*p.vocab*4)
					r.poison(t, out, rows*p.vocab*4)
					nstat := gemvhPartials(nt, p.vocab, info.SMs)
					stats := r.alloc(t, rows*nstat*16)
					r.poison(t, stats, rows*nstat*16)
					a := r.args.Reset().Ptr(w).Ptr(x).Ptr(out).Int32(int32(p.vocab)).Int32(int32(p.k)).Int32(int32(rows)).Ptr(stats)
					r.launch(t, gemvhName(nt), gpu.Dim3{X: uint32(gemvhBlocks(nt, p.vocab, info.SMs))}, gemvhBlockThreads(nt), gemvhSmem(nt, p.k), a)
					ov := r.f32s(t, out, rows*p.vocab)
					sv := r.f32s(t, stats, rows*nstat*4)
					worst := 0.0
					check := []int{0, min(1, rows-1), rows / 2, rows - 1}
					slices.Sort(check)
					for _, row := range slices.Compact(check) {
						xs := xv[row*p.k : (row+1)*p.k]
						for f := 0; f < p.vocab; f++ {
							if nan && f == nanRow {
								continue
							}
							var want, norm float64
							for i, xk := range xs {
								v := xk * wv[f*p.k+i]
								want, norm = want+v, norm+v*v
							}
							got := float64(ov[row*p.vocab+f])
							// One fp32 sum of k terms: its error grows as sqrt(k).
							e, bound := math.Abs(got-want), 1e-5*math.Sqrt(float64(p.k)/128*norm)+1e-30
							if !(e <= bound) {
								t.Fatalf("row %d logit %d: got %v, want %v (bound %.3g)", row, f, got, want, bound)
							}
							worst = max(worst, e/bound)
						}
					}
					for row := 0; row < rows; row++ {
						l := ov[row*p.vocab : (row+1)*p.vocab]
						m, mi, bad := math.Inf(-1), -1, false
						for i, v := range l {
							if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
								bad = true
								continue
							}
							if float64(v) > m {
								m, mi = float64(v), i
							}
						}
						if nan {
							if !bad {
								t.Fatalf("row %d: no logit is NaN, although weight row %d is", row, nanRow)
							}
						} else if bad {
							t.Fatalf("row %d: a logit is NaN or infinite", row)
						}
						// The partials merged as sample merges them.
						pm, pi, flagged := math.Inf(-1), math.MaxInt32, false
						st := sv[row*nstat*4 : (row+1)*nstat*4]
						for i := 0; i < nstat; i++ {
							v, idx := float64(st[4*i]), int(int32(math.Float32bits(st[4*i+1])))
							flagged = flagged || math.Float32bits(st[4*i+3]) != 0
							if v > pm || (v == pm && idx < pi) {
								pm, pi = v, idx
							}
						}
						if flagged != nan {
							t.Fatalf("row %d: partials flag a non-finite logit %v, want %v", row, flagged, nan)
						}
						if nan {
							continue // sample passes over the row itself
						}
						if pm != m || pi != mi {
							t.Fatalf("row %d: partials' maximum %v at %d, the logits' %v at %d", row, pm, pi, m, mi)
						}
						var z, want float64
						for i := 0; i < nstat; i++ {
							z += float64(st[4*i+2]) * math.Exp(float64(st[4*i])-pm)
						}
						for _, v := range l {
							want += math.Exp(float64(v) - m)
						}
						if math.Abs(z-want) > 1e-5*want {
							t.Fatalf("row %d: partials' sum of exponentials %v, the logits' %v", row, z, want)
						}
					}
					t.Logf("worst logit error %.3g of its bound; %d partials a row", worst, nstat)
				})
			}
		}
	}
}
