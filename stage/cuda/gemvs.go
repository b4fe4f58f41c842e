package cuda

import (
	"fmt"

	"github.com/tandem-llm/tandem/gpu"
)

// The cuBLAS path's small products as dependent launches (kernels/gemvs.cu).
const (
	gemvsThreads  = 256  // GEMVS_THREADS
	gemvsRowBlock = 128  // weight rows of a block
	gemvsMaxKB    = 2048 // the largest split of k a block stages
	maxPlanes     = 8    // MAX_PLANES in 00_common.cu: gemvs's most splits

	// A warp's weight ring (kernels/gemv.cu): WRING_STAGES stages of
	// WRING_KS k of its 16 weight rows, WRING_BYTES a warp.
	wringStages     = 6
	wringKS         = 64
	wringStageBytes = 16 * wringKS * 2
	wringBytes      = wringStages * wringStageBytes
)

// gemvsNT are the gemvs entries' n-tiles of 8 staged rows.
var gemvsNT = []int{1, 2, 4}

func gemvsName(nt int) string { return fmt.Sprintf("gemvs_nt%d", nt) }

// gemvsNames lists the gemvs_* entry points.
var gemvsNames = ntNames(gemvsNT, gemvsName)

// ntNames is the names of a kernel's entries for each of its n-tiles nts.
func ntNames(nts []int, name func(nt int) string) []string {
	n := make([]string, len(nts))
	for i, nt := range nts {
		n[i] = name(nt)
	}
	return n
}

// gemvsSmem is the dynamic shared memory of gemvs_nt<nt> over splits of
// kb: the staged rows, then the warps' weight rings.
func gemvsSmem(nt, kb int) int { return nt*8*kb*2 + gemvsThreads/32*wringBytes }

// gemvsLaunchSmem is the dynamic shared memory gemvs_nt<nt> over splits of
// kb is launched with, for a grid of blocks on a device of sms
// multiprocessors and optin bytes of shared memory a block: gemvsSmem,
// raised past half of optin where the grid is at most one block a
// multiprocessor, so that no two of its blocks share one (and its
// bandwidth) while another stands idle. Blocks of 112 KB or less (the 1B
// shape's o of 17-32 tokens once the staged rows lost their padding, its
// q|k|v and o of 2-8 tokens) could pair up. Measured on one H200 (NOTES.md,
// phase 22; 1B GPU ms, two rounds): batch 4 0.941/0.935 -> 0.930/0.925,
// 8 0.973/0.970 -> 0.939/0.939, 16 1.016/1.012 -> 0.990/0.989. Raised for
// every grid, the 16-token step's 192-block q|k|v went to two waves
// (1.025/1.031).
func gemvsLaunchSmem(nt, kb, blocks, sms, optin int) int {
	n := gemvsSmem(nt, kb)
	if blocks <= sms {
		n = max(n, optin/2+1)
	}
	return n
}

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

// smallProd is one of the cuBLAS path's products on gemvs, named by what
// reads its output: q|k|v is read by attention, a block for each token's
// kv head; o by the post-attention rmsnorm, down by the next layer's
// rmsnorm (or, at the stage's end, residual_add), a block for each token's
// row.
type smallProd int

const (
	prodQKV smallProd = iota
	prodO
	prodDown
)

// String is the product's label in profiles: qkv, o or down.
func (p smallProd) String() string {
	switch p {
	case prodQKV:
		return "qkv"
	case prodDown:
		return "down"
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
	info := s.dev.Info()
	return gemvsSplit(p, T, lo, in, out, info.MaxSharedPerBlockOptin, info.SMs, s.pl.lay.maxTokens)
}

// gemvsSplit is gemvsKB's rule, for a device of smem bytes of shared
// memory a block and sms multiprocessors, and a workspace of maxTokens
// token rows. Measured on one H200 (NOTES.md): with weights in register
// sets (phases 12-18), gemvs took q|k|v and o of 3-16 token steps (4
// splits up to 8 tokens, 8 of 256 k up to 16: the 1B shape 4-10% faster,
// the 8B shape's 16-token steps, two bursts a split, slower), q|k|v alone
// of plain 17-32 token steps (1B batch 32 -3%), and lost with o there and
// with the down product. Through the weight rings (phase 20, 1B GPU ms
// against phase 19's tree): the same products 2-3% faster (batch 2 0.994
// -> 0.964, batch 32 1.200 -> 1.180), then down too (4 splits of 2,048 k
// up to 8 tokens, 8 of 1,024 to 32: batch 2 0.949, 16 1.105, 32 1.156)
// and o of 17-32 plain tokens in 8 splits (batch 24 1.133 -> 1.093, 32
// 1.158 -> 1.130). Those 17-32 token splits are each about one wave of
// blocks (gemvsWaveSplits: 1B q|k|v 4 splits, 96 blocks; o and down 8,
// 128), and so, in phase 21, is the 8B shape's q|k|v and o of 17-32 plain
// tokens (2 splits of 2,048 k, 96 blocks; 4 of 1,024, 128): GPU ms 5.059
// -> 4.924 at batch 24, 5.153 -> 5.058 at 32, against more splits (two
// waves: 4 of q|k|v, 8 of o) 5.013 and 5.133. Its down product stays on
// cuBLAS: a wave would be 4 splits of 3,584 k, past gemvsMaxKB, and 8
// splits of 1,792 k were 1.4% slower at batch 32 (NOTES.md, phase 21).
// Out a multiple of 128, kb a multiple of 256, and
// the planes' rows within the output buffer's 2 * maxTokens.
func gemvsSplit(p smallProd, T, lo, in, out, smem, sms, maxTokens int) (int, bool) {
	nt := gemvsNTFor(T, lo)
	if nt == 0 || out%gemvsRowBlock != 0 {
		return 0, false
	}
	splits, maxKB := 4, 1024
	switch {
	case T > 16 || (p == prodDown && T > 8):
		if splits = gemvsWaveSplits(out, sms); splits == 0 {
			return 0, false
		}
		maxKB = gemvsMaxKB
	case p == prodDown:
		maxKB = gemvsMaxKB
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

// gemvsWaveSplits is the most splits, of 8, 4 and 2, whose blocks (out /
// gemvsRowBlock a split) are at most one on each of sms multiprocessors,
// 0 when 2 are too many.
func gemvsWaveSplits(out, sms int) int {
	for s := 8; s >= 2; s /= 2 {
		if out/gemvsRowBlock*s <= sms {
			return s
		}
	}
	return 0
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
// applies, else with cuBLAS, and says how its output lies. gate|up goes
// to gemvg where that applies (gemvg.go).
func (s *Stage) smallProduct(p smallProd, y, x, w gpu.DevicePtr, T, lo, in, out int) (planes, error) {
	kb, ok := s.gemvsKB(p, T, lo, in, out)
	if !ok {
		return cublasPlanes(lo), s.linear(p.String(), y, x, w, T+lo, in, out)
	}
	nt := gemvsNTFor(T, lo)
	a := s.args.Reset().Ptr(w).Ptr(x).Ptr(y).Int32(int32(out)).Int32(int32(in)).Int32(int32(T)).Int32(int32(lo)).Int32(int32(kb))
	grid := gpu.Dim3{X: uint32(out / gemvsRowBlock), Y: uint32(in / kb)}
	info := s.dev.Info()
	smem := gemvsLaunchSmem(nt, kb, int(grid.X*grid.Y), info.SMs, info.MaxSharedPerBlockOptin)
	if err := s.launchDep("gemvs "+p.String(), gemvsName(nt), grid, gpu.Dim3{X: gemvsThreads}, smem, a); err != nil {
		return planes{}, err
	}
	return s.smallPlanes(p, T, lo, in, out), nil
}
