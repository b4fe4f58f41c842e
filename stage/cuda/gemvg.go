package cuda

import (
	"fmt"

	"github.com/tandem-llm/tandem/gpu"
)

// The cuBLAS path's gate|up product with SwiGLU in its epilogue, a
// dependent launch (kernels/gemvg.cu).
const (
	gemvgThreads  = 256                   // GEMVG_THREADS
	gemvgPad      = 32                    // GEMVG_PAD: bf16 between staged rows beyond k
	gemvgSets     = 4                     // GEMVG_SETS: register sets of 128 k a lane
	gemvgFeatures = 8 * gemvgThreads / 32 // features of a block: 8 a warp
	gemvgKStep    = 128 * gemvgSets       // k must be a multiple of it
)

// gemvgNT are the gemvg entries' n-tiles of 8 staged rows (gemvsNTFor
// picks one for a step).
var gemvgNT = []int{1, 2}

func gemvgName(nt int) string { return fmt.Sprintf("gemvg_nt%d", nt) }

// gemvgNames lists the gemvg_* entry points.
var gemvgNames = func() []string {
	var n []string
	for _, nt := range gemvgNT {
		n = append(n, gemvgName(nt))
	}
	return n
}()

// gemvgSmem is the dynamic shared memory of gemvg_nt<nt> for inputs of k.
func gemvgSmem(nt, k int) int { return nt * 8 * (k + gemvgPad) * 2 }

// gemvgFits is gemvg's rule: whether a step of T tokens (remainders lo
// rows on, 0: none) over inputs of hidden and inter features takes its
// gate|up product and SwiGLU on gemvg, on a device of sms multiprocessors
// and smem bytes of shared memory a block. A block stages all of x and
// holds a multiprocessor, so inter / 64 blocks must be one wave and the
// staged rows must fit the shared memory; and the step must stage at most
// 16 rows (2 n-tiles: up to 8 compensated tokens, 16 plain ones).
//
// Measured on one H200 (NOTES.md, phase 19; the same binary's cuBLAS
// gate|up and silu_mul as the reference, GPU ms of a 1B decode step):
// 2, 4 and 8 tokens 4% faster (1.034 -> 0.991, 1.046 -> 1.002, 1.078 ->
// 1.033). At 32 staged rows (4 n-tiles) it was level with cuBLAS at 24-32
// plain tokens (its loop at about 2.6 TB/s, cuBLAS's product 3.0 plus
// silu_mul), and at 16 compensated tokens 11% slower (1.16 -> 1.29 ms):
// launched early beside gemvs's o product of 128 blocks, it held the
// multiprocessors the step needed (launched plainly it was level). The
// 8B shape (inter / 64 = 224 blocks) stays on cuBLAS.
func gemvgFits(T, lo, hidden, inter, sms, smem int) bool {
	nt := gemvsNTFor(T, lo)
	return nt > 0 && nt <= gemvgNT[len(gemvgNT)-1] && hidden%gemvgKStep == 0 && inter%gemvgFeatures == 0 &&
		inter/gemvgFeatures <= sms && gemvgSmem(nt, hidden) <= smem
}

// gemvg reports whether the stage runs the gate|up product and SwiGLU of a
// step of T tokens (remainders lo rows on) on gemvg: only as a dependent
// launch, like gemvs.
func (s *Stage) gemvg(T, lo int) bool {
	info := s.dev.Info()
	return s.gemvs && gemvgFits(T, lo, s.m.HiddenSize, s.m.IntermediateSize, info.SMs, info.MaxSharedPerBlockOptin)
}

// gateUpSilu orders gemvg: act = silu(x·gateᵀ) * (x·upᵀ) for the T token
// rows x (remainders lo rows on, the output's too) and the layer's gate|up
// weight w.
func (s *Stage) gateUpSilu(act, x, w gpu.DevicePtr, T, lo int) error {
	H, I := s.m.HiddenSize, s.m.IntermediateSize
	nt := gemvsNTFor(T, lo)
	a := s.args.Reset().Ptr(w).Ptr(x).Ptr(act).Int32(int32(I)).Int32(int32(H)).Int32(int32(T)).Int32(int32(lo))
	grid := gpu.Dim3{X: uint32(I / gemvgFeatures)}
	return s.launchDep("gemvg gate_up+silu", gemvgName(nt), grid, gpu.Dim3{X: gemvgThreads}, gemvgSmem(nt, H), a)
}
