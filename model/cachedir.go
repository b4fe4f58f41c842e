package model

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// CacheEnv names the variable whose value, when set, is the directory
// tandem caches what it derives from a model under: compiled CUDA kernels
// ("kernels") and weight digests ("weights").
const CacheEnv = "TANDEM_CACHE_DIR"

// CacheDir is the directory tandem caches one kind of derived file in
// (sub: "kernels", "weights"): $TANDEM_CACHE_DIR/sub, else the first
// directory of systemd's $CACHE_DIRECTORY (CacheDirectory= in the unit)
// followed by sub, else the user's cache directory's tandem/sub.
func CacheDir(sub string) (string, error) {
	if d := os.Getenv(CacheEnv); d != "" {
		return filepath.Join(d, sub), nil
	}
	if dirs := os.Getenv("CACHE_DIRECTORY"); dirs != "" {
		first, _, _ := strings.Cut(dirs, ":")
		return filepath.Join(first, sub), nil
	}
	d, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("%s cache directory: %w", sub, err)
	}
	return filepath.Join(d, "tandem", sub), nil
}
