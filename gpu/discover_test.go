package gpu

import (
	"errors"
	"path/filepath"
	"strings"
	"testing"
)

// fakeLib is a library with a fixed symbol table.
type fakeLib struct {
	path string
	syms map[string]uintptr
}

func (f *fakeLib) Lookup(sym string) (uintptr, error) {
	if a, ok := f.syms[sym]; ok {
		return a, nil
	}
	return 0, errors.New("undefined symbol: " + sym)
}

func (f *fakeLib) Close() error { return nil }

// fakeWorld is a filesystem, environment and dynamic loader for discovery
// tests. Files in files exist; sonames in ldcache open by plain name.
type fakeWorld struct {
	env     map[string]string
	files   []string
	ldcache map[string]bool
	opened  []string // "path" or "path (global)" in order
}

func (w *fakeWorld) loader(cfg Config) *loader {
	return &loader{
		cfg:    cfg,
		getenv: func(k string) string { return w.env[k] },
		glob: func(pat string) ([]string, error) {
			var out []string
			for _, f := range w.files {
				for d := f; d != "/" && d != "."; d = filepath.Dir(d) {
					if ok, _ := filepath.Match(pat, d); ok {
						out = append(out, d)
					}
				}
			}
			return dedup(out), nil
		},
		exists: func(p string) bool {
			for _, f := range w.files {
				if f == p {
					return true
				}
			}
			return false
		},
		open: func(p string, global bool) (library, error) {
			if global {
				w.opened = append(w.opened, p+" (global)")
			} else {
				w.opened = append(w.opened, p)
			}
			if !strings.Contains(p, "/") {
				if w.ldcache[p] {
					return &fakeLib{path: p}, nil
				}
				return nil, errors.New(p + ": cannot open shared object file")
			}
			if w.exists(p) {
				return &fakeLib{path: p}, nil
			}
			return nil, errors.New(p + ": no such file")
		},
	}
}

func (w *fakeWorld) exists(p string) bool {
	for _, f := range w.files {
		if f == p {
			return true
		}
	}
	return false
}

func dedup(s []string) []string {
	seen := map[string]bool{}
	var out []string
	for _, x := range s {
		if !seen[x] {
			seen[x] = true
			out = append(out, x)
		}
	}
	return out
}

func TestDiscovery(t *testing.T) {
	const wheel = "/opt/torch/.venv/lib/python3.12/site-packages/nvidia"
	tests := []struct {
		name    string
		spec    libSpec
		cfg     Config
		world   fakeWorld
		want    string   // path the library is loaded from
		opened  []string // every open attempt, in order; nil: not checked
		wantErr string   // substring of the error
	}{
		{
			name:  "config path beats environment and search",
			spec:  specNVRTC,
			cfg:   Config{NVRTC: "/opt/a/libnvrtc.so.13"},
			world: fakeWorld{env: map[string]string{"TANDEM_NVRTC": "/opt/b/libnvrtc.so.13"}, files: []string{"/opt/a/libnvrtc.so.13", "/opt/a/libnvrtc-builtins.so.13.0", "/opt/b/libnvrtc.so.13"}, ldcache: map[string]bool{"libnvrtc.so.13": true}},
			want:  "/opt/a/libnvrtc.so.13",
			// The builtins beside an explicit libnvrtc are preloaded.
			opened: []string{"/opt/a/libnvrtc-builtins.so.13.0 (global)", "/opt/a/libnvrtc.so.13"},
		},
		{
			name:   "environment path",
			spec:   specNCCL,
			world:  fakeWorld{env: map[string]string{"TANDEM_NCCL": "/x/libnccl.so.2"}, files: []string{"/x/libnccl.so.2"}, ldcache: map[string]bool{"libnccl.so.2": true}},
			want:   "/x/libnccl.so.2",
			opened: []string{"/x/libnccl.so.2"},
		},
		{
			name:    "explicit path that fails is final",
			spec:    specCUDA,
			world:   fakeWorld{env: map[string]string{"TANDEM_LIBCUDA": "/nope/libcuda.so.1"}, ldcache: map[string]bool{"libcuda.so.1": true}},
			opened:  []string{"/nope/libcuda.so.1"},
			wantErr: "/nope/libcuda.so.1 (explicit path)",
		},
		{
			name:   "library directory before the loader",
			spec:   specCUBLAS,
			world:  fakeWorld{env: map[string]string{"TANDEM_CUDA_LIBDIR": "/lib/cu"}, files: []string{"/lib/cu/libcublas.so.13", "/lib/cu/libcublasLt.so.13"}, ldcache: map[string]bool{"libcublas.so.13": true}},
			want:   "/lib/cu/libcublas.so.13",
			opened: []string{"/lib/cu/libcublasLt.so.13 (global)", "/lib/cu/libcublas.so.13"},
		},
		{
			name:   "library directory does not apply to the driver",
			spec:   specCUDA,
			world:  fakeWorld{env: map[string]string{"TANDEM_CUDA_LIBDIR": "/lib/cu"}, files: []string{"/lib/cu/libcuda.so.1"}, ldcache: map[string]bool{"libcuda.so.1": true}},
			want:   "libcuda.so.1",
			opened: []string{"libcuda.so.1"},
		},
		{
			name:   "loader before toolkit directories",
			spec:   specNVRTC,
			world:  fakeWorld{env: map[string]string{"CUDA_HOME": "/usr/local/cuda-13.0"}, files: []string{"/usr/local/cuda-13.0/lib64/libnvrtc.so.13"}, ldcache: map[string]bool{"libnvrtc.so.13": true}},
			want:   "libnvrtc.so.13",
			opened: []string{"libnvrtc.so.13"},
		},
		{
			name: "CUDA_HOME targets directory with builtins preloaded",
			spec: specNVRTC,
			world: fakeWorld{env: map[string]string{"CUDA_HOME": "/opt/cuda"}, files: []string{
				"/opt/cuda/targets/x86_64-linux/lib/libnvrtc.so.13",
				"/opt/cuda/targets/x86_64-linux/lib/libnvrtc-builtins.so.13.0",
				"/usr/local/cuda/lib64/libnvrtc.so.13",
			}},
			want:   "/opt/cuda/targets/x86_64-linux/lib/libnvrtc.so.13",
			opened: []string{"libnvrtc.so.13", "libnvrtc.so.12", "/opt/cuda/targets/x86_64-linux/lib/libnvrtc-builtins.so.13.0 (global)", "/opt/cuda/targets/x86_64-linux/lib/libnvrtc.so.13"},
		},
		{
			name: "newest versioned toolkit first",
			spec: specCUBLAS,
			world: fakeWorld{files: []string{
				"/usr/local/cuda-12.9/lib64/libcublas.so.12",
				"/usr/local/cuda-12.10/lib64/libcublas.so.12",
				"/usr/local/cuda-12.10/lib64/libcublasLt.so.12",
			}},
			want: "/usr/local/cuda-12.10/lib64/libcublas.so.12",
		},
		{
			name: "newer soname preferred within a directory",
			spec: specCUBLAS,
			world: fakeWorld{files: []string{
				"/usr/local/cuda/lib64/libcublas.so.12",
				"/usr/local/cuda/lib64/libcublas.so.13",
				"/usr/local/cuda/lib64/libcublasLt.so.13",
			}},
			want: "/usr/local/cuda/lib64/libcublas.so.13",
		},
		{
			name:   "pip wheel directory, cuBLASLt preloaded",
			spec:   specCUBLAS,
			world:  fakeWorld{files: []string{wheel + "/cu13/lib/libcublas.so.13", wheel + "/cu13/lib/libcublasLt.so.13"}},
			want:   wheel + "/cu13/lib/libcublas.so.13",
			opened: []string{"libcublas.so.13", "libcublas.so.12", wheel + "/cu13/lib/libcublasLt.so.13 (global)", wheel + "/cu13/lib/libcublas.so.13"},
		},
		{
			name:  "explicit cuBLASLt replaces the preload search",
			spec:  specCUBLAS,
			cfg:   Config{CUBLASLt: "/lt/libcublasLt.so.13"},
			world: fakeWorld{files: []string{"/lt/libcublasLt.so.13", "/usr/local/cuda/lib64/libcublas.so.13", "/usr/local/cuda/lib64/libcublasLt.so.13"}},
			want:  "/usr/local/cuda/lib64/libcublas.so.13",
		},
		{
			name:  "NCCL pip wheel",
			spec:  specNCCL,
			world: fakeWorld{files: []string{wheel + "/nccl/lib/libnccl.so.2"}},
			want:  wheel + "/nccl/lib/libnccl.so.2",
		},
		{
			name:    "driver never from the toolkit's compat directory",
			spec:    specCUDA,
			world:   fakeWorld{env: map[string]string{"CUDA_HOME": "/usr/local/cuda-13.0"}, files: []string{"/usr/local/cuda-13.0/compat/libcuda.so.1", "/usr/local/cuda-13.0/lib64/libcuda.so.1"}},
			wantErr: "libcuda.so.1 not found (searched loader:libcuda.so.1, /usr/lib/x86_64-linux-gnu",
		},
		{
			name:  "driver from the driver directories",
			spec:  specCUDA,
			world: fakeWorld{files: []string{"/usr/local/nvidia/lib64/libcuda.so.1"}},
			want:  "/usr/local/nvidia/lib64/libcuda.so.1",
		},
		{
			name:    "not found lists the search",
			spec:    specNVRTC,
			world:   fakeWorld{env: map[string]string{"CUDA_HOME": "/opt/cuda"}},
			wantErr: "libnvrtc.so.13 or libnvrtc.so.12 not found (searched loader:libnvrtc.so.13, loader:libnvrtc.so.12, /opt/cuda/lib64, /opt/cuda/targets/x86_64-linux/lib, /usr/local/cuda/lib64",
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			w := tc.world
			lib, path, _, err := w.loader(tc.cfg).load(tc.spec)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err = %v, want it to contain %q", err, tc.wantErr)
				}
			} else if err != nil {
				t.Fatalf("load: %v", err)
			} else if path != tc.want || lib.(*fakeLib).path != tc.want {
				t.Fatalf("loaded %q, want %q (opened %q)", path, tc.want, w.opened)
			}
			if tc.opened != nil && strings.Join(w.opened, "|") != strings.Join(tc.opened, "|") {
				t.Fatalf("opened %q, want %q", w.opened, tc.opened)
			}
		})
	}
}

func TestInitNoDriver(t *testing.T) {
	resetState(t)
	w := fakeWorld{}
	err := initWith(w.loader(Config{}))
	if !errors.Is(err, ErrNoDriver) {
		t.Fatalf("err = %v, want ErrNoDriver", err)
	}
	if !strings.HasPrefix(err.Error(), "no CUDA driver: libcuda.so.1 not found (searched loader:libcuda.so.1, ") {
		t.Fatalf("message %q does not say what was searched", err)
	}
	if err2 := Init(Config{LibCUDA: "/elsewhere"}); err2 != err {
		t.Fatalf("second Init = %v, want the first result", err2)
	}
	if _, err := DeviceCount(); !errors.Is(err, ErrNotInitialized) {
		t.Fatalf("DeviceCount after failed Init: %v", err)
	}
	if _, err := Compile("", "x"); !errors.Is(err, ErrNoDriver) {
		t.Fatalf("Compile after failed Init: %v", err)
	}
}

func TestVersionOrder(t *testing.T) {
	tests := []struct {
		a, b string
		less bool
	}{
		{"/usr/local/cuda-12.9", "/usr/local/cuda-12.10", true},
		{"/usr/local/cuda-12.10", "/usr/local/cuda-13.0", true},
		{"/usr/local/cuda-13.0", "/usr/local/cuda-12.8", false},
		{"/usr/local/cuda-13", "/usr/local/cuda-13.0", true},
	}
	for _, tc := range tests {
		if got := versionLess(tc.a, tc.b); got != tc.less {
			t.Errorf("versionLess(%s, %s) = %v, want %v", tc.a, tc.b, got, tc.less)
		}
	}
}
