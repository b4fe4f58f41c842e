package cuda

import (
	"fmt"
	"regexp"
	"slices"
	"strings"
	"testing"
)

func TestKernelSource(t *testing.T) {
	src, err := kernelSource(true)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(src, "#line 1 \"kernels/00_common.cu\"\n") {
		t.Errorf("program does not start with the common definitions:\n%.200s", src)
	}
	for _, name := range append(slices.Clone(kernelNames), optionalNames...) {
		re := regexp.MustCompile(`(extern "C" __global__ void (\w+_DIMS\s+)?(__launch_bounds__\(\w+(, \d+)?\)\s+)?` + name + `\(|(GEMV[FSTGRH]?|GQA|GQA_ROPEP?)_ENTRY\(` + name + `,)`)
		if n := len(re.FindAllString(src, -1)); n != 1 {
			t.Errorf("kernel %s defined %d times in the program; want once", name, n)
		}
	}
	// The prefill attention's launch shape.
	if prefillTile != 16*prefillThreads/32 {
		t.Errorf("prefill tiles of %d rows; a prefill block of %d threads holds 16 rows a warp", prefillTile, prefillThreads)
	}
	for _, d := range []string{fmt.Sprintf("#define PF_WARPS %d\n", prefillThreads/32), fmt.Sprintf("#define PF_STAGES %d\n", prefillStages), fmt.Sprintf("#define NORM_CLUSTER %d\n", normCluster)} {
		if !strings.Contains(src, d) {
			t.Errorf("program lacks %q", d)
		}
	}
	// Every gemv variant is compiled with the resident blocks the launches
	// assume.
	for _, v := range gemvVariants {
		for _, nt := range gemvNT {
			want := fmt.Sprintf("GEMV_ENTRY(%s, GEMV_%s, %d, %d, %d)", gemvName(v, nt), strings.ToUpper(v.epi), v.mt, nt, gemvBlocksPerSM(v, nt))
			if !strings.Contains(src, want) {
				t.Errorf("program lacks %q", want)
			}
		}
	}
	if n, want := strings.Count(src, "\nGEMV_ENTRY("), len(gemvVariants)*len(gemvNT); n != want {
		t.Errorf("program has %d gemv entry points; gemvVariants lists %d", n, want)
	}
	// The optional part: every gemvt variant once, with the resident
	// blocks its launches assume, and none of it in the program without it.
	for _, v := range gemvtVariants {
		want := fmt.Sprintf("GEMVT_ENTRY(%s, GEMV_%s, %d, %d)", gemvtName(v), strings.ToUpper(v.epi), v.mt, gemvtBlocksPerSM(v.mt))
		if strings.Count(src, want) != 1 {
			t.Errorf("program lacks %q (or has it twice)", want)
		}
	}
	if n, want := strings.Count(src, "\nGEMVT_ENTRY("), len(gemvtVariants); n != want {
		t.Errorf("program has %d gemvt entry points; gemvtVariants lists %d", n, want)
	}
	base, err := kernelSource(false)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range optionalNames {
		if strings.Contains(base, name) {
			t.Errorf("the program without its optional part has %s", name)
		}
	}
	for _, name := range kernelNames {
		if !strings.Contains(base, name) {
			t.Errorf("the program without its optional part lacks %s", name)
		}
	}
	// The launch constants must agree with the sources.
	for _, def := range []string{
		fmt.Sprintf("#define ATT_RMAX %d\n", attentionHeads),
		fmt.Sprintf("#define GQA_STAGES %d\n", gqaStages),
		fmt.Sprintf("#define GEMV_THREADS %d\n", gemvThreads),
		fmt.Sprintf("#define GEMVS_THREADS %d\n", gemvsThreads),
		fmt.Sprintf("#define GEMVG_THREADS %d\n", gemvgThreads),
		fmt.Sprintf("#define GEMVH_THREADS %d\n", gemvhThreads),
		fmt.Sprintf("#define GEMVH_WARPS4 %d\n", gemvhWarps4),
		fmt.Sprintf("#define GEMVH_STAGES4 %d\n", gemvhStages4),
		fmt.Sprintf("#define WRING_STAGES %d\n", wringStages),
		fmt.Sprintf("#define WRING_KS %d\n", wringKS),
		fmt.Sprintf("#define MAX_PLANES %d\n", maxPlanes),
		fmt.Sprintf("#define GEMV_WARPS %d\n", gemvWarps),
		fmt.Sprintf("#define GT_WARPS %d\n", gtWarps),
		fmt.Sprintf("#define GT_KC %d\n", gtKC),
		fmt.Sprintf("#define GT_STAGES %d\n", gtStages),
		fmt.Sprintf("#define GT_C %d\n", gtC),
		fmt.Sprintf("#define GT_MAXSPLITS %d\n", gtMaxSplits),
		"#define GT_THREADS (GT_WARPS * 32)\n",
		"#define GT_XS (GT_KC + 32)\n",
		fmt.Sprintf("#define SAMPLE_THREADS %d\n", sampleThreads),
		fmt.Sprintf("#define SAMPLE_PARAMS %d\n", sampleParams),
		fmt.Sprintf("#define LS_CHUNK %d\n", statsChunk),
		fmt.Sprintf("#define NORM_THREADS %d\n", normThreads),
		"#define NORM_KEEP 4\n",
		fmt.Sprintf("#define LS_THREADS %d\n", statsThreads),
		fmt.Sprintf("#define STATUS_NO_TOKEN %d ", statusNoToken),
		fmt.Sprintf("#define STATUS_BAD_ROW %d ", statusBadRow),
		fmt.Sprintf("[%d] token", statusWords-1),
	} {
		if !strings.Contains(src, def) {
			t.Errorf("program lacks %q, which the Go launch constants assume", def)
		}
	}
}

// TestNormBlock: a row of the common widths is one round of 4 elements a
// thread; past 4,096 rounds of 1,024 threads; whole warps always.
func TestNormBlock(t *testing.T) {
	for _, c := range []struct{ hidden, want int }{{2048, 512}, {4096, 1024}, {8192, 1024}, {896, 224}, {64, 32}, {6, 32}, {100, 32}, {1030, 1024}} {
		if got := normBlock(c.hidden); got != c.want || got%32 != 0 {
			t.Errorf("normBlock(%d) = %d, want %d", c.hidden, got, c.want)
		}
	}
}

// TestNormClusterBlock: rmsnorm_cluster takes decode steps of 3-64 rows
// whose hidden size splits into whole warps over the cluster's blocks, on
// devices with clusters (sm_90 on).
func TestNormClusterBlock(t *testing.T) {
	for _, tc := range []struct {
		hidden, rows, threads int
		ok                    bool
		major                 int // 0: 9
	}{
		{2048, 2, 64, false, 0}, // measured slower at 2 rows
		{2048, 3, 64, true, 0},
		{2048, 32, 64, true, 0},
		{2048, 64, 64, true, 0},
		{2048, 65, 64, false, 0}, // prefill chunks
		{2048, 512, 64, false, 0},
		{4096, 8, 128, true, 0},
		{3072, 8, 96, true, 0},
		{1536, 8, 48, false, 0}, // 48 threads: not whole warps
		{896, 8, 28, false, 0},
		{64, 8, 2, false, 0},
		{2048, 32, 64, false, 8}, // no clusters before sm_90
		{2048, 32, 64, true, 10},
	} {
		if tc.major == 0 {
			tc.major = 9
		}
		threads, ok := normClusterBlock(tc.hidden, tc.rows, tc.major)
		if ok != tc.ok || (ok && threads != tc.threads) {
			t.Errorf("normClusterBlock(%d, %d, %d) = %d, %v; want %d, %v", tc.hidden, tc.rows, tc.major, threads, ok, tc.threads, tc.ok)
		}
	}
}
