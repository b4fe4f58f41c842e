package cuda

import (
	"fmt"
	"math"
	"testing"

	"github.com/tandem-llm/tandem/gpu"
)

// TestNormKernel checks rmsnorm_cluster against a float64 RMSNorm on
// random inputs at the 1B and 8B shapes' hidden sizes: the pending output's
// planes (none, cuBLAS's two halves, gemvs's eight) added into the residual
// rows and written back, the normalised rows as bf16 with and without their
// rounding remainders, and rows picked by a row map (the LM head's, a row
// twice). It launches as the stage does, as a dependent launch where the
// device has them.
func TestNormKernel(t *testing.T) {
	r := newKernelRig(t)
	if r.dev.Info().Major < 9 {
		t.Skip("rmsnorm_cluster needs thread block clusters (sm_90 on); the stage uses rmsnorm here")
	}
	const eps = 1e-5
	for _, hidden := range []int{2048, 4096} {
		threads := hidden / (4 * normCluster)
		for _, tc := range []struct {
			rows, planes int
			outlo        bool
			rowmap       []int32
		}{
			{rows: 1, planes: 0}, {rows: 64, planes: 0}, {rows: 5, planes: 2, outlo: true}, {rows: 8, planes: 1}, {rows: 32, planes: 8},
			{rows: 16, planes: 4, outlo: true}, {rows: 3, rowmap: []int32{6, 0, 6}},
		} {
			t.Run(fmt.Sprintf("h%d/rows%d_planes%d_outlo%v_map%d", hidden, tc.rows, tc.planes, tc.outlo, len(tc.rowmap)), func(t *testing.T) {
				src := tc.rows // rows of the residual stream
				for _, m := range tc.rowmap {
					src = max(src, int(m)+1)
				}
				resid := r.alloc(t, src*hidden*4)
				r.fill(t, resid, src*hidden, false, 2, 0.1)
				before := r.f32s(t, resid, src*hidden)
				var y gpu.DevicePtr
				var yv []float32
				if tc.planes > 0 {
					y = r.alloc(t, tc.planes*src*hidden*4)
					r.fill(t, y, tc.planes*src*hidden, false, 1, 0)
					yv = r.f32s(t, y, tc.planes*src*hidden)
				}
				w, wv := r.randBF16(t, hidden, 0.5, 1)
				outlo := 0
				if tc.outlo {
					outlo = tc.rows
				}
				out := r.alloc(t, 2*tc.rows*hidden*2)
				r.poison(t, out, 2*tc.rows*hidden*2)
				var rowmap gpu.DevicePtr
				if tc.rowmap != nil {
					rowmap = r.alloc(t, 4*len(tc.rowmap))
					r.upload(t, rowmap, gpu.AsBytes(tc.rowmap))
				}
				err := r.dev.Do(func() error {
					a := r.args.Reset().Ptr(resid).Ptr(y).Int32(int32(src)).Ptr(w).Ptr(out).Int32(int32(outlo)).
						Ptr(rowmap).Int32(int32(hidden)).Float32(eps).Int32(int32(tc.planes))
					f := r.fn[kRMSNormC]
					grid, block := gpu.Dim3{X: normCluster, Y: uint32(tc.rows)}, gpu.Dim3{X: uint32(threads)}
					launch := f.Launch
					if r.dependents {
						launch = f.LaunchDependent
					}
					if err := launch(grid, block, 0, r.st, a); err != nil {
						return err
					}
					return r.st.Synchronize()
				})
				if err != nil {
					t.Fatal(err)
				}
				after := r.f32s(t, resid, src*hidden)
				ov := r.bf16s(t, out, 2*tc.rows*hidden)
				worst := 0.0
				for row := range tc.rows {
					s := row
					if tc.rowmap != nil {
						s = int(tc.rowmap[row])
					}
					// The row with the planes added as the kernel adds them,
					// in float32 and in their order.
					x := make([]float64, hidden)
					ss := 0.0
					for i := range hidden {
						v := before[s*hidden+i]
						if tc.planes > 0 {
							a := yv[s*hidden+i]
							for p := 1; p < tc.planes; p++ {
								a += yv[(p*src+s)*hidden+i]
							}
							v += a
						}
						x[i] = float64(v)
						ss += x[i] * x[i]
						if got := after[s*hidden+i]; got != v {
							t.Fatalf("row %d element %d: residual %v, want %v", s, i, got, v)
						}
					}
					inv := 1 / math.Sqrt(ss/float64(hidden)+eps)
					for i := range hidden {
						want := x[i] * inv * wv[i]
						got, round := ov[row*hidden+i], 1.0/256
						if tc.outlo {
							got, round = got+ov[(row+outlo)*hidden+i], 1.0/(1<<15)
						}
						e, bound := math.Abs(got-want), round*math.Abs(want)+1e-6
						if !(e <= bound) {
							t.Fatalf("row %d element %d: got %v, want %v (bound %.3g)", row, i, got, want, bound)
						}
						worst = max(worst, e/bound)
					}
				}
				t.Logf("worst error %.3g of its bound", worst)
			})
		}
	}
}
