package cuda

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

// cacheMagic opens every cached kernel image; the SHA-256 of the image
// follows it, so a truncated or damaged file is detected and recompiled.
var cacheMagic = []byte("TNDMKRN1")

// cacheKey identifies one compilation: the source, the target architecture,
// the NVRTC version and the options. Each part is length-prefixed so that no
// two different inputs hash the same bytes.
func cacheKey(src, arch, nvrtcVersion string, opts []string) string {
	h := sha256.New()
	put := func(s string) {
		var n [8]byte
		binary.LittleEndian.PutUint64(n[:], uint64(len(s)))
		h.Write(n[:])
		h.Write([]byte(s))
	}
	put(src)
	put(arch)
	put(nvrtcVersion)
	for _, o := range opts {
		put(o)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// kernelCache keeps compiled kernel images (CUBIN) on disk, one file per key.
type kernelCache struct {
	dir string
}

func (c kernelCache) path(key string) string {
	return filepath.Join(c.dir, key+".cubin")
}

// get returns the image stored under key. A missing file is (nil, nil); an
// unreadable or corrupt one is an error, which callers treat as a miss.
func (c kernelCache) get(key string) ([]byte, error) {
	p := c.path(key)
	data, err := os.ReadFile(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read kernel cache %s: %w", p, err)
	}
	head := len(cacheMagic) + sha256.Size
	if len(data) < head || !bytes.Equal(data[:len(cacheMagic)], cacheMagic) {
		return nil, fmt.Errorf("kernel cache %s: not a tandem kernel image", p)
	}
	img := data[head:]
	sum := sha256.Sum256(img)
	if !bytes.Equal(sum[:], data[len(cacheMagic):head]) {
		return nil, fmt.Errorf("kernel cache %s: checksum mismatch", p)
	}
	return img, nil
}

// put stores img under key atomically: a temporary file in the same
// directory, renamed into place, so readers never see a partial image.
func (c kernelCache) put(key string, img []byte) error {
	if err := os.MkdirAll(c.dir, 0o755); err != nil {
		return fmt.Errorf("create kernel cache %s: %w", c.dir, err)
	}
	f, err := os.CreateTemp(c.dir, key+".tmp*")
	if err != nil {
		return fmt.Errorf("create kernel cache file in %s: %w", c.dir, err)
	}
	sum := sha256.Sum256(img)
	var buf bytes.Buffer
	buf.Grow(len(cacheMagic) + len(sum) + len(img))
	buf.Write(cacheMagic)
	buf.Write(sum[:])
	buf.Write(img)
	_, werr := f.Write(buf.Bytes())
	cerr := f.Close()
	if werr == nil {
		werr = cerr
	}
	if werr == nil {
		werr = os.Rename(f.Name(), c.path(key))
	}
	if werr != nil {
		os.Remove(f.Name())
		return fmt.Errorf("write kernel cache %s: %w", c.path(key), werr)
	}
	return nil
}
