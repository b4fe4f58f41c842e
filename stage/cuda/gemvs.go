package cuda

import (
	"fmt"

	"github.com/tandem-llm/tandem/gpu"
)

// The cuBLAS path's small products as dependent launches (kernels/gemvs.cu).
const (
	gemvsThreads  = 256  // GEMVS_THREADS
	gemvsPad      = 32   // GEMVS_PAD: bf16 between staged rows beyond kb
	gemvsRowBlock = 128  // weight rows of a block
	gemvsMaxKB    = 1024 // the largest split of k a block stages
	maxPlanes     = 8    // MAX_PLANES in 00_common.cu: gemvs's most splits
)

// gemvsNT are the gemvs entries' n-tiles of 8 staged rows.
var gemvsNT = []int{1, 2, 4}

func gemvsName(nt int) string { return fmt.Sprintf("gemvs_nt%d", nt) }

// gemvsNames lists the gemvs_* entry points.
var gemvsNames = func() []string {
	var n []string
	for _, nt := range gemvsNT {
		n = append(n, gemvsName(nt))
	}
	return n
}()

// gemvsSmem is the dynamic shared memory of gemvs_nt<nt> over splits of kb.
func gemvsSmem(nt, kb int) int { return nt * 8 * (kb + gemvsPad) * 2 }

// planes is how a product's output lies for its consumer: n planes,
// stride rows apart, added up in order (kernels/00_common.cu, MAX_PLANES).
type planes struct{ stride, n int }

// cublasPlanes is the output of cuBLAS's product of a step whose
// remainder rows are lo rows on (0: none).
func cublasPlanes(lo int) planes {
	if lo == 0 {
		return planes{0, 1}
	}
	return planes{lo, 2}
}

// gemvsKB is the split of k (kb) gemvs takes for a product in -> out of a
// decode step of T tokens (remainders lo rows on, 0: none) on this stage,
// and whether it takes it at all (gemvsSplit).
func (s *Stage) gemvsKB(T, lo, in, out int) (int, bool) {
	if !s.gemvs {
		return 0, false
	}
	return gemvsSplit(T, lo, in, out, s.dev.Info().MaxSharedPerBlockOptin, s.pl.lay.maxTokens)
}

// gemvsSplit is gemvsKB's rule, for a device of smem bytes of shared
// memory a block and a workspace of maxTokens token rows. Measured on one
// H200 (NOTES.md, phase 12, call 6, the same binary with gemvs off as the
// reference): steps of 4-8 tokens gain 8-10% (1B) and 4-5% (8B) with 4
// splits; at 16 tokens, 8 splits gain 4% where a split is one burst of 256
// k a warp (1B) and lose where it is two (8B); past 16 tokens the
// products' tensor-core work after the wait and their consumers' planes
// cost more than the early start gains, so those stay on cuBLAS. That
// holds for plain steps too (past Config.CompensatedTokens), although
// 32 plain tokens stage no more rows than 16 compensated ones: 1B batch
// 32 on gemvs with 8 splits 1.248 ms against 1.234 on cuBLAS (phase 18).
// Hence
// 4 splits up to 8 tokens, 8 of 256 k up to 16 (with or without the
// remainders, which only add work), out a multiple of 128, kb a multiple
// of 256 of at most gemvsMaxKB, and the planes' rows within the output
// buffer's 2 * maxTokens.
func gemvsSplit(T, lo, in, out, smem, maxTokens int) (int, bool) {
	nt := gemvsNTFor(T, lo)
	if nt == 0 || T > 16 || out%gemvsRowBlock != 0 {
		return 0, false
	}
	splits := 4
	if T > 8 {
		splits = 8
	}
	kb := in / splits
	switch {
	case in%splits != 0, kb%256 != 0, kb > gemvsMaxKB, splits == 8 && kb != 256,
		gemvsSmem(nt, kb) > smem, splits*T > 2*maxTokens:
		return 0, false
	}
	return kb, true
}

// gemvsNTFor is the n-tiles of the gemvs entry for a step of T tokens
// (remainders lo rows on, 0: none), 0 when none has room. With
// remainders, they are staged from row nt * 4 on, in later n-tiles.
func gemvsNTFor(T, lo int) int {
	for _, nt := range gemvsNT {
		if (lo == 0 && nt*8 >= T) || (lo > 0 && nt >= 2 && nt*4 >= T) {
			return nt
		}
	}
	return 0
}

// smallPlanes is how smallProduct leaves the product in -> out of a decode
// step of T tokens (remainders lo rows on, 0: none): a function of the
// step's shape alone, so that a consumer replayed eagerly beside captured
// products (piecewise graphs) knows it too.
func (s *Stage) smallPlanes(T, lo, in, out int) planes {
	if kb, ok := s.gemvsKB(T, lo, in, out); ok {
		return planes{T, in / kb}
	}
	return cublasPlanes(lo)
}

// smallProduct computes y = x·Wᵀ for a decode step of T tokens (x's
// remainder rows lo rows on, 0: none) on gemvs where it applies, else with
// cuBLAS, and says how its output lies. The layer's large products (gate|up,
// down) stay on cuBLAS: on gemvs, with 1-8 splits, they were slower at 4-16
// tokens (NOTES.md, phase 13).
func (s *Stage) smallProduct(label string, y, x, w gpu.DevicePtr, T, lo, in, out int) (planes, error) {
	kb, ok := s.gemvsKB(T, lo, in, out)
	if !ok {
		return cublasPlanes(lo), s.linear(label, y, x, w, T+lo, in, out)
	}
	nt := gemvsNTFor(T, lo)
	a := s.args.Reset().Ptr(w).Ptr(x).Ptr(y).Int32(int32(out)).Int32(int32(in)).Int32(int32(T)).Int32(int32(lo)).Int32(int32(kb))
	grid := gpu.Dim3{X: uint32(out / gemvsRowBlock), Y: uint32(in / kb)}
	if err := s.launchDep("gemvs "+label, gemvsName(nt), grid, gpu.Dim3{X: gemvsThreads}, gemvsSmem(nt, kb), a); err != nil {
		return planes{}, err
	}
	return s.smallPlanes(T, lo, in, out), nil
}
