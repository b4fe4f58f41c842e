package cuda

import (
	"fmt"
	"slices"

	"github.com/tandem-llm/tandem/gpu"
)

// The cuBLAS path's LM head of few rows, with the sampler's softmax
// partials in its epilogue, a dependent launch (kernels/gemvh.cu).
const (
	gemvhThreads = 256 // GEMVH_THREADS
	gemvhWarps4  = 16  // GEMVH_WARPS4
	gemvhStages4 = 3   // GEMVH_STAGES4
)

// gemvhWarps is the warps of a gemvh_nt<nt> block, gemvhStages those of
// each warp's ring (GemvhGeom).
func gemvhWarps(nt int) int {
	if nt == 4 {
		return gemvhWarps4
	}
	return gemvhThreads / 32
}

func gemvhStages(nt int) int {
	if nt == 4 {
		return gemvhStages4
	}
	return wringStages
}

// gemvhBlockThreads is the threads of a gemvh_nt<nt> block.
func gemvhBlockThreads(nt int) int { return gemvhWarps(nt) * 32 }

func gemvhName(nt int) string { return fmt.Sprintf("gemvh_nt%d", nt) }

// gemvhNT are gemvh's n-tiles of 8 staged rows: up to 32 rows. At 17-32
// rows (n-tile 4) its loop without divisions takes the head in 145 us
// against cuBLAS's 140 plus logit_stats's 13 (1B batch 32, eager), and the
// step is a little faster (1B GPU ms, three rounds: batch 24
// 0.998/0.995/1.002 -> 0.999/0.994/0.991, 32 1.031/1.033/1.031 ->
// 1.027/1.025/1.023; one H200, NOTES.md phase 28). On 16 warps of 3-stage
// rings it took 140-141 us, and batch 32 1.021-1.023 -> 1.015-1.018 ms
// (phase 29).
var gemvhNT = []int{1, 2, 4}

// gemvhNames lists the gemvh_* entry points.
var gemvhNames = ntNames(gemvhNT, gemvhName)

// gemvhSmem is the dynamic shared memory of gemvh_nt<nt> for inputs of k:
// the staged rows, then the warps' weight rings.
func gemvhSmem(nt, k int) int { return nt*8*k*2 + gemvhWarps(nt)*gemvhStages(nt)*wringStageBytes }

// gemvhBlocks is gemvh_nt<nt>'s grid on a device of sms multiprocessors
// for a vocabulary of vocab rows: a block a multiprocessor, and no more
// warps than units of 16 rows.
func gemvhBlocks(nt, vocab, sms int) int { return max(1, min(sms, vocab/16/gemvhWarps(nt))) }

// gemvhPartials is the softmax partials gemvh_nt<nt> writes per logits
// row: one per warp of its grid.
func gemvhPartials(nt, vocab, sms int) int { return gemvhBlocks(nt, vocab, sms) * gemvhWarps(nt) }

// gemvhMostPartials is the most partials a row of any gemvh n-tile.
func gemvhMostPartials(vocab, sms int) int {
	n := 0
	for _, nt := range gemvhNT {
		n = max(n, gemvhPartials(nt, vocab, sms))
	}
	return n
}

// gemvhMaxRows is the most logits rows gemvh takes.
var gemvhMaxRows = 8 * slices.Max(gemvhNT)

// gemvhFits is gemvh's rule: whether the LM head of rows logits rows of
// hidden features over a vocabulary of vocab takes gemvh on a device of
// smem bytes of shared memory a block: at most gemvhMaxRows rows, whole
// units of 16 vocabulary rows, k a multiple of the ring's stage, and the
// staged rows and the rings within the shared memory. It replaces cuBLAS
// and logit_stats. Measured on one H200 (NOTES.md, phase 25; 1B GPU ms of
// a decode step, two rounds against cuBLAS): batch 2 0.925/0.927 ->
// 0.922/0.923, 8 0.932/0.934 -> 0.930/0.928, 16 0.981/0.982 ->
// 0.980/0.978; the head alone 125.5 us at 2 rows (4.18 TB/s).
func gemvhFits(rows, hidden, vocab, smem int) bool {
	nt := gemvsNTFor(rows, 0)
	return slices.Contains(gemvhNT, nt) && vocab%16 == 0 && hidden%wringKS == 0 && gemvhSmem(nt, hidden) <= smem
}

// gemvh reports whether the stage's LM head of rows logits rows runs on
// gemvh: only as a dependent launch, like gemvs.
func (s *Stage) gemvh(rows int) bool {
	return s.gemvs && gemvhFits(rows, s.m.HiddenSize, s.m.VocabSize, s.dev.Info().MaxSharedPerBlockOptin)
}

// lmHeadStats orders gemvh: the logits of the rows normed rows of x and
// the LM head w into logits, and their softmax partials into stats; it
// returns the partials per row.
func (s *Stage) lmHeadStats(logits, x, w, stats gpu.DevicePtr, rows int) (int, error) {
	H, V := s.m.HiddenSize, s.m.VocabSize
	info := s.dev.Info()
	nt := gemvsNTFor(rows, 0)
	a := s.args.Reset().Ptr(w).Ptr(x).Ptr(logits).Int32(int32(V)).Int32(int32(H)).Int32(int32(rows)).Ptr(stats)
	grid := gpu.Dim3{X: uint32(gemvhBlocks(nt, V, info.SMs))}
	err := s.launchDep("gemvh lm_head+stats", gemvhName(nt), grid, gpu.Dim3{X: uint32(gemvhBlockThreads(nt))}, gemvhSmem(nt, H), a)
	return gemvhPartials(nt, V, info.SMs), err
}
