package cuda

import (
	"fmt"

	"github.com/tandem-llm/tandem/gpu"
)

// The cuBLAS path's gate|up product with SwiGLU in its epilogue, a
// dependent launch (kernels/gemvg.cu).
const (
	gemvgThreads  = 256                   // GEMVG_THREADS
	gemvgFeatures = 8 * gemvgThreads / 32 // features of a block: 8 a warp
)

func gemvgName(nt int) string { return fmt.Sprintf("gemvg_nt%d", nt) }

// gemvgNames lists the gemvg_* entry points: one for each of gemvs's
// n-tiles, as gemvsNTFor picks gemvg's too.
var gemvgNames = ntNames(gemvsNT, gemvgName)

// gemvgSmem is the dynamic shared memory of gemvg_nt<nt> for inputs of k:
// the staged rows, then the warps' weight rings.
func gemvgSmem(nt, k int) int { return nt*8*k*2 + gemvgThreads/32*wringBytes }

// gemvgFits is gemvg's rule: whether a step of T tokens (remainders lo
// rows on, 0: none) over inputs of hidden and inter features takes its
// gate|up product and SwiGLU on gemvg, on a device of sms multiprocessors
// and smem bytes of shared memory a block. A block stages all of x beside
// its warps' weight rings and holds a multiprocessor, so inter / 64 blocks
// must be one wave, and the staged rows (up to 32: 16 compensated tokens,
// 32 plain ones) and the rings must fit the shared memory.
//
// Measured on one H200 (NOTES.md, phase 20; GPU ms of a 1B decode step,
// the products of phase 19's tree against this one's): with its weights
// through the rings, 2 tokens 0.994 -> 0.945, 16 (compensated) 1.169 ->
// 1.075, 24 1.181 -> 1.055 and 32 1.204 -> 1.100 with gemvs's down and o
// beside it (gemvs.go); at 16-32 staged rows gemvg took 3-4% of that
// (1.108 -> 1.075 at 16 tokens, 1.132 -> 1.100 at 32). Phase 19's gemvg,
// its weights in register sets, was level with cuBLAS at 32 staged rows
// and lost 11% at 16 compensated tokens. The 8B shape (inter / 64 = 224
// blocks) stays on cuBLAS.
func gemvgFits(T, lo, hidden, inter, sms, smem int) bool {
	nt := gemvsNTFor(T, lo)
	return nt > 0 && hidden%wringKS == 0 && inter%gemvgFeatures == 0 &&
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
	smem := gemvgLaunchSmem(nt, H, s.dev.Info().MaxSharedPerBlockOptin)
	return s.launchDep("gemvg gate_up+silu", gemvgName(nt), grid, gpu.Dim3{X: gemvgThreads}, smem, a)
}

// gemvgLaunchSmem is the dynamic shared memory gemvg_nt<nt> over inputs of
// k is launched with on a device of optin bytes of shared memory a block:
// gemvgSmem, and at 32 staged rows (nt 4) all of optin, so that its block
// starts only on a multiprocessor no other block holds. There gemvgSmem
// (224 KB for the 1B shape) leaves room for rmsnorm_cluster's blocks, and
// its blocks starting beside the norm before it measured slower than
// starting as the norm's blocks leave (NOTES.md, phase 22; 1B GPU ms, two
// rounds: batch 24 0.998/1.005 against 0.996/0.997, 32 1.043/1.049
// against 1.029/1.033; gemvg's run 1.06 us shorter, the down product after
// it slower to start). At 16 staged rows or fewer no residency changes.
func gemvgLaunchSmem(nt, k, optin int) int {
	n := gemvgSmem(nt, k)
	if nt == 4 {
		n = max(n, optin)
	}
	return n
}
