package cuda

import (
	"fmt"
	"os"
	"slices"

	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/model"
)

// OptionalEnv is the environment variable that, set to "off", keeps the
// optional kernels (gemvt.cu) out of every stage of the process: a way
// around a device or driver on which they misbehave, without a rebuild.
const OptionalEnv = "TANDEM_CUDA_OPTIONAL"

// compileKey describes the compilation of the kernel program for this
// device: the source, its options and the cache key over them.
type compileKey struct {
	src  string
	opts []string
	key  string
}

// compileKey is the compilation of the program, with its optional part or
// without.
func (s *Stage) compileKey(optional bool) (compileKey, error) {
	src, err := kernelSource(optional)
	if err != nil {
		return compileKey{}, err
	}
	major, minor, err := gpu.NVRTCVersion()
	if err != nil {
		return compileKey{}, fmt.Errorf("NVRTC: %w", err)
	}
	arch := s.dev.Info().Arch()
	opts := []string{"--gpu-architecture=" + arch}
	if s.timeline {
		opts = append(opts, "-DTANDEM_TIMELINE")
	}
	return compileKey{src: src, opts: opts, key: cacheKey(src, arch, fmt.Sprintf("%d.%d", major, minor), opts)}, nil
}

// kernelImage returns the compiled kernel program, with its optional part
// when that compiles (optional reports it), from the disk cache when it
// holds a sound image for this source, device and NVRTC, else compiled now
// and stored. A program whose optional part does not compile is compiled
// without it, and the stage runs without the kernels it holds.
func (s *Stage) kernelImage(dir string) (img []byte, optional bool, err error) {
	if os.Getenv(OptionalEnv) == "off" {
		s.log.Info("the optional kernels (gemvt.cu) are off (" + OptionalEnv + "=off): steps of more than 8 tokens run on cuBLAS")
		img, err = s.programImage(dir, false)
		return img, false, err
	}
	img, err = s.programImage(dir, true)
	if err == nil {
		return img, true, nil
	}
	s.log.Warn("the optional kernels (gemvt.cu) did not compile: steps of more than 8 tokens run on cuBLAS", "err", err)
	img, err = s.programImage(dir, false)
	return img, false, err
}

// programImage is kernelImage for the program with its optional part or
// without.
func (s *Stage) programImage(dir string, optional bool) ([]byte, error) {
	ck, err := s.compileKey(optional)
	if err != nil {
		return nil, err
	}
	c, err := openCache(dir)
	if err != nil {
		s.log.Warn("kernel cache unusable; compiling", "err", err)
		return s.compileKernels(ck)
	}
	img, err := c.get(ck.key)
	if err != nil {
		s.log.Warn("kernel cache entry unusable; recompiling", "err", err)
	}
	if img != nil {
		return img, nil
	}
	img, err = s.compileKernels(ck)
	if err != nil {
		return nil, err
	}
	if err := c.put(ck.key, img); err != nil {
		s.log.Warn("kernel cache not written", "err", err)
	}
	return img, nil
}

func openCache(dir string) (kernelCache, error) {
	if dir == "" {
		d, err := model.CacheDir("kernels")
		if err != nil {
			return kernelCache{}, err
		}
		dir = d
	}
	return kernelCache{dir: dir}, nil
}

func (s *Stage) compileKernels(ck compileKey) ([]byte, error) {
	out, err := gpu.Compile(ck.src, "tandem_kernels.cu", ck.opts...)
	if err != nil {
		return nil, fmt.Errorf("compile kernels: %w", err)
	}
	if out.Log != "" {
		s.log.Debug("kernel compiler log", "log", out.Log)
	}
	img := out.Image
	if out.PTX && (len(img) == 0 || img[len(img)-1] != 0) {
		img = append(img, 0)
	}
	return img, nil
}

// loadModule loads img (with the optional kernels or not) and looks up
// every kernel. When a cached image does not load (a damaged file with a
// sound checksum, or a driver that rejects it), the program is compiled
// afresh and the cache entry replaced. Device goroutine only.
func (s *Stage) loadModule(img []byte, optional bool, dir string) error {
	mod, err := gpu.LoadModule(img)
	if err != nil {
		s.log.Warn("kernel image did not load; recompiling", "err", err)
		ck, kerr := s.compileKey(optional)
		if kerr != nil {
			return kerr
		}
		if img, err = s.compileKernels(ck); err != nil {
			return err
		}
		if mod, err = gpu.LoadModule(img); err != nil {
			return fmt.Errorf("load compiled kernels: %w", err)
		}
		if c, cerr := openCache(dir); cerr == nil {
			if err := c.put(ck.key, img); err != nil {
				s.log.Warn("kernel cache not written", "err", err)
			}
		}
	}
	s.mod = mod
	s.fn, err = lookupKernels(mod, s.dev.Info(), optional)
	return err
}

// lookupKernels finds every kernel of the program in mod (the optional ones
// too when it has them) and raises the shared memory limit of those that
// need more than the default 48 KiB (the gemvf and gemvg kernels: the
// device's whole limit, as their need depends on the model;
// attention_gqa_d128_w8, attention_prefill_d128).
// Device goroutine only.
func lookupKernels(mod gpu.Module, info gpu.DeviceInfo, optional bool) (map[string]gpu.Function, error) {
	names := kernelNames
	if optional {
		names = append(slices.Clone(names), optionalNames...)
	}
	fn := make(map[string]gpu.Function, len(names))
	for _, name := range names {
		f, err := mod.Function(name)
		if err != nil {
			return nil, fmt.Errorf("kernel %s: %w", name, err)
		}
		fn[name] = f
	}
	if optional {
		for _, v := range gemvtVariants {
			if n := gemvtSmem(v.mt); n > 48<<10 {
				if err := fn[gemvtName(v)].SetMaxDynamicSharedMem(n); err != nil {
					return nil, err
				}
			}
		}
	}
	for _, v := range gemvVariants {
		for _, nt := range gemvNT {
			if n := gemvSmem(v.mt, nt); n > 48<<10 {
				if err := fn[gemvName(v, nt)].SetMaxDynamicSharedMem(n); err != nil {
					return nil, err
				}
			}
		}
	}
	for _, hd := range prefillHeadDims {
		if n := prefillSmem(hd); n > 48<<10 && n <= info.MaxSharedPerBlockOptin {
			if err := fn[prefillName(hd)].SetMaxDynamicSharedMem(n); err != nil {
				return nil, err
			}
		}
		for _, w := range gqaWarps {
			if n := gqaSmem(hd, w); n > 48<<10 && n <= info.MaxSharedPerBlockOptin {
				for _, name := range []string{gqaName(hd, w, false), gqaName(hd, w, true), gqaPlanesName(hd, w)} {
					if err := fn[name].SetMaxDynamicSharedMem(n); err != nil {
						return nil, err
					}
				}
			}
		}
	}
	for _, nt := range gemvsNT {
		// The most any launch asks for: the largest split, raised as a
		// one-wave grid is (gemvsLaunchSmem).
		if n := min(gemvsLaunchSmem(nt, gemvsMaxKB, 1, 1, info.MaxSharedPerBlockOptin), info.MaxSharedPerBlockOptin); n > 48<<10 {
			if err := fn[gemvsName(nt)].SetMaxDynamicSharedMem(n); err != nil {
				return nil, err
			}
		}
	}
	if info.MaxSharedPerBlockOptin > 48<<10 {
		// gemvg and gemvh: as large as any k gemvgFits and gemvhFits admit.
		for _, name := range slices.Concat(gemvfNames, gemvgNames, gemvhNames) {
			if err := fn[name].SetMaxDynamicSharedMem(info.MaxSharedPerBlockOptin); err != nil {
				return nil, err
			}
		}
	}
	// The kernels of small steps (the fp32 products and decode attention)
	// prefer all of the unified L1 as shared memory, so that under
	// dependent launches one kernel's blocks can join the previous one's on
	// a multiprocessor: kernels of different carveouts cannot share one.
	// Measured on one H200: the 8B shape's batch-1 step 4.371 -> 4.323 ms
	// (1B 0.890 -> 0.881); all kernels so, batch 32 was slower (NOTES.md).
	for _, name := range slices.Concat(gemvfNames, gqaNames) {
		if err := fn[name].SetSharedCarveout(100); err != nil {
			return nil, err
		}
	}
	return fn, nil
}
