package cuda

import (
	"embed"
	"fmt"
	"io/fs"
	"path"
	"slices"
	"sort"
	"strings"

	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/stage"
)

//go:embed kernels/*.cu
var kernelFS embed.FS

// Kernel entry points of the program in kernels/, with the launch shapes
// their sources document.
const (
	kEmbed       = "embed"
	kRMSNorm     = "rmsnorm"
	kRMSNormP    = "rmsnorm_planes"
	kRMSNormC    = "rmsnorm_cluster"
	kResidualAdd = "residual_add"
	kRopeQKV     = "rope_qkv"
	kSiluMul     = "silu_mul"
	kSample      = "sample"
	kLogitStats  = "logit_stats"
	kHandoff     = "handoff_apply"
	kSpin        = "spin"
	kCopyWords   = "copy_words"
)

// Epilogues of the skinny GEMM kernels (gemv.cu).
const (
	epiStore = "store" // GEMV_STORE
	epiHead  = "head"  // GEMV_HEAD
	epiResid = "resid" // GEMV_RESID
	epiSilu  = "silu"  // GEMV_SILU
	epiRope  = "rope"  // GEMV_ROPE
)

// gemvVariant is one compiled skinny GEMM: its epilogue and the weight
// tiles of 16 rows one block computes (MT); each is compiled for 1, 2 and
// 4 groups of 8 token columns (NT).
type gemvVariant struct {
	epi string
	mt  int
}

// gemvVariants are the GEMV_ENTRY instances of gemv.cu.
var gemvVariants = []gemvVariant{
	{epiStore, 4}, {epiHead, 4}, {epiResid, 1}, {epiResid, 2},
	{epiSilu, 2}, {epiSilu, 4}, {epiRope, 1}, {epiRope, 2},
}

// attentionVariants are the query heads per block the attention kernel is
// compiled for, attentionWarps its warps per block (attention_rN_wW).
var (
	attentionVariants = []int{1, 2, 4, 8}
	attentionWarps    = []int{4, 16}
)

func attentionName(r, w int) string { return fmt.Sprintf("attention_r%d_w%d", r, w) }

// attentionSmem is the dynamic shared memory of attention_rN_wW for head
// dim hd: the warps' partial softmax states.
func attentionSmem(r, w, hd int) int { return w * r * (hd + 2) * 4 }

// prefillHeadDims are the head dims attention_prefill_d<HD> is compiled
// for (attention_prefill.cu).
var prefillHeadDims = []int{64, 128}

func prefillName(hd int) string { return fmt.Sprintf("attention_prefill_d%d", hd) }

// prefillGrid is attention_prefill_d*'s grid for a step of tiles whole
// tiles and nh query heads: heads fastest, so that the blocks start with
// every head of the last tile listed (the kernel takes the tiles in
// reverse).
func prefillGrid(nh, tiles int) gpu.Dim3 { return gpu.Dim3{X: uint32(nh), Y: uint32(tiles)} }

// prefillSmem is the dynamic shared memory of attention_prefill_d<hd>: its
// stages' K and V blocks of prefillTile keys, rows of hd + 8 bf16.
func prefillSmem(hd int) int { return prefillStages * 2 * prefillTile * (hd + 8) * 2 }

// gqaName is attention_gqa_d<hd>_w<w> (attention_gqa.cu), or with rope
// attention_gqa_rope_d<hd>_w<w> (the rotary embedding and the KV cache
// write folded in), compiled for the prefillHeadDims and gqaWarps.
func gqaName(hd, w int, rope bool) string {
	if rope {
		return fmt.Sprintf("attention_gqa_rope_d%d_w%d", hd, w)
	}
	return fmt.Sprintf("attention_gqa_d%d_w%d", hd, w)
}

// gqaPlanesName is the entry of attention_gqa_rope's work that takes
// q|k|v in gemvs.cu's planes.
func gqaPlanesName(hd, w int) string { return fmt.Sprintf("attention_gqa_ropep_d%d_w%d", hd, w) }

var gqaWarps = []int{4, 8}

// gqaStages is GQA_STAGES of attention_gqa.cu: the key tiles a block has
// in shared memory, the one in use and those being copied.
const gqaStages = 2

// gqaSmem is the dynamic shared memory of attention_gqa_d<hd>_w<w>: for
// each of gqaStages, key and value tiles of 16 w rows of hd + 8 bf16
// (139 KiB for hd 128 and 8 warps: a device whose blocks cannot have that
// much runs such models on attention_r*; stage.go).
func gqaSmem(hd, w int) int { return gqaStages * 2 * 16 * w * (hd + 8) * 2 }

// gemvfVariants are the epilogues of the GEMVF_ENTRY instances of
// gemvf.cu, each compiled for gemvfTokens token rows.
var (
	gemvfVariants = []string{epiHead, epiResid, epiSilu, epiRope}
	gemvfTokens   = []int{1, 2}
)

func gemvfName(epi string, t int) string { return fmt.Sprintf("gemvf_%s_t%d", epi, t) }

// gemvfSmem is the dynamic shared memory of a gemvf kernel for t token
// rows of width k: the staged activations, 32 floats of scratch and the
// sums of the warps that share a unit (4 rows by t tokens a warp).
func gemvfSmem(t, k int) int { return (t*k + 32 + gemvWarps*4*t) * 4 }

// gemvtVariants are the GEMVT_ENTRY instances of gemvt.cu: the products
// of steps of 9 to 32 token rows, with the row mapping of the gemv variant
// of the same epilogue and tiles.
var gemvtVariants = []gemvVariant{
	{epiStore, 4}, {epiHead, 4}, {epiResid, 1}, {epiResid, 2},
	{epiSilu, 2}, {epiSilu, 4}, {epiRope, 1}, {epiRope, 2},
}

// gemvtName is the entry point of variant v in gemvt.cu.
func gemvtName(v gemvVariant) string { return fmt.Sprintf("gemvt_%s_m%d", v.epi, v.mt) }

// hasGemvt reports whether gemvt.cu has variant v.
func hasGemvt(v gemvVariant) bool {
	for _, w := range gemvtVariants {
		if w == v {
			return true
		}
	}
	return false
}

// Launch constants of gemvt.cu.
const (
	gtWarps   = 4 // GT_WARPS: units per block, one per warp
	gtThreads = 32 * gtWarps
	gtKC      = 64 // GT_KC: k of one chunk
	gtStages  = 4  // GT_STAGES
	gtC       = 32 // GT_C: token columns
	gtXS      = gtKC + 32
	// gtMinChunks is the fewest chunks of k a split of a gemvt launch
	// takes, and gtMaxSplits the most splits.
	gtMinChunks = 6
	gtMaxSplits = 16
)

// gemvtSmem is the dynamic shared memory of a gemvt kernel of mt tiles a
// warp: the weight stages, two buffers of split activations (values and
// remainders), the sums of squares and the norm factors.
func gemvtSmem(mt int) int {
	return gtStages*gtWarps*16*mt*gtKC*2 + 2*2*gtC*gtXS*2 + 2*gtC*4
}

// gemvtBlocksPerSM is the resident blocks a gemvt kernel is compiled for
// (the minb of its GEMVT_ENTRY), as many as its shared memory allows.
func gemvtBlocksPerSM(mt int) int {
	switch mt {
	case 1:
		return 3
	case 2:
		return 2
	}
	return 1
}

// gemvNT are the token-column groups each variant is compiled for.
var gemvNT = []int{1, 2, 4}

// gemvName is the entry point of variant v for nt groups of 8 tokens.
func gemvName(v gemvVariant, nt int) string { return fmt.Sprintf("gemv_%s_m%d_n%d", v.epi, v.mt, nt) }

// gemvSmem is the dynamic shared memory a gemv kernel takes: the partial
// sums of its 8 warps, their sums of squares and the norm factors.
func gemvSmem(mt, nt int) int {
	r, c := 16*mt, 8*nt
	return (gemvWarps*r*c + (gemvWarps+1)*c) * 4
}

// optionalSource says which kernel files make the optional part of the
// program (gemvt.cu): a stage whose NVRTC cannot compile them runs steps of
// more than 8 tokens on cuBLAS and says so, instead of failing.
func optionalSource(name string) bool { return strings.HasPrefix(path.Base(name), "gemvt") }

// optionalNames lists the entry points of the optional part.
var optionalNames = func() []string {
	var n []string
	for _, v := range gemvtVariants {
		n = append(n, gemvtName(v))
	}
	return n
}()

// kernelNames lists every entry point New looks up.
var kernelNames = func() []string {
	n := []string{kEmbed, kRMSNorm, kRMSNormP, kRMSNormC, kResidualAdd, kRopeQKV, kSiluMul, kSample, kLogitStats, kHandoff, kSpin, kCopyWords}
	for _, r := range attentionVariants {
		for _, w := range attentionWarps {
			n = append(n, attentionName(r, w))
		}
	}
	for _, hd := range prefillHeadDims {
		n = append(n, prefillName(hd))
	}
	for _, v := range gemvVariants {
		for _, nt := range gemvNT {
			n = append(n, gemvName(v, nt))
		}
	}
	return slices.Concat(n, gqaNames, gemvfNames, gemvsNames, gemvgNames, gemvhNames)
}()

// gqaNames lists the attention_gqa entry points.
var gqaNames = func() []string {
	var n []string
	for _, hd := range prefillHeadDims {
		for _, w := range gqaWarps {
			n = append(n, gqaName(hd, w, false), gqaName(hd, w, true), gqaPlanesName(hd, w))
		}
	}
	return n
}()

// gemvfNames lists the gemvf_* entry points.
var gemvfNames = func() []string {
	var n []string
	for _, e := range gemvfVariants {
		for _, t := range gemvfTokens {
			n = append(n, gemvfName(e, t))
		}
	}
	return n
}()

// Launch constants shared with the sources.
const (
	// Status codes of the first stage's status array (00_common.cu).
	statusNoToken = 1
	statusBadRow  = 2
	statusWords   = 4

	attentionHeads = 8                 // ATT_RMAX: query heads per block
	prefillTile    = 64                // the positions of a prefill tile (prefillLists): a prefill block's rows, 16 a warp
	prefillMinRows = 16                // the fewest rows of a whole prefill tile
	prefillThreads = 128               // PF_THREADS in attention_prefill.cu
	prefillStages  = 2                 // PF_STAGES in attention_prefill.cu: key blocks in shared memory
	maxHeadDim     = 256               // the widest rows attention.cu takes
	sampleThreads  = 1024              // SAMPLE_THREADS in sample.cu
	copyThreads    = 256               // copy_words's block
	copyMaxBlocks  = 64                // copy_words's most blocks (each thread 16 bytes at a time)
	sampleParams   = 10                // SAMPLE_PARAMS in sample.cu
	sampleApply    = 9                 // the parameter that has the sampler record its token under the slot
	sampleOutInts  = 2 + 2*MaxLogprobs // the sampler's output a sequence: token, log-probability, alternatives
	statsChunk     = 8192              // LS_CHUNK in sample.cu: logits of a logit_stats block
	statsThreads   = 256               // LS_THREADS
	gemvThreads    = 256               // GEMV_THREADS in gemv.cu, GEMVF_THREADS in gemvf.cu
	gemvWarps      = 8                 // GEMV_WARPS
	gemvMaxTokens  = 32                // 8 * the largest NT
	normThreads    = 1024              // NORM_THREADS in norm.cu: the largest rmsnorm block
	normCluster    = 8                 // NORM_CLUSTER in norm.cu: rmsnorm_cluster's blocks a row
	// rmsnorm_cluster's steps (normClusterBlock): 3 rows up to the
	// default max_seqs.
	normClusterMinRows = 3
	normClusterMaxRows = 64
	embedThreads       = 256
	siluThreads        = 256
	ropeThreads        = 256
	addThreads         = 256
	handoffThreads     = 256
	// MaxLogprobs is the most top alternatives one sampled token reports.
	MaxLogprobs = stage.MaxLogprobs
)

// kernelSource is the NVRTC program: every kernels/*.cu file, in name order
// (00_common.cu first), each introduced by a #line directive so compiler
// messages name the file; without the optional files unless optional.
func kernelSource(optional bool) (string, error) {
	names, err := fs.Glob(kernelFS, "kernels/*.cu")
	if err != nil {
		return "", fmt.Errorf("list kernel sources: %w", err)
	}
	sort.Strings(names)
	var b strings.Builder
	for _, n := range names {
		if optionalSource(n) && !optional {
			continue
		}
		data, err := kernelFS.ReadFile(n)
		if err != nil {
			return "", fmt.Errorf("read kernel source %s: %w", n, err)
		}
		fmt.Fprintf(&b, "#line 1 %q\n", n)
		b.Write(data)
		b.WriteString("\n")
	}
	return b.String(), nil
}

// logitStatsParts is the logit_stats blocks of a row of vocab logits; each
// writes one softmax partial per warp.
func logitStatsParts(vocab int) int { return (vocab + statsChunk - 1) / statsChunk }

// logitStatsPartials is the softmax partials logit_stats writes per row.
func logitStatsPartials(vocab int) int { return logitStatsParts(vocab) * statsThreads / 32 }

// normClusterBlock is rmsnorm_cluster's block for steps of rows rows of
// hidden elements on a device of compute capability major, a thread for 4
// of them in each of the cluster's blocks; ok is false where that is not
// whole warps (norm.cu), the device has no clusters (before sm_90) or the
// step is one rmsnorm takes. Measured on one H200 (1B, GPU ms of a decode step, each
// against rmsnorm): 2 rows 0.943 -> 0.953, so rmsnorm keeps them; 3-4 rows
// 0.953 -> 0.944, 8 rows 1.003 -> 0.979, 32 rows 1.098 -> 1.060; 8B 8 rows
// 4.745 -> 4.671, 32 rows 5.198 -> 5.136. Steps past normClusterMaxRows
// (prefill chunks) keep rmsnorm, where it was not measured against it: a
// norm is a small part of such a step.
func normClusterBlock(hidden, rows, major int) (threads int, ok bool) {
	threads = hidden / (4 * normCluster)
	return threads, major >= 9 && hidden%(4*normCluster*32) == 0 && threads <= normThreads &&
		rows >= normClusterMinRows && rows <= normClusterMaxRows
}

// normBlock is the rmsnorm block for rows of hidden elements: a thread for
// every 4 of them (every one when hidden is not a multiple of 4), in whole
// warps, at most normThreads (norm.cu).
func normBlock(hidden int) int {
	per := 1
	if hidden%4 == 0 {
		per = 4
	}
	return min(normThreads, ((hidden+per-1)/per+31)/32*32)
}
