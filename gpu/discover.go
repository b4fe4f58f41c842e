package gpu

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
)

// Config says where to find the CUDA libraries. Empty fields fall back to
// the environment (TANDEM_LIBCUDA, TANDEM_NVRTC, TANDEM_CUBLAS,
// TANDEM_CUBLASLT, TANDEM_NCCL, TANDEM_CUDA_LIBDIR), then to the search
// described in doc.go.
type Config struct {
	// LibCUDA, NVRTC, CUBLAS, CUBLASLt and NCCL are explicit paths of the
	// driver library, libnvrtc, libcublas, libcublasLt and libnccl. An
	// explicit path that fails to load is an error; there is no fallback.
	LibCUDA, NVRTC, CUBLAS, CUBLASLt, NCCL string
	// LibDir is a directory searched first for every library but the
	// driver.
	LibDir string
}

// soname is one file name a library is known by, with the files that must be
// loaded globally from the same directory before it (glob patterns).
type soname struct {
	file    string
	preload []string
}

// libSpec describes how to find one library.
type libSpec struct {
	what     string // for messages: "CUDA driver", "NVRTC", ...
	env      string // explicit-path environment variable
	explicit func(Config) string
	// preloadEnv and preloadCfg name an explicit path that replaces the
	// preload search (cuBLASLt).
	preloadEnv string
	preloadCfg func(Config) string
	driver     bool // the driver: LibDir does not apply
	names      []soname
	wheels     []string // subdirectories of site-packages/nvidia holding it
	toolkit    bool     // also searched in CUDA toolkit directories
	sysDirs    []string // further directories (the driver's)
}

var (
	specCUDA = libSpec{
		what:     "CUDA driver",
		env:      "TANDEM_LIBCUDA",
		explicit: func(c Config) string { return c.LibCUDA },
		driver:   true,
		names:    []soname{{file: "libcuda.so.1"}},
		// The toolkit's compat/ directory holds an older libcuda that
		// must not shadow the installed driver, so toolkit and wheel
		// directories are never searched for it.
		sysDirs: []string{"/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/local/nvidia/lib64", "/usr/lib/wsl/lib"},
	}
	specNVRTC = libSpec{
		what:     "NVRTC",
		env:      "TANDEM_NVRTC",
		explicit: func(c Config) string { return c.NVRTC },
		names: []soname{
			{file: "libnvrtc.so.13", preload: []string{"libnvrtc-builtins.so.13.*"}},
			{file: "libnvrtc.so.12", preload: []string{"libnvrtc-builtins.so.12.*"}},
		},
		wheels:  []string{"cu13/lib", "cuda_nvrtc/lib"},
		toolkit: true,
	}
	specCUBLAS = libSpec{
		what:       "cuBLAS",
		env:        "TANDEM_CUBLAS",
		explicit:   func(c Config) string { return c.CUBLAS },
		preloadEnv: "TANDEM_CUBLASLT",
		preloadCfg: func(c Config) string { return c.CUBLASLt },
		names: []soname{
			{file: "libcublas.so.13", preload: []string{"libcublasLt.so.13"}},
			{file: "libcublas.so.12", preload: []string{"libcublasLt.so.12"}},
		},
		wheels:  []string{"cu13/lib", "cublas/lib"},
		toolkit: true,
	}
	specNCCL = libSpec{
		what:     "NCCL",
		env:      "TANDEM_NCCL",
		explicit: func(c Config) string { return c.NCCL },
		names:    []soname{{file: "libnccl.so.2"}},
		wheels:   []string{"nccl/lib", "cu13/lib"},
		toolkit:  true,
		sysDirs:  []string{"/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64"},
	}
)

// loader finds and opens libraries. Its fields are the outside world, so
// that tests can replace them.
type loader struct {
	cfg    Config
	getenv func(string) string
	glob   func(string) ([]string, error)
	exists func(string) bool
	open   func(path string, global bool) (library, error)
}

func newLoader(cfg Config) *loader {
	return &loader{
		cfg:    cfg,
		getenv: os.Getenv,
		glob:   filepath.Glob,
		exists: func(p string) bool {
			fi, err := os.Stat(p)
			return err == nil && !fi.IsDir()
		},
		open: dlopenLibrary,
	}
}

// errNotFound marks a library that no search step found.
var errNotFound = errors.New("not found")

// explicitPath is the configured path for spec, if any.
func (l *loader) explicitPath(spec libSpec) string {
	if p := spec.explicit(l.cfg); p != "" {
		return p
	}
	return l.getenv(spec.env)
}

// load finds spec's library and opens it. It returns the library, the path
// (or soname) it was opened by, and the libraries preloaded for it, which
// must stay open as long as it does.
func (l *loader) load(spec libSpec) (library, string, []library, error) {
	if p := l.explicitPath(spec); p != "" {
		pre, err := l.preload(spec, filepath.Dir(p), l.preloadsFor(spec, filepath.Base(p)))
		if err != nil {
			return nil, "", nil, fmt.Errorf("%s from %s: %w", spec.what, p, err)
		}
		lib, err := l.open(p, false)
		if err != nil {
			closeAll(pre)
			return nil, "", nil, fmt.Errorf("%s from %s (explicit path): %w", spec.what, p, err)
		}
		l.logLoaded(spec, p, "explicit path")
		return lib, p, pre, nil
	}
	var searched []string
	tryDirs := func(dirs []string, how string) (library, string, []library, error) {
		for _, d := range dirs {
			searched = append(searched, d)
			for _, n := range spec.names {
				p := filepath.Join(d, n.file)
				if !l.exists(p) {
					continue
				}
				pre, err := l.preload(spec, d, n.preload)
				if err != nil {
					return nil, "", nil, fmt.Errorf("%s in %s: %w", spec.what, d, err)
				}
				lib, err := l.open(p, false)
				if err != nil {
					closeAll(pre)
					return nil, "", nil, fmt.Errorf("%s: %w", spec.what, err)
				}
				l.logLoaded(spec, p, how)
				return lib, p, pre, nil
			}
		}
		return nil, "", nil, nil
	}
	if !spec.driver {
		if d := l.libDir(); d != "" {
			if lib, p, pre, err := tryDirs([]string{d}, "library directory"); lib != nil || err != nil {
				return lib, p, pre, err
			}
		}
	}
	// The dynamic loader's own search (LD_LIBRARY_PATH, the ld cache):
	// it resolves the preloads itself through the library's DT_NEEDED.
	for _, n := range spec.names {
		searched = append(searched, "loader:"+n.file)
		if lib, err := l.open(n.file, false); err == nil {
			l.logLoaded(spec, n.file, "dynamic loader search")
			return lib, n.file, nil, nil
		}
	}
	var dirs []string
	if spec.toolkit {
		dirs = append(dirs, l.toolkitDirs()...)
	}
	dirs = append(dirs, spec.sysDirs...)
	if len(spec.wheels) > 0 {
		dirs = append(dirs, l.wheelDirs(spec.wheels)...)
	}
	if lib, p, pre, err := tryDirs(dirs, "search"); lib != nil || err != nil {
		return lib, p, pre, err
	}
	var files []string
	for _, n := range spec.names {
		files = append(files, n.file)
	}
	return nil, "", nil, fmt.Errorf("%s %w (searched %s)", strings.Join(files, " or "), errNotFound, strings.Join(searched, ", "))
}

func (l *loader) logLoaded(spec libSpec, path, how string) {
	slog.Info("gpu: loaded library", "lib", spec.what, "path", path, "found_by", how)
}

// libDir is the configured library directory, if any.
func (l *loader) libDir() string {
	if l.cfg.LibDir != "" {
		return l.cfg.LibDir
	}
	return l.getenv("TANDEM_CUDA_LIBDIR")
}

// preloadsFor is the preload list of the soname whose file is base, if it is
// one of spec's.
func (l *loader) preloadsFor(spec libSpec, base string) []string {
	for _, n := range spec.names {
		if n.file == base {
			return n.preload
		}
	}
	return nil
}

// preload opens, with RTLD_GLOBAL, the files matching patterns in dir. An
// explicit preload path (TANDEM_CUBLASLT, Config.CUBLASLt) replaces the
// search in dir. A pattern that matches nothing is skipped:
// the library may find its dependency itself.
func (l *loader) preload(spec libSpec, dir string, patterns []string) ([]library, error) {
	var libs []library
	if spec.preloadCfg != nil {
		p := spec.preloadCfg(l.cfg)
		if p == "" {
			p = l.getenv(spec.preloadEnv)
		}
		if p != "" {
			lib, err := l.open(p, true)
			if err != nil {
				return nil, fmt.Errorf("preload %s: %w", p, err)
			}
			return []library{lib}, nil
		}
	}
	for _, pat := range patterns {
		matches, _ := l.glob(filepath.Join(dir, pat))
		if len(matches) == 0 {
			continue
		}
		sort.Strings(matches)
		p := matches[len(matches)-1]
		lib, err := l.open(p, true)
		if err != nil {
			closeAll(libs)
			return nil, fmt.Errorf("preload %s: %w", p, err)
		}
		libs = append(libs, lib)
	}
	return libs, nil
}

func closeAll(libs []library) {
	for _, l := range libs {
		l.Close()
	}
}

// toolkitDirs lists CUDA toolkit library directories: $CUDA_HOME,
// $CUDA_PATH, /usr/local/cuda, then /usr/local/cuda-X.Y newest first.
func (l *loader) toolkitDirs() []string {
	target := "x86_64-linux"
	if runtime.GOARCH == "arm64" {
		target = "sbsa-linux"
	}
	var roots []string
	for _, env := range []string{"CUDA_HOME", "CUDA_PATH"} {
		if r := l.getenv(env); r != "" {
			roots = append(roots, r)
		}
	}
	roots = append(roots, "/usr/local/cuda")
	versioned, _ := l.glob("/usr/local/cuda-*")
	sort.Slice(versioned, func(i, j int) bool {
		return versionLess(versioned[j], versioned[i])
	})
	roots = append(roots, versioned...)
	var dirs []string
	seen := map[string]bool{}
	for _, r := range roots {
		for _, d := range []string{filepath.Join(r, "lib64"), filepath.Join(r, "targets", target, "lib")} {
			if !seen[d] {
				seen[d] = true
				dirs = append(dirs, d)
			}
		}
	}
	return dirs
}

// versionLess orders /usr/local/cuda-X.Y paths by their numeric version.
func versionLess(a, b string) bool {
	va, vb := versionOf(a), versionOf(b)
	for i := 0; i < len(va) && i < len(vb); i++ {
		if va[i] != vb[i] {
			return va[i] < vb[i]
		}
	}
	if len(va) != len(vb) {
		return len(va) < len(vb)
	}
	return a < b
}

func versionOf(p string) []int {
	_, v, _ := strings.Cut(filepath.Base(p), "-")
	var out []int
	for _, f := range strings.Split(v, ".") {
		n, err := strconv.Atoi(f)
		if err != nil {
			break
		}
		out = append(out, n)
	}
	return out
}

// wheelDirs lists the lib directories of NVIDIA's pip wheels under every
// site-packages that may hold them.
func (l *loader) wheelDirs(subdirs []string) []string {
	var sites []string
	patterns := []string{}
	if v := l.getenv("VIRTUAL_ENV"); v != "" {
		patterns = append(patterns, filepath.Join(v, "lib", "python3*", "site-packages"))
	}
	patterns = append(patterns,
		"/opt/torch/.venv/lib/python3*/site-packages",
		"/usr/local/lib/python3*/dist-packages",
		"/usr/local/lib/python3*/site-packages",
		"/usr/lib/python3/dist-packages",
	)
	if h := l.getenv("HOME"); h != "" {
		patterns = append(patterns, filepath.Join(h, ".local", "lib", "python3*", "site-packages"))
	}
	for _, pat := range patterns {
		m, _ := l.glob(pat)
		sort.Sort(sort.Reverse(sort.StringSlice(m)))
		sites = append(sites, m...)
	}
	var dirs []string
	for _, s := range sites {
		for _, sub := range subdirs {
			dirs = append(dirs, filepath.Join(s, "nvidia", sub))
		}
	}
	return dirs
}
