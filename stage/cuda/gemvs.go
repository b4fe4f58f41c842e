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

// smallProd is one of the cuBLAS path's small products, named by what
// reads its output: q|k|v is read by attention, a block for each token's
// kv head; o by the post-attention rmsnorm, a block for each token's row.
type smallProd int

const (
	prodQKV smallProd = iota
	prodO
)

// String is the product's label in profiles: qkv or o.
func (p smallProd) String() string {
	if p == prodQKV {
		return "qkv"
	}
	return "o"
}

// gemvsKB is the split of k (kb) gemvs takes for product p, in -> out, of
// a decode step of T tokens (remainders lo rows on, 0: none) on this
// stage, and whether it takes it at all (gemvsSplit).
func (s *Stage) gemvsKB(p smallProd, T, lo, in, out int) (int, bool) {
	if !s.gemvs {
		return 0, false
	}
	return gemvsSplit(p, T, lo, in, out, s.dev.Info().MaxSharedPerBlockOptin, s.pl.lay.maxTokens)
}

// gemvsSplit is gemvsKB's rule, for a device of smem bytes of shared
// memory a block and a workspace of maxTokens token rows. Measured on one
// H200 (NOTES.md, phase 12, call 6, the same binary with gemvs off as the
// reference): steps of 4-8 tokens gain 8-10% (1B) and 4-5% (8B) with 4
// splits; at 16 tokens, 8 splits gain 4% where a split is one burst of 256
// k a warp (1B) and lose where it is two (8B); compensated steps of more
// than 16 tokens (64 staged rows) lose. Plain steps of 17-32 tokens (past
// Config.CompensatedTokens: 32 staged rows) gain with q|k|v alone (phase
// 18, 1B batch 32: 1.227-1.230 -> 1.190-1.198 ms with 4 or 8 splits), and
// lose with o too (1.266-1.276 with 4 splits, 1.248 with 8): o's consumer,
// the rmsnorm, has one block a token row to add up all its planes. Hence 4
// splits up to 8 tokens, 8 of 256 k up to 16, q|k|v alone in 4 splits of
// at most 512 k up to 32 plain tokens; out a multiple of 128, kb a
// multiple of 256 of at most gemvsMaxKB, and the planes' rows within the
// output buffer's 2 * maxTokens.
func gemvsSplit(p smallProd, T, lo, in, out, smem, maxTokens int) (int, bool) {
	nt := gemvsNTFor(T, lo)
	if nt == 0 || out%gemvsRowBlock != 0 {
		return 0, false
	}
	splits, maxKB := 4, gemvsMaxKB
	switch {
	case T > 16:
		if p != prodQKV {
			return 0, false
		}
		maxKB = 512
	case T > 8:
		splits, maxKB = 8, 256
	}
	kb := in / splits
	switch {
	case in%splits != 0, kb%256 != 0, kb > maxKB, gemvsSmem(nt, kb) > smem, splits*T > 2*maxTokens:
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
func (s *Stage) smallPlanes(p smallProd, T, lo, in, out int) planes {
	if kb, ok := s.gemvsKB(p, T, lo, in, out); ok {
		return planes{T, in / kb}
	}
	return cublasPlanes(lo)
}

// smallProduct computes product p, y = x·Wᵀ, for a decode step of T
// tokens (x's remainder rows lo rows on, 0: none) on gemvs where it
// applies, else with cuBLAS, and says how its output lies. The layer's
// large products stay off gemvs: with 1-8 splits, they were slower at
// 4-16 tokens (NOTES.md, phase 13); down stays on cuBLAS, gate|up goes to
// gemvg where that applies (gemvg.go).
func (s *Stage) smallProduct(p smallProd, y, x, w gpu.DevicePtr, T, lo, in, out int) (planes, error) {
	kb, ok := s.gemvsKB(p, T, lo, in, out)
	if !ok {
		return cublasPlanes(lo), s.linear(p.String(), y, x, w, T+lo, in, out)
	}
	nt := gemvsNTFor(T, lo)
	a := s.args.Reset().Ptr(w).Ptr(x).Ptr(y).Int32(int32(out)).Int32(int32(in)).Int32(int32(T)).Int32(int32(lo)).Int32(int32(kb))
	grid := gpu.Dim3{X: uint32(out / gemvsRowBlock), Y: uint32(in / kb)}
	if err := s.launchDep("gemvs "+p.String(), gemvsName(nt), grid, gpu.Dim3{X: gemvsThreads}, gemvsSmem(nt, kb), a); err != nil {
		return planes{}, err
	}
	return s.smallPlanes(p, T, lo, in, out), nil
}
