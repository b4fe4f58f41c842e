package cuda

import (
	"embed"
	"fmt"
	"io/fs"
	"sort"
	"strings"

	"github.com/tandem-llm/tandem/stage"
)

//go:embed kernels/*.cu
var kernelFS embed.FS

// Kernel entry points of the program in kernels/, with the launch shapes
// their sources document.
const (
	kEmbed       = "embed"
	kRMSNorm     = "rmsnorm"
	kResidualAdd = "residual_add"
	kRopeQKV     = "rope_qkv"
	kAttention   = "attention"
	kSiluMul     = "silu_mul"
	kSample      = "sample"
	kHandoff     = "handoff_apply"
)

// kernelNames lists every entry point New looks up.
var kernelNames = []string{kEmbed, kRMSNorm, kResidualAdd, kRopeQKV, kAttention, kSiluMul, kSample, kHandoff}

// Launch constants shared with the sources.
const (
	// Status codes of the first stage's status array (00_common.cu).
	statusNoToken = 1
	statusBadRow  = 2
	statusWords   = 4

	attentionThreads = 128  // ATT_THREADS in attention.cu
	maxHeadDim       = 256  // the size of attention.cu's shared q
	sampleThreads    = 1024 // SAMPLE_THREADS in sample.cu
	sampleParams     = 9    // SAMPLE_PARAMS in sample.cu
	normThreads      = 256
	embedThreads     = 256
	siluThreads      = 256
	addThreads       = 256
	handoffThreads   = 256
	// MaxLogprobs is the most top alternatives one sampled token reports.
	MaxLogprobs = stage.MaxLogprobs
)

// kernelSource is the NVRTC program: every kernels/*.cu file, in name order
// (00_common.cu first), each introduced by a #line directive so compiler
// messages name the file.
func kernelSource() (string, error) {
	names, err := fs.Glob(kernelFS, "kernels/*.cu")
	if err != nil {
		return "", fmt.Errorf("list kernel sources: %w", err)
	}
	sort.Strings(names)
	var b strings.Builder
	for _, n := range names {
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
