package cuda

import (
	"bytes"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/model"
)

// Tests of the skinny products (gemv.cu) and of attention on their own:
// every epilogue against a float64 reference on random inputs, with every
// output poisoned first, and (not in -short mode) their weight bandwidth
// next to cuBLAS's and the copy bandwidth, in CUDA graphs.

// helperSrc makes random test data on the device.
const helperSrc = `
typedef unsigned short bf16;
__device__ unsigned long long mix(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
__device__ float unif(unsigned long long seed, unsigned long long i) {
    return (float)(mix(seed ^ mix(i + 0x9e3779b97f4a7c15ULL)) >> 40) * (2.f / 16777216.f) - 1.f;
}
extern "C" __global__ void fill_bf16(bf16* p, unsigned long long n, unsigned long long seed, float scale, float offset) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n; i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned u = __float_as_uint(offset + scale * unif(seed, i));
        u += 0x7fffu + ((u >> 16) & 1u);
        p[i] = (bf16)(u >> 16);
    }
}
extern "C" __global__ void fill_f32(float* p, unsigned long long n, unsigned long long seed, float scale, float offset) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n; i += (unsigned long long)gridDim.x * blockDim.x) {
        p[i] = offset + scale * unif(seed, i);
    }
}
`

// kernelRig is the stage's kernel program and the helper program on the
// test device, with a stream. Device goroutine only, except newKernelRig.
type kernelRig struct {
	dev        *gpu.Device
	fn, help   map[string]gpu.Function
	st         gpu.Stream
	args       gpu.KernelArgs
	seed       uint64
	e0, e1     gpu.Event
	blas       *gpu.BLAS
	blasWS     gpu.Mem
	dependents bool
	// The gemvt kernels' split partials and counters, and why the
	// program has no gemvt kernels ("" when it has).
	gtPart, gtCounts gpu.DevicePtr
	optionalErr      string
}

func newKernelRig(t *testing.T) *kernelRig {
	t.Helper()
	dev := device(t)
	r := &kernelRig{dev: dev, seed: 1}
	prog := compileRigPrograms(t, dev.Info().Arch())
	if prog.optionalErr != "" {
		// As a stage does: the rest of the program without gemvt.cu; the
		// gemvt cases then fail, naming this error.
		r.optionalErr = prog.optionalErr
		t.Errorf("the optional kernels (gemvt.cu) did not compile: %v", prog.optionalErr)
	}
	optional, img, himg := prog.optionalErr == "", prog.img, prog.himg
	// The assembler's resource report (registers, spills) of each kernel.
	var report []string
	for _, line := range strings.Split(img.Log, "\n") {
		if strings.Contains(line, "Compiling entry") || strings.Contains(line, "registers") || strings.Contains(line, "spill") {
			report = append(report, strings.TrimSpace(line))
		}
	}
	t.Logf("ptxas:\n%s", strings.Join(report, "\n"))
	err := dev.Do(func() error {
		mod, err := gpu.LoadModule(nulTerminated(img))
		if err != nil {
			return err
		}
		if r.fn, err = lookupKernels(mod, dev.Info(), optional); err != nil {
			return err
		}
		hmod, err := gpu.LoadModule(nulTerminated(himg))
		if err != nil {
			return err
		}
		r.help = map[string]gpu.Function{}
		for _, n := range []string{"fill_bf16", "fill_f32"} {
			if r.help[n], err = hmod.Function(n); err != nil {
				return err
			}
		}
		if r.st, err = gpu.NewStream(); err != nil {
			return err
		}
		if r.e0, err = gpu.NewEvent(); err != nil {
			return err
		}
		if r.e1, err = gpu.NewEvent(); err != nil {
			return err
		}
		if r.blas, err = gpu.NewBLAS(); err != nil {
			return err
		}
		if err := r.blas.SetStream(r.st); err != nil {
			return err
		}
		if r.blasWS, err = gpu.Alloc(cublasWorkspace); err != nil {
			return err
		}
		r.dependents = dev.Info().Major >= 9 && gpu.LaunchDependentAvailable()
		return r.blas.SetWorkspace(r.blasWS)
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		dev.Do(func() error {
			r.st.Synchronize()
			r.blas.Destroy()
			r.blasWS.Free()
			r.e0.Destroy()
			r.e1.Destroy()
			return r.st.Destroy()
		})
	})
	// Split partials and counters enough for the products of every shape
	// the tests run (the 8B Llama's at most).
	r.gtPart, r.gtCounts = r.alloc(t, 64<<20), r.alloc(t, 64<<10)
	if err := dev.Do(func() error { return gpu.MemsetD8Async(r.gtCounts, 0, 64<<10, r.st) }); err != nil {
		t.Fatal(err)
	}
	return r
}

// rigPrograms are the kernel program and the helper program compiled for
// one architecture, once per test process (compileRigPrograms): NVRTC takes
// about 40 s over the program, and every kernel test opens a rig.
type rigPrograms struct {
	img, himg   gpu.Compiled
	optionalErr string // why the program lacks the optional kernels ("" when it has them)
}

var rigCompiled struct {
	sync.Mutex
	arch string
	prog *rigPrograms
}

// compileRigPrograms compiles the rig's programs for arch, or returns
// those an earlier rig of this process compiled for it.
func compileRigPrograms(t *testing.T, arch string) *rigPrograms {
	t.Helper()
	rigCompiled.Lock()
	defer rigCompiled.Unlock()
	if rigCompiled.prog != nil && rigCompiled.arch == arch {
		return rigCompiled.prog
	}
	compile := func(optional bool) (gpu.Compiled, error) {
		src, err := kernelSource(optional)
		if err != nil {
			t.Fatal(err)
		}
		return gpu.Compile(src, "tandem_kernels.cu", "--gpu-architecture="+arch, "--ptxas-options=-v")
	}
	p := &rigPrograms{}
	var err error
	if p.img, err = compile(true); err != nil {
		p.optionalErr = err.Error()
		if p.img, err = compile(false); err != nil {
			t.Fatal(err)
		}
	}
	if p.himg, err = gpu.Compile(helperSrc, "helper.cu", "--gpu-architecture="+arch); err != nil {
		t.Fatal(err)
	}
	rigCompiled.arch, rigCompiled.prog = arch, p
	return p
}

func nulTerminated(c gpu.Compiled) []byte {
	if c.PTX && (len(c.Image) == 0 || c.Image[len(c.Image)-1] != 0) {
		return append(c.Image, 0)
	}
	return c.Image
}

// alloc allocates device memory freed when t ends.
func (r *kernelRig) alloc(t *testing.T, bytes int) gpu.DevicePtr {
	t.Helper()
	var m gpu.Mem
	err := r.dev.Do(func() error {
		var err error
		m, err = gpu.Alloc(bytes)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		r.dev.Do(func() error {
			r.st.Synchronize()
			return m.Free()
		})
	})
	return m.Ptr()
}

// fill writes n random values uniform in offset ± scale (bf16 or fp32).
func (r *kernelRig) fill(t *testing.T, p gpu.DevicePtr, n int, bf16 bool, scale, offset float32) {
	t.Helper()
	r.seed++
	name := "fill_f32"
	if bf16 {
		name = "fill_bf16"
	}
	err := r.dev.Do(func() error {
		a := r.args.Reset().Ptr(p).Uint64(uint64(n)).Uint64(r.seed).Float32(scale).Float32(offset)
		if err := r.help[name].Launch(gpu.Dim3{X: 1024}, gpu.Dim3{X: 256}, 0, r.st, a); err != nil {
			return err
		}
		return r.st.Synchronize()
	})
	if err != nil {
		t.Fatal(err)
	}
}

func (r *kernelRig) poison(t *testing.T, p gpu.DevicePtr, bytes int) {
	t.Helper()
	err := r.dev.Do(func() error {
		if err := gpu.MemsetD8Async(p, 0xff, bytes, r.st); err != nil {
			return err
		}
		return r.st.Synchronize()
	})
	if err != nil {
		t.Fatal(err)
	}
}

func (r *kernelRig) upload(t *testing.T, p gpu.DevicePtr, b []byte) {
	t.Helper()
	if err := r.dev.Do(func() error { return gpu.CopyHtoD(p, b) }); err != nil {
		t.Fatal(err)
	}
}

func (r *kernelRig) f32s(t *testing.T, p gpu.DevicePtr, n int) []float32 {
	t.Helper()
	v := make([]float32, n)
	if err := r.dev.Do(func() error { return gpu.CopyDtoH(gpu.AsBytes(v), p) }); err != nil {
		t.Fatal(err)
	}
	return v
}

// randBF16 allocates n bf16 values, fills them as fill does (offset ±
// scale) and returns them with their values read back.
func (r *kernelRig) randBF16(t *testing.T, n int, scale, offset float32) (gpu.DevicePtr, []float64) {
	t.Helper()
	p := r.alloc(t, n*2)
	r.fill(t, p, n, true, scale, offset)
	return p, r.bf16s(t, p, n)
}

func (r *kernelRig) bf16s(t *testing.T, p gpu.DevicePtr, n int) []float64 {
	t.Helper()
	v := make([]uint16, n)
	if err := r.dev.Do(func() error { return gpu.CopyDtoH(gpu.AsBytes(v), p) }); err != nil {
		t.Fatal(err)
	}
	out := make([]float64, n)
	for i, x := range v {
		out[i] = float64(math.Float32frombits(uint32(x) << 16))
	}
	return out
}

// launch runs kernel name once on a grid of blocks of threads threads
// with smem bytes of dynamic shared memory and the arguments a, and waits.
func (r *kernelRig) launch(t *testing.T, name string, grid gpu.Dim3, threads, smem int, a *gpu.KernelArgs) {
	t.Helper()
	err := r.dev.Do(func() error {
		if err := r.fn[name].Launch(grid, gpu.Dim3{X: uint32(threads)}, smem, r.st, a); err != nil {
			return err
		}
		return r.st.Synchronize()
	})
	if err != nil {
		t.Fatal(err)
	}
}

// launchGemv runs c once for t tokens and waits.
func (r *kernelRig) launchGemv(t *testing.T, m *model.Config, c *gemvCall, w gpu.DevicePtr, tok int, io gemvIO, invFreq gpu.DevicePtr) {
	t.Helper()
	err := r.dev.Do(func() error {
		if err := r.gemv(m, c, w, tok, io, invFreq, false); err != nil {
			return err
		}
		return r.st.Synchronize()
	})
	if err != nil {
		t.Fatalf("%s: %v", gemvName(c.v, gemvNTFor(tok)), err)
	}
}

func (r *kernelRig) gemv(m *model.Config, c *gemvCall, w gpu.DevicePtr, tok int, io gemvIO, invFreq gpu.DevicePtr, dep bool) error {
	info := r.dev.Info()
	l := c.launch(tok, info.SMs, info.MaxSharedPerBlockOptin)
	if io.part == 0 {
		io.part, io.counters = r.gtPart, r.gtCounts
	}
	a := c.args(r.args.Reset(), m, w, tok, io, invFreq, l)
	f, ok := r.fn[l.name]
	if !ok {
		return fmt.Errorf("kernel %s: not in the program (%s)", l.name, r.optionalErr)
	}
	if dep {
		return f.LaunchDependent(l.gridDim(), gpu.Dim3{X: uint32(l.threads)}, l.smem, r.st, a)
	}
	return f.Launch(l.gridDim(), gpu.Dim3{X: uint32(l.threads)}, l.smem, r.st, a)
}

// gemvCase is one product of a model shape.
type gemvCase struct {
	name string
	call gemvCall
}

// gemvCases are the products of m's skinny plan on both kernel families
// (name/f: the fp32 multiply-add one, for at most 2 tokens), with the
// alternative tensor-core variants and warps a unit of the fp32 ones.
func gemvCases(m *model.Config) []gemvCase {
	p := planSkinny(m, 0, true, smemOptinDefault)
	if p.maxTokens == 0 {
		return nil
	}
	p.widen(0)
	var cs []gemvCase
	for _, pr := range []struct {
		name string
		p    product
	}{{"qkv", p.qkv}, {"o", p.o}, {"gate_up", p.gateUp}, {"down", p.down}, {"lm_head", p.head}} {
		cs = append(cs, gemvCase{pr.name, pr.p.mma}, gemvCase{pr.name + "/f", pr.p.fma})
	}
	gu4 := plain(gemvVariant{epiSilu, 4}, m.HiddenSize, m.IntermediateSize)
	gu4.mh, gu4.u, gu4.seg = 2, 32, m.IntermediateSize
	gu4.grid = (m.IntermediateSize + 31) / 32
	cs = append(cs,
		gemvCase{"o/m2", plain(gemvVariant{epiResid, 2}, m.QDim(), m.HiddenSize)},
		gemvCase{"down/m2", plain(gemvVariant{epiResid, 2}, m.IntermediateSize, m.HiddenSize)},
		gemvCase{"gate_up/m4", gu4},
		gemvCase{"lm_head/store", plain(gemvVariant{epiStore, 4}, m.HiddenSize, m.VocabSize)})
	// The fp32 products with each count of warps a unit (name/f<ks>;
	// name/f is the launch's own choice).
	for _, f := range []struct {
		name string
		c    gemvCall
	}{{"qkv", p.qkv.fma}, {"o", p.o.fma}, {"gate_up", p.gateUp.fma}, {"down", p.down.fma}} {
		for _, ks := range []int{1, 2, 4, 8} {
			c := f.c
			c.ks = ks
			cs = append(cs, gemvCase{fmt.Sprintf("%s/f%d", f.name, ks), c})
		}
	}
	// Past 8 tokens every tensor-core variant runs on gemvt.cu.
	for i := range cs {
		if c := &cs[i].call; c.v.mt != 0 && hasGemvt(c.v) {
			c.wide = true
		}
	}
	return cs
}

// weightRows is how many rows of weights product c reads.
func (c *gemvCall) weightRows() int {
	if c.v.epi == epiSilu {
		return 2 * c.n
	}
	return c.n
}

func llama1B() *model.Config {
	return &model.Config{Arch: model.ArchLlama, HiddenSize: 2048, NumLayers: 16, NumHeads: 32, NumKVHeads: 8, HeadDim: 64,
		IntermediateSize: 8192, VocabSize: 128256, RMSNormEps: 1e-5, RopeTheta: 500000, MaxPositions: 131072, TieEmbedding: true}
}

func llama8B() *model.Config {
	return &model.Config{Arch: model.ArchLlama, HiddenSize: 4096, NumLayers: 32, NumHeads: 32, NumKVHeads: 8, HeadDim: 128,
		IntermediateSize: 14336, VocabSize: 128256, RMSNormEps: 1e-5, RopeTheta: 500000, MaxPositions: 131072}
}

// TestSkinnyKernels checks every skinny product of several shapes (the
// conformance suite's odd ones, Qwen2's, the 1B and 8B Llamas) at 1 to 32
// tokens against float64 references on the same bf16 weights.
func TestSkinnyKernels(t *testing.T) {
	r := newKernelRig(t)
	shapes := map[string]*model.Config{"llama1b": llama1B(), "llama8b": llama8B()}
	odd := &model.Config{Arch: model.ArchQwen2, HiddenSize: 112, NumLayers: 1, NumHeads: 14, NumKVHeads: 2, HeadDim: 8,
		IntermediateSize: 160, VocabSize: 151, RMSNormEps: 1e-6, RopeTheta: 1e6, MaxPositions: 512, AttentionBias: true}
	shapes["odd-hd8"] = odd
	h16 := *odd
	h16.HiddenSize, h16.NumHeads, h16.NumKVHeads, h16.HeadDim, h16.IntermediateSize, h16.VocabSize = 48, 7, 1, 16, 80, 89
	shapes["odd-hd16"] = &h16
	qwen := &model.Config{Arch: model.ArchQwen2, HiddenSize: 896, NumLayers: 1, NumHeads: 14, NumKVHeads: 2, HeadDim: 64,
		IntermediateSize: 4864, VocabSize: 151936, RMSNormEps: 1e-6, RopeTheta: 1e6, MaxPositions: 32768, AttentionBias: true}
	shapes["qwen2-0.5b"] = qwen
	names := []string{"odd-hd8", "odd-hd16", "qwen2-0.5b", "llama1b", "llama8b"}
	for _, name := range names {
		m := shapes[name]
		for _, c := range gemvCases(m) {
			for _, tok := range []int{1, 2, 3, 8, 13, 32} {
				if (c.call.v.mt == 0) != (tok <= 2) {
					continue
				}
				t.Run(fmt.Sprintf("%s/%s/t%d", name, c.name, tok), func(t *testing.T) {
					checkGemv(t, r, m, c.call, tok)
				})
			}
		}
	}
}

// checkGemv runs product c for tok tokens on random data and compares
// sampled outputs with a float64 reference; every output must be written.
func checkGemv(t *testing.T, r *kernelRig, m *model.Config, c gemvCall, tok int) {
	rng := rand.New(rand.NewPCG(uint64(tok), uint64(c.n)))
	k := c.k
	rows := c.weightRows()
	w := r.alloc(t, rows*k*2)
	r.fill(t, w, rows*k, true, 0.05, 0)
	xrows := tok + 3
	x := r.alloc(t, xrows*k*4)
	r.fill(t, x, xrows*k, false, 1, 0)
	norm := c.v.epi != epiResid
	var g gpu.DevicePtr
	if norm {
		g = r.alloc(t, k*2)
		r.fill(t, g, k, true, 0.2, 1)
	}
	var rowmap gpu.DevicePtr
	rm := make([]int32, tok)
	for i := range rm {
		rm[i] = int32(i)
	}
	if c.v.epi == epiHead || c.v.epi == epiStore {
		for i := range rm {
			rm[i] = int32(rng.IntN(xrows))
		}
		rowmap = r.alloc(t, 4*tok)
		r.upload(t, rowmap, gpu.AsBytes(rm))
	}
	xh := r.f32s(t, x, xrows*k)
	var gh []float64
	if norm {
		gh = r.bf16s(t, g, k)
	}
	wrows := map[int][]float64{}
	// v(row, col): the product before the epilogue.
	v := func(row, col int) float64 {
		wr, ok := wrows[row]
		if !ok {
			wr = r.bf16s(t, w+gpu.DevicePtr(2*row*k), k)
			wrows[row] = wr
		}
		xr := int(rm[col])
		xs := xh[xr*k : (xr+1)*k]
		var dot, ss float64
		for i, xv := range xs {
			xf := float64(xv)
			ss += xf * xf
			if norm {
				xf *= gh[i]
			}
			dot += xf * wr[i]
		}
		if norm {
			dot /= math.Sqrt(ss/float64(k) + m.RMSNormEps)
		}
		return dot
	}
	sampled := map[int][]int{}
	samples := func(n int) []int {
		if s, ok := sampled[n]; ok {
			return s
		}
		s := make([]int, min(n, 64))
		for i := range s {
			s[i] = i
		}
		if n > 64 {
			s[1] = n - 1
			for i := 2; i < len(s); i++ {
				s[i] = rng.IntN(n)
			}
		}
		sampled[n] = s
		return s
	}
	var got, want []float64
	agree := func(what string) {
		t.Helper()
		var num, den float64
		for i := range got {
			if math.IsNaN(got[i]) {
				t.Fatalf("%s: output %d not written (NaN)", what, i)
			}
			num += (got[i] - want[i]) * (got[i] - want[i])
			den += want[i] * want[i]
		}
		if e := math.Sqrt(num / den); !(e < 2e-4) {
			t.Fatalf("%s: relative error %.3g over %d samples", what, e, len(got))
		}
	}
	noNaN := func(what string, vals []float32) {
		t.Helper()
		for i, x := range vals {
			if x != x {
				t.Fatalf("%s: element %d not written", what, i)
			}
		}
	}
	switch c.v.epi {
	case epiStore, epiHead:
		out := r.alloc(t, tok*c.n*4)
		r.poison(t, out, tok*c.n*4)
		var stats gpu.DevicePtr
		if c.v.epi == epiHead {
			stats = r.alloc(t, tok*(c.grid+8)*16)
			r.poison(t, stats, tok*(c.grid+8)*16)
		}
		r.launchGemv(t, m, &c, w, tok, gemvIO{x: x, rowmap: rowmap, g: g, out: out, ldo: c.n, stats: stats}, 0)
		oh := r.f32s(t, out, tok*c.n)
		noNaN("logits", oh)
		for col := 0; col < tok; col++ {
			for _, row := range samples(c.n) {
				got = append(got, float64(oh[col*c.n+row]))
				want = append(want, v(row, col))
			}
		}
		agree("logits")
		if stats == 0 {
			return
		}
		info := r.dev.Info()
		nstat := c.stats(tok, info.SMs, info.MaxSharedPerBlockOptin)
		sh := r.f32s(t, stats, tok*nstat*4)
		for col := 0; col < tok; col++ {
			row := oh[col*c.n : (col+1)*c.n]
			best := 0
			for i, x := range row {
				if x > row[best] {
					best = i
				}
			}
			var sum float64
			for _, x := range row {
				sum += math.Exp(float64(x - row[best]))
			}
			// Merge the partials as the sampler does.
			m, arg, z := math.Inf(-1), math.MaxInt32, 0.0
			for b := 0; b < nstat; b++ {
				s := sh[(col*nstat+b)*4:]
				if math.Float32bits(s[3]) != 0 {
					t.Fatalf("token %d partial %d flags a non-finite logit", col, b)
				}
				if v, i := float64(s[0]), int(int32(math.Float32bits(s[1]))); v > m || v == m && i < arg {
					m, arg = v, i
				}
			}
			for b := 0; b < nstat; b++ {
				s := sh[(col*nstat+b)*4:]
				if !math.IsInf(float64(s[0]), -1) {
					z += float64(s[2]) * math.Exp(float64(s[0])-m)
				}
			}
			if m != float64(row[best]) || arg != best || math.Abs(z-sum) > 1e-4*sum {
				t.Fatalf("token %d: partials give (%v, %d, %v), want (%v, %d, %v)", col, m, arg, z, row[best], best, sum)
			}
		}
	case epiResid:
		out := r.alloc(t, tok*c.n*4)
		r.fill(t, out, tok*c.n, false, 1, 0)
		before := r.f32s(t, out, tok*c.n)
		r.launchGemv(t, m, &c, w, tok, gemvIO{x: x, out: out, ldo: c.n}, 0)
		oh := r.f32s(t, out, tok*c.n)
		for col := 0; col < tok; col++ {
			for _, row := range samples(c.n) {
				got = append(got, float64(oh[col*c.n+row]-before[col*c.n+row]))
				want = append(want, v(row, col))
			}
		}
		agree("residual")
	case epiSilu:
		out := r.alloc(t, tok*c.n*4)
		r.poison(t, out, tok*c.n*4)
		r.launchGemv(t, m, &c, w, tok, gemvIO{x: x, g: g, out: out, ldo: c.n}, 0)
		oh := r.f32s(t, out, tok*c.n)
		noNaN("act", oh)
		for col := 0; col < tok; col++ {
			for _, row := range samples(c.n) {
				gv, uv := v(row, col), v(c.seg+row, col)
				got = append(got, float64(oh[col*c.n+row]))
				want = append(want, gv/(1+math.Exp(-gv))*uv)
			}
		}
		agree("silu")
	case epiRope:
		checkRope(t, r, m, c, tok, w, x, g, v, rng)
	}
}

// checkRope checks the q|k|v product's epilogue: bias, rotation, q and the
// KV cache rows.
func checkRope(t *testing.T, r *kernelRig, m *model.Config, c gemvCall, tok int, w, x, g gpu.DevicePtr, v func(row, col int) float64, rng *rand.Rand) {
	hd, half := m.HeadDim, m.HeadDim/2
	qDim, kvDim := m.QDim(), m.KVDim()
	var bias gpu.DevicePtr
	var bh []float64
	if m.AttentionBias {
		bias, bh = r.randBF16(t, c.n, 0.1, 0)
	}
	freq := m.RopeInvFreq()
	f32 := make([]float32, len(freq))
	for i, f := range freq {
		f32[i] = float32(f)
	}
	invFreq := r.alloc(t, 4*len(f32))
	r.upload(t, invFreq, gpu.AsBytes(f32))
	pos, crow := make([]int32, tok), make([]int32, tok)
	for i := range pos {
		pos[i] = int32(rng.IntN(4000))
		crow[i] = int32(2*i + 1)
	}
	posP, crowP := r.alloc(t, 4*tok), r.alloc(t, 4*tok)
	r.upload(t, posP, gpu.AsBytes(pos))
	r.upload(t, crowP, gpu.AsBytes(crow))
	cacheRows := 2*tok + 2
	kc, vc := r.alloc(t, cacheRows*kvDim*2), r.alloc(t, cacheRows*kvDim*2)
	q := r.alloc(t, tok*qDim*4)
	r.poison(t, q, tok*qDim*4)
	r.poison(t, kc, cacheRows*kvDim*2)
	r.poison(t, vc, cacheRows*kvDim*2)
	r.launchGemv(t, m, &c, w, tok, gemvIO{x: x, g: g, out: q, ldo: qDim, bias: bias, pos: posP, cacheRow: crowP, kcache: kc, vcache: vc}, invFreq)
	qh := r.f32s(t, q, tok*qDim)
	kh, vh := r.bf16s(t, kc, cacheRows*kvDim), r.bf16s(t, vc, cacheRows*kvDim)
	var got, want []float64
	heads := []int{}
	for h := 0; h < m.NumHeads+2*m.NumKVHeads; h++ {
		if m.HiddenSize < 1024 || h == 0 || h == m.NumHeads-1 || h == m.NumHeads || h == m.NumHeads+m.NumKVHeads || h == m.NumHeads+2*m.NumKVHeads-1 {
			heads = append(heads, h)
		}
	}
	for col := 0; col < tok; col++ {
		for _, h := range heads {
			for i := 0; i < half; i++ {
				row := h*hd + i
				x1, x2 := v(row, col), v(row+half, col)
				if bh != nil {
					x1 += bh[row]
					x2 += bh[row+half]
				}
				if h < m.NumHeads+m.NumKVHeads {
					ang := float64(pos[col]) * float64(f32[i])
					s, cs := math.Sincos(ang)
					x1, x2 = x1*cs-x2*s, x2*cs+x1*s
				}
				var g1, g2 float64
				switch {
				case h < m.NumHeads:
					g1, g2 = float64(qh[col*qDim+row]), float64(qh[col*qDim+row+half])
				case h < m.NumHeads+m.NumKVHeads:
					d := int(crow[col])*kvDim + (h-m.NumHeads)*hd + i
					g1, g2 = kh[d], kh[d+half]
				default:
					d := int(crow[col])*kvDim + (h-m.NumHeads-m.NumKVHeads)*hd + i
					g1, g2 = vh[d], vh[d+half]
				}
				if math.IsNaN(g1) || math.IsNaN(g2) {
					t.Fatalf("token %d head %d element %d not written", col, h, i)
				}
				got = append(got, g1, g2)
				want = append(want, x1, x2)
			}
		}
	}
	var num, den float64
	for i := range got {
		num += (got[i] - want[i]) * (got[i] - want[i])
		den += want[i] * want[i]
	}
	// k and v are rounded to bf16 in the cache.
	if e := math.Sqrt(num / den); !(e < 4e-3) {
		t.Fatalf("q|k|v: relative error %.3g", e)
	}
}

// TestAttentionKernel checks the split-sequence attention against a float64
// reference for several head layouts, contexts and splits.
func TestAttentionKernel(t *testing.T) {
	r := newKernelRig(t)
	for _, tc := range []struct {
		nh, nkv, hd int
		ctx         []int // per token: its position + 1
		splits      []int
	}{
		{32, 8, 64, []int{1, 17, 300}, []int{1, 3, 16}},
		{32, 8, 128, []int{5, 64, 129, 700}, []int{1, 2, 16}},
		{14, 2, 64, []int{2, 100}, []int{1, 4}},
		{16, 1, 64, []int{90}, []int{1, 5}},
		{7, 1, 8, []int{1, 33, 65}, []int{1, 3}},
		{4, 4, 16, []int{7, 48}, []int{1, 2}},
		{4, 2, 48, []int{40}, []int{1, 2}},
	} {
		for _, sp := range tc.splits {
			for _, v := range attnVariants {
				t.Run(fmt.Sprintf("h%d-kv%d-d%d-s%d-w%d-c%d-gqa%v", tc.nh, tc.nkv, tc.hd, sp, v.warps, v.minChunk, v.gqa), func(t *testing.T) {
					checkAttention(t, r, tc.nh, tc.nkv, tc.hd, decodeSeqs(tc.ctx), sp, false, v)
				})
			}
		}
	}
	// Prefill chunks: the whole tiles on attention_prefill_d*, the rest
	// (tiles mixing sequences, short ones) on attention_r*.
	for _, tc := range []struct {
		nh, nkv, hd int
		seqs        []attnSeq
	}{
		// Tiles: two whole, one mixed (four sequences), a short whole one.
		{32, 8, 64, []attnSeq{{200, 150}, {40, 40}, {300, 1}, {70, 20}}},
		// A decode row ahead of two prompts (their tiles follow their
		// positions, not the step's rows), a chunk from position 100 (a
		// whole tile of 28 rows, then 52), one from 60 (two short tiles).
		{32, 8, 64, []attnSeq{{70, 1}, {64, 64}, {64, 64}, {180, 80}, {70, 10}}},
		// A tile at position 0, two mid-sequence, a 2-row tail.
		{32, 8, 128, []attnSeq{{64, 64}, {513, 130}}},
		{14, 2, 64, []attnSeq{{100, 100}}},
	} {
		t.Run(fmt.Sprintf("prefill-h%d-kv%d-d%d", tc.nh, tc.nkv, tc.hd), func(t *testing.T) {
			checkAttention(t, r, tc.nh, tc.nkv, tc.hd, tc.seqs, 1, true, attnVariants[0])
		})
	}
}

// attnSetup is a random attention problem on the device.
type attnSetup struct {
	nh, nkv, hd, bs, tok int
	q, kc, vc, out, outB gpu.DevicePtr
	tables, tabOff, pos  gpu.DevicePtr
	part, partML, counts gpu.DevicePtr
	ctx, seq             []int // per token: its position + 1, its sequence
	tab                  [][]int32
	// prefill: launch runs attention_prefill_d<hd> on the whole tiles
	// beside the per-row kernel on the rows left (prefillLists's, on the
	// device at tiles and rows), as the stage does.
	prefill       bool
	tiles, rows   gpu.DevicePtr
	nTiles, nRows int
	// plan is the per-row kernel's: its warps and least part are varied.
	plan attnPlan
}

// attnSeq is a sequence of an attention problem: keys positions cached
// (this step's included), its last tokens of them the step's rows.
type attnSeq struct{ keys, tokens int }

// decodeSeqs are one-token sequences of ctx[i] keys.
func decodeSeqs(ctx []int) []attnSeq {
	s := make([]attnSeq, len(ctx))
	for i, n := range ctx {
		s[i] = attnSeq{n, 1}
	}
	return s
}

func newAttnSetup(t *testing.T, r *kernelRig, nh, nkv, hd int, seqs []attnSeq, maxSplits int) *attnSetup {
	rng := rand.New(rand.NewPCG(uint64(nh*hd), uint64(len(seqs))))
	a := &attnSetup{nh: nh, nkv: nkv, hd: hd, bs: 16, plan: newAttnPlan(&model.Config{NumHeads: nh, NumKVHeads: nkv, HeadDim: hd}, r.dev.Info().SMs)}
	blocks := 0
	for _, sq := range seqs {
		blocks += (sq.keys + a.bs - 1) / a.bs
		a.tok += sq.tokens
	}
	perm := rng.Perm(blocks)
	var words, off, pos []int32
	for i, sq := range seqs {
		nb := (sq.keys + a.bs - 1) / a.bs
		tab := make([]int32, nb)
		for j := range tab {
			tab[j] = int32(perm[0])
			perm = perm[1:]
		}
		a.tab = append(a.tab, tab)
		for p := sq.keys - sq.tokens; p < sq.keys; p++ {
			a.ctx = append(a.ctx, p+1)
			a.seq = append(a.seq, i)
			off = append(off, int32(len(words)))
			pos = append(pos, int32(p))
		}
		words = append(words, tab...)
	}
	rows := blocks * a.bs
	kvDim := nkv * hd
	a.q = r.alloc(t, a.tok*nh*hd*4)
	r.fill(t, a.q, a.tok*nh*hd, false, 1, 0)
	a.kc, a.vc = r.alloc(t, rows*kvDim*2), r.alloc(t, rows*kvDim*2)
	r.fill(t, a.kc, rows*kvDim, true, 1, 0)
	r.fill(t, a.vc, rows*kvDim, true, 1, 0)
	a.out = r.alloc(t, a.tok*nh*hd*4)
	a.outB = r.alloc(t, 2*a.tok*nh*hd*2)
	a.tables, a.tabOff, a.pos = r.alloc(t, 4*len(words)), r.alloc(t, 4*a.tok), r.alloc(t, 4*a.tok)
	r.upload(t, a.tables, gpu.AsBytes(words))
	r.upload(t, a.tabOff, gpu.AsBytes(off))
	r.upload(t, a.pos, gpu.AsBytes(pos))
	lay := layout{maxTokens: a.tok}
	desc := make([]int32, lay.words())
	copy(desc[lay.pos():], pos)
	copy(desc[lay.tableOff():], off)
	a.nTiles, a.nRows = lay.prefillLists(desc, a.tok)
	a.tiles, a.rows = r.alloc(t, 4*max(1, 2*a.nTiles)), r.alloc(t, 4*max(1, 2*a.nRows))
	r.upload(t, a.tiles, gpu.AsBytes(desc[lay.tileList():lay.tileList()+2*a.nTiles]))
	r.upload(t, a.rows, gpu.AsBytes(desc[lay.rowList():lay.rowList()+2*a.nRows]))
	units := a.tok * nkv * newAttnPlan(&model.Config{NumHeads: nh, NumKVHeads: nkv}, smsEstimate).groups
	a.part = r.alloc(t, units*maxSplits*attentionHeads*hd*4)
	a.partML = r.alloc(t, units*maxSplits*attentionHeads*2*4)
	a.counts = r.alloc(t, units*4)
	if err := r.dev.Do(func() error { return gpu.MemsetD8Async(a.counts, 0, units*4, r.st) }); err != nil {
		t.Fatal(err)
	}
	return a
}

func (a *attnSetup) launch(r *kernelRig, splits int, dep bool) error {
	ap := a.plan
	groups := ap.groups
	al := ap.launch(a.tok)
	scale := float32(1 / math.Sqrt(float64(a.hd)))
	prefill := a.prefill && a.nTiles > 0
	rows, perRow := gpu.DevicePtr(0), a.tok
	if prefill {
		rows, perRow = a.rows, a.nRows
	}
	launch := func(f gpu.Function, grid, block gpu.Dim3, smem int, args *gpu.KernelArgs) error {
		if dep {
			return f.LaunchDependent(grid, block, smem, r.st, args)
		}
		return f.Launch(grid, block, smem, r.st, args)
	}
	if perRow > 0 {
		args := a.args(r, al, splits, a.tok, rows)
		grid := gpu.Dim3{X: uint32(perRow), Y: uint32(a.nkv * groups), Z: uint32(splits)}
		if err := launch(r.fn[al.name], grid, gpu.Dim3{X: uint32(al.threads)}, al.smem, args); err != nil || !prefill {
			return err
		}
	}
	args := r.args.Reset().Ptr(a.q).Ptr(a.kc).Ptr(a.vc).Ptr(a.out).Ptr(a.outB).Int32(int32(a.tok)).
		Ptr(a.tables).Ptr(a.tabOff).Ptr(a.pos).Int32(int32(a.bs)).Int32(int32(a.nh)).Int32(int32(a.nkv)).
		Float32(scale).Ptr(a.tiles)
	return launch(r.fn[prefillName(a.hd)], prefillGrid(a.nh, a.nTiles), gpu.Dim3{X: prefillThreads}, prefillSmem(a.hd), args)
}

// args are the per-row and tensor-core kernels' ATT_PARAMS for launch al
// in splits parts, the outputs' remainder rows lo on, for the rows listed
// at rows (0: every row).
func (a *attnSetup) args(r *kernelRig, al attnLaunch, splits, lo int, rows gpu.DevicePtr) *gpu.KernelArgs {
	scale := float32(1 / math.Sqrt(float64(a.hd)))
	return r.args.Reset().Ptr(a.q).Ptr(a.kc).Ptr(a.vc).Ptr(a.out).Ptr(a.outB).Int32(int32(lo)).
		Ptr(a.tables).Ptr(a.tabOff).Ptr(a.pos).Int32(int32(a.bs)).Int32(int32(a.nh)).Int32(int32(a.nkv)).Int32(int32(a.hd)).
		Float32(scale).Int32(int32(splits)).Int32(int32(al.minChunk)).Ptr(a.part).Ptr(a.partML).Ptr(a.counts).Ptr(rows)
}

// attnVariant is a block size and least part of the per-row kernel, or
// the tensor-core kernel (gqa).
type attnVariant struct {
	warps, minChunk int
	gqa             bool
}

// attnVariants are those the tests try: the plan's own choice first.
var attnVariants = []attnVariant{{}, {4, 64, false}, {16, 64, false}, {16, 256, false}, {4, 0, true}, {8, 0, true}}

// set makes a's launches v's, reporting whether v applies to a.
func (v attnVariant) set(a *attnSetup) bool {
	a.plan.warps, a.plan.minChunk, a.plan.gqaWarps = v.warps, v.minChunk, 0
	// The plan's own choice: the stage's (gqa where it serves).
	a.plan.gqa = v == attnVariant{} && a.plan.groups == 1 && slices.Contains(prefillHeadDims, a.hd)
	if v.gqa {
		if a.plan.groups != 1 || !slices.Contains(prefillHeadDims, a.hd) {
			return false
		}
		a.plan.warps, a.plan.gqa, a.plan.gqaWarps = 0, true, v.warps
	}
	return true
}

func checkAttention(t *testing.T, r *kernelRig, nh, nkv, hd int, seqs []attnSeq, splits int, prefill bool, v attnVariant) {
	a := newAttnSetup(t, r, nh, nkv, hd, seqs, splits)
	a.prefill = prefill
	if !v.set(a) {
		t.Skipf("%+v does not take this shape", v)
	}
	r.poison(t, a.out, a.tok*nh*hd*4)
	r.poison(t, a.outB, 2*a.tok*nh*hd*2)
	// Twice: the counters must be back at 0 after the first run.
	for run := 0; run < 2; run++ {
		if err := r.dev.Do(func() error {
			if err := a.launch(r, splits, false); err != nil {
				return err
			}
			return r.st.Synchronize()
		}); err != nil {
			t.Fatal(err)
		}
	}
	out := r.f32s(t, a.out, a.tok*nh*hd)
	outB := r.bf16s(t, a.outB, 2*a.tok*nh*hd)
	q := r.f32s(t, a.q, a.tok*nh*hd)
	rows := 0
	for _, tab := range a.tab {
		rows += len(tab) * a.bs
	}
	kvDim := nkv * hd
	kh, vh := r.bf16s(t, a.kc, rows*kvDim), r.bf16s(t, a.vc, rows*kvDim)
	scale := 1 / math.Sqrt(float64(hd))
	var num, den, numB float64
	for ti, n := range a.ctx {
		tab := a.tab[a.seq[ti]]
		for h := 0; h < nh; h++ {
			kvh := h / (nh / nkv)
			sc := make([]float64, n)
			mx := math.Inf(-1)
			for j := 0; j < n; j++ {
				row := int(tab[j/a.bs])*a.bs + j%a.bs
				var d float64
				for i := 0; i < hd; i++ {
					d += float64(q[(ti*nh+h)*hd+i]) * kh[row*kvDim+kvh*hd+i]
				}
				sc[j] = d * scale
				mx = max(mx, sc[j])
			}
			var l float64
			for j := range sc {
				sc[j] = math.Exp(sc[j] - mx)
				l += sc[j]
			}
			for i := 0; i < hd; i++ {
				var o float64
				for j := 0; j < n; j++ {
					row := int(tab[j/a.bs])*a.bs + j%a.bs
					o += sc[j] * vh[row*kvDim+kvh*hd+i]
				}
				o /= l
				idx := (ti*nh+h)*hd + i
				g := float64(out[idx])
				gb := outB[idx] + outB[a.tok*nh*hd+idx]
				if math.IsNaN(g) || math.IsNaN(gb) {
					t.Fatalf("token %d head %d element %d not written", ti, h, i)
				}
				num += (g - o) * (g - o)
				numB += (gb - o) * (gb - o)
				den += o * o
			}
		}
	}
	// The prefill kernel's products take q and P as bf16 pairs (about 16
	// bits).
	tol := 1e-5
	if prefill {
		tol = 5e-5
	}
	if e, eb := math.Sqrt(num/den), math.Sqrt(numB/den); !(e < tol) || !(eb < 1e-4) {
		t.Fatalf("relative error %.3g (fp32 output), %.3g (bf16 pair)", e, eb)
	}
}

// TestSkinnyBandwidth times every skinny product of the 1B and 8B Llama
// shapes at 1, 8, 16 and 32 tokens in CUDA graphs of many launches over
// weight copies that together exceed L2 (so each launch reads its weights
// from HBM), with and without dependent launches, next to cuBLAS on the
// same shapes (compensated: twice the rows) and to the copy bandwidth; and
// attention at decode sizes. The table goes to the log and TANDEM_RESULTS.
func TestSkinnyBandwidth(t *testing.T) {
	if testing.Short() {
		t.Skip("timing: not in -short mode")
	}
	r := newKernelRig(t)
	bw := copyBandwidth(t, r.dev)
	const pool = 1200 << 20 // weight copies
	wbuf := r.alloc(t, pool)
	r.fill(t, wbuf, pool/2, true, 0.05, 0)
	maxK, maxRows := 14336, 128256
	x := r.alloc(t, 64*maxK*4)
	r.fill(t, x, 64*maxK, false, 1, 0)
	g := r.alloc(t, maxK*2)
	r.fill(t, g, maxK, true, 0.2, 1)
	out := r.alloc(t, 64*maxRows*4)
	stats := r.alloc(t, 32*(maxRows/4+8)*16)
	xb := r.alloc(t, 64*maxK*2) // cuBLAS input: 2T bf16 rows
	r.fill(t, xb, 64*maxK, true, 1, 0)
	invFreq := r.alloc(t, 4*64)
	r.fill(t, invFreq, 64, false, 0.5, 0.5)
	pos, crow := r.alloc(t, 4*32), r.alloc(t, 4*32)
	r.upload(t, pos, gpu.AsBytes(make([]int32, 32)))
	r.upload(t, crow, gpu.AsBytes([]int32{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31}))
	kc, vc := r.alloc(t, 32*8*128*2), r.alloc(t, 32*8*128*2)
	var table strings.Builder
	fmt.Fprintf(&table, "copy bandwidth %.2f TB/s\n%-8s %-14s %4s %9s %9s %9s %7s %7s %7s\n", bw/1e12,
		"model", "product", "T", "plain us", "dep us", "cublas us", "plain", "dep", "cublas")
	res := map[string]any{"copy_bw": bw}
	for _, mname := range []string{"llama1b", "llama8b"} {
		m := llama1B()
		if mname == "llama8b" {
			m = llama8B()
		}
		for _, c := range gemvCases(m) {
			bytes := c.call.weightRows() * c.call.k * 2
			copies := max(1, min(64, pool/bytes))
			reps := copies * max(1, (24+copies-1)/copies)
			toks := []int{1, 8, 16, 32}
			if c.call.v.mt == 0 {
				toks = []int{1, 2}
			}
			for _, tok := range toks {
				io := gemvIO{x: x, out: out, ldo: c.call.n, stats: stats}
				switch c.call.v.epi {
				case epiSilu, epiHead, epiStore:
					io.g = g
				case epiRope:
					io.g, io.out, io.ldo, io.pos, io.cacheRow, io.kcache, io.vcache = g, out, m.QDim(), pos, crow, kc, vc
				}
				run := func(dep bool) func(i int) error {
					return func(i int) error {
						w := wbuf + gpu.DevicePtr((i%copies)*bytes)
						return r.gemv(m, &c.call, w, tok, io, invFreq, dep)
					}
				}
				plainT := r.timeGraph(t, reps, run(false))
				depT := plainT
				if r.dependents {
					depT = r.timeGraph(t, reps, run(true))
				}
				blasT := r.timeGraph(t, reps, func(i int) error {
					w := wbuf + gpu.DevicePtr((i%copies)*bytes)
					rows := c.call.weightRows()
					return r.blas.Gemm(gpu.OpT, gpu.OpN, rows, 2*tok, c.call.k, 1, w, gpu.R16BF, c.call.k, xb, gpu.R16BF, c.call.k, 0, out, gpu.R32F, rows)
				})
				frac := func(d time.Duration) float64 { return float64(bytes) / d.Seconds() / bw }
				fmt.Fprintf(&table, "%-8s %-14s %4d %9.2f %9.2f %9.2f %6.0f%% %6.0f%% %6.0f%%\n", mname, c.name, tok,
					us(plainT), us(depT), us(blasT), 100*frac(plainT), 100*frac(depT), 100*frac(blasT))
				res[fmt.Sprintf("%s/%s/t%d", mname, c.name, tok)] = map[string]float64{"bytes": float64(bytes),
					"plain_us": us(plainT), "dep_us": us(depT), "cublas_us": us(blasT),
					"plain_frac": frac(plainT), "dep_frac": frac(depT), "cublas_frac": frac(blasT)}
			}
		}
	}
	// Attention at decode sizes: every token of its own sequence.
	fmt.Fprintf(&table, "%-8s %-18s %4s %9s %9s\n", "model", "attention", "T", "ctx", "us")
	for _, tc := range []struct {
		name        string
		nh, nkv, hd int
	}{{"llama1b", 32, 8, 64}, {"llama8b", 32, 8, 128}} {
		for _, sz := range []struct{ tok, ctx int }{{1, 256}, {1, 4096}, {32, 256}, {32, 1024}} {
			ctx := make([]int, sz.tok)
			for i := range ctx {
				ctx[i] = sz.ctx
			}
			a := newAttnSetup(t, r, tc.nh, tc.nkv, tc.hd, decodeSeqs(ctx), 16)
			plan := a.plan
			for vi, v := range attnVariants {
				if !v.set(a) {
					continue
				}
				// The variant's own splits (the plan's, first: the stage's
				// choice), and the others beside them.
				sp := a.plan.splits(sz.tok)
				tries := []int{sp}
				for _, o := range []int{1, 2, 4, 8, 16} {
					if o != sp {
						tries = append(tries, o)
					}
				}
				for i, n := range tries {
					d := r.timeGraph(t, 20, func(int) error { return a.launch(r, n, r.dependents) })
					al := a.plan.launch(sz.tok)
					label := fmt.Sprintf("%s c%d s%d", strings.TrimPrefix(al.name, "attention_"), al.minChunk, n)
					key := fmt.Sprintf("%s/attention/t%d/ctx%d", tc.name, sz.tok, sz.ctx)
					if vi == 0 && i == 0 {
						label += " (plan)"
						res[key] = us(d)
					} else {
						res[fmt.Sprintf("%s/w%d/c%d/gqa%v/splits%d", key, v.warps, v.minChunk, v.gqa, n)] = us(d)
					}
					fmt.Fprintf(&table, "%-8s %-18s %4d %9d %9.2f\n", tc.name, label, sz.tok, sz.ctx, us(d))
				}
			}
			a.plan = plan
		}
		// A prefill of 4 sequences of 512 tokens: per row, and with the
		// tensor-core kernel taking the whole tiles.
		a := newAttnSetup(t, r, tc.nh, tc.nkv, tc.hd, []attnSeq{{512, 512}, {512, 512}, {512, 512}, {512, 512}}, 16)
		for _, pf := range []bool{false, true} {
			a.prefill = pf
			d := r.timeGraph(t, 5, func(int) error { return a.launch(r, 1, r.dependents) })
			label := "prefill, per row"
			if pf {
				label = "prefill, tiles"
			}
			res[fmt.Sprintf("%s/attention/prefill4x512/tiles=%v", tc.name, pf)] = us(d)
			fmt.Fprintf(&table, "%-8s %-18s %4d %9d %9.2f\n", tc.name, label, 2048, 512, us(d))
		}
	}
	t.Logf("skinny products, µs per launch and fraction of the copy bandwidth (weights read / time)\n%s", table.String())
	writeResult(t, "skinny", res)
}

func us(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }

// timeGraph captures reps calls of launch(i) in one graph and returns the
// median time per call over 7 replays (after 2 of warm-up).
func (r *kernelRig) timeGraph(t *testing.T, reps int, launch func(i int) error) time.Duration {
	t.Helper()
	var times []time.Duration
	err := r.dev.Do(func() error {
		if err := r.st.BeginCapture(gpu.CaptureThreadLocal); err != nil {
			return err
		}
		var lerr error
		for i := 0; i < reps && lerr == nil; i++ {
			lerr = launch(i)
		}
		gr, err := r.st.EndCapture()
		if lerr != nil || err != nil {
			if gr != 0 {
				gr.Destroy()
			}
			return fmt.Errorf("capture: %v %v", lerr, err)
		}
		ex, err := gr.Instantiate()
		gr.Destroy()
		if err != nil {
			return err
		}
		defer ex.Destroy()
		for i := 0; i < 9; i++ {
			if err := r.e0.Record(r.st); err != nil {
				return err
			}
			if err := ex.Launch(r.st); err != nil {
				return err
			}
			if err := r.e1.Record(r.st); err != nil {
				return err
			}
			if err := r.e1.Synchronize(); err != nil {
				return err
			}
			d, err := gpu.Elapsed(r.e0, r.e1)
			if err != nil {
				return err
			}
			if i >= 2 {
				times = append(times, d/time.Duration(reps))
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(times)
	return times[len(times)/2]
}

// TestAttentionRopeKernel checks attention_gqa_rope_* against what it
// replaces, rope_qkv then attention_gqa_*, bit for bit: the outputs (fp32
// and the bf16 pair) and both caches. Decode rows at contexts that make one
// part and several, the new key in a part's first tiles and past them; with
// and without remainder rows and a bias.
func TestAttentionRopeKernel(t *testing.T) {
	r := newKernelRig(t)
	for _, tc := range []struct {
		nh, nkv, hd int
		ctx         []int
		splits      []int
	}{
		{32, 8, 64, []int{1, 17, 300, 1000}, []int{1, 3, 16}},
		{32, 8, 128, []int{5, 64, 129, 700}, []int{1, 2, 16}},
		{14, 2, 64, []int{2, 100, 513}, []int{1, 4}},
	} {
		for _, sp := range tc.splits {
			for _, w := range gqaWarps {
				for _, lo := range []bool{false, true} {
					bias := tc.nh == 14
					t.Run(fmt.Sprintf("h%d-kv%d-d%d-s%d-w%d-lo%v-bias%v", tc.nh, tc.nkv, tc.hd, sp, w, lo, bias), func(t *testing.T) {
						checkAttentionRope(t, r, tc.nh, tc.nkv, tc.hd, tc.ctx, sp, w, lo, bias)
					})
				}
			}
		}
	}
}

func checkAttentionRope(t *testing.T, r *kernelRig, nh, nkv, hd int, ctx []int, splits, w int, lo, withBias bool) {
	a := newAttnSetup(t, r, nh, nkv, hd, decodeSeqs(ctx), splits)
	a.plan.gqa, a.plan.gqaWarps = true, w
	al := a.plan.launch(a.tok)
	T := a.tok
	width := (nh + 2*nkv) * hd
	qkv := r.alloc(t, 2*T*width*4)
	r.fill(t, qkv, 2*T*width, false, 1, 0)
	var bias gpu.DevicePtr
	if withBias {
		bias = r.alloc(t, width*2)
		r.fill(t, bias, width, true, 0.5, 0)
	}
	m := &model.Config{NumHeads: nh, NumKVHeads: nkv, HeadDim: hd, RopeTheta: 500000}
	inv := r.alloc(t, hd/2*4)
	r.upload(t, inv, gpu.AsBytes(invFreq(m)))
	rowsOf := make([]int32, T)
	for ti, n := range a.ctx {
		p := n - 1
		rowsOf[ti] = a.tab[a.seq[ti]][p/a.bs]*int32(a.bs) + int32(p%a.bs)
	}
	cacheRow := r.alloc(t, 4*T)
	r.upload(t, cacheRow, gpu.AsBytes(rowsOf))
	rows := 0
	for _, tab := range a.tab {
		rows += len(tab) * a.bs
	}
	cacheBytes := rows * nkv * hd * 2
	k0, v0 := r.alloc(t, cacheBytes), r.alloc(t, cacheBytes)
	loRows := 0
	if lo {
		loRows = T
	}
	// run launches the two kernels (fused false) or the one, from the
	// caches as filled, and returns the outputs and caches.
	run := func(fused bool) (out []float32, outB, kc, vc []float64) {
		r.poison(t, a.out, T*nh*hd*4)
		r.poison(t, a.outB, 2*T*nh*hd*2)
		r.poison(t, a.q, T*nh*hd*4)
		err := r.dev.Do(func() error {
			if err := gpu.CopyDtoDAsync(a.kc, k0, cacheBytes, r.st); err != nil {
				return err
			}
			if err := gpu.CopyDtoDAsync(a.vc, v0, cacheBytes, r.st); err != nil {
				return err
			}
			if !fused {
				args := r.args.Reset().Ptr(qkv).Int32(int32(loRows)).Ptr(bias).Ptr(inv).Ptr(a.pos).Ptr(cacheRow).
					Ptr(a.q).Ptr(a.kc).Ptr(a.vc).Int32(int32(nh)).Int32(int32(nkv)).Int32(int32(hd))
				pairs := (nh + nkv) * hd / 2
				grid := gpu.Dim3{X: uint32(T), Y: uint32((pairs + ropeThreads - 1) / ropeThreads)}
				if err := r.fn[kRopeQKV].Launch(grid, gpu.Dim3{X: ropeThreads}, 0, r.st, args); err != nil {
					return err
				}
			}
			name := al.name
			args := a.args(r, al, splits, loRows, 0)
			if fused {
				name = al.ropeName
				args.Ptr(qkv).Ptr(bias).Ptr(inv).Ptr(cacheRow)
			}
			grid := gpu.Dim3{X: uint32(T), Y: uint32(nkv), Z: uint32(splits)}
			if err := r.fn[name].LaunchDependent(grid, gpu.Dim3{X: uint32(al.threads)}, al.smem, r.st, args); err != nil {
				return err
			}
			return r.st.Synchronize()
		})
		if err != nil {
			t.Fatal(err)
		}
		return r.f32s(t, a.out, T*nh*hd), r.bf16s(t, a.outB, 2*T*nh*hd), r.bf16s(t, a.kc, cacheBytes/2), r.bf16s(t, a.vc, cacheBytes/2)
	}
	// The caches as a step finds them: earlier keys random, this step's
	// rows poisoned (NaN), so that a key not written is seen.
	r.fill(t, k0, cacheBytes/2, true, 1, 0)
	r.fill(t, v0, cacheBytes/2, true, 1, 0)
	nan := bytes.Repeat([]byte{0xff}, nkv*hd*2)
	for _, row := range rowsOf {
		off := gpu.DevicePtr(int(row) * nkv * hd * 2)
		r.upload(t, k0+off, nan)
		r.upload(t, v0+off, nan)
	}
	wantOut, wantB, wantK, wantV := run(false)
	gotOut, gotB, gotK, gotV := run(true)
	compare := func(what string, got, want []float64) {
		t.Helper()
		bad := 0
		for i := range want {
			if math.Float64bits(got[i]) != math.Float64bits(want[i]) {
				if bad < 3 {
					t.Errorf("%s[%d] = %v, want %v (rope_qkv then attention)", what, i, got[i], want[i])
				}
				bad++
			}
		}
		if bad > 0 {
			t.Errorf("%s: %d of %d differ", what, bad, len(want))
		}
	}
	o64 := func(v []float32) []float64 {
		out := make([]float64, len(v))
		for i, x := range v {
			out[i] = float64(x)
		}
		return out
	}
	for i, x := range wantOut {
		if math.IsNaN(float64(x)) {
			t.Fatalf("reference output %d is NaN: the test's setup is wrong", i)
		}
	}
	compare("fp32 output", o64(gotOut), o64(wantOut))
	compare("bf16 output pair", gotB, wantB)
	compare("K cache", gotK, wantK)
	compare("V cache", gotV, wantV)
}
