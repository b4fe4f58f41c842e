package model_test

import (
	"path/filepath"
	"testing"

	"github.com/tandem-llm/tandem/model"
)

// TestCacheDir checks the order the cache directory is chosen in:
// $TANDEM_CACHE_DIR, systemd's $CACHE_DIRECTORY (its first entry), the
// user's cache directory.
func TestCacheDir(t *testing.T) {
	for _, tc := range []struct{ tandem, systemd, xdg, want string }{
		{"/t", "/s", "/x", filepath.Join("/t", "kernels")},
		{"", "/var/cache/tandem:/other", "/x", filepath.Join("/var/cache/tandem", "kernels")},
		{"", "", "/x", filepath.Join("/x", "tandem", "kernels")},
	} {
		t.Setenv(model.CacheEnv, tc.tandem)
		t.Setenv("CACHE_DIRECTORY", tc.systemd)
		t.Setenv("XDG_CACHE_HOME", tc.xdg)
		t.Setenv("HOME", "/home/u")
		if got, err := model.CacheDir("kernels"); err != nil || got != tc.want {
			t.Errorf("%+v: CacheDir = %q, %v; want %q", tc, got, err, tc.want)
		}
	}
}
