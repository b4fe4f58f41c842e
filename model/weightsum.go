package model

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"sync"
)

// Weight files are identified by the SHA-256 of their bytes, computed once
// per file and cached by path, size and modification time, so a restart
// with the same files reads nothing. A file's digest is a tree of SHA-256:
// the hash of the digests of its hashChunk-byte chunks, hashed in parallel,
// so one large file is hashed at the speed of several cores.

// hashChunk is the size of the chunks a weight file is hashed in.
const hashChunk = 64 << 20

// hashCacheDir is the directory digests are cached in ("" for none):
// CacheDir("weights").
func hashCacheDir() string {
	d, err := CacheDir("weights")
	if err != nil {
		return ""
	}
	return d
}

// digestEntry is one cached digest: the file it is of and the size and
// modification time the file had when it was hashed.
type digestEntry struct {
	Path    string `json:"path"`
	Size    int64  `json:"size"`
	MtimeNs int64  `json:"mtime_ns"`
	SHA256  string `json:"sha256"`
}

// fileDigest returns the digest of the file at path, from the cache in
// cacheDir when an entry matches the file's absolute path, size and
// modification time, else by hashing it (and then caching it). A cache
// that cannot be read or written is ignored: it only saves time.
func fileDigest(path, cacheDir string) ([]byte, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, fmt.Errorf("hash %s: %w", path, err)
	}
	st, err := os.Stat(abs)
	if err != nil {
		return nil, fmt.Errorf("hash %s: %w", path, err)
	}
	key := sha256.Sum256([]byte(abs))
	entryPath := ""
	if cacheDir != "" {
		entryPath = filepath.Join(cacheDir, hex.EncodeToString(key[:16])+".json")
		if d, ok := cachedDigest(entryPath, abs, st); ok {
			return d, nil
		}
	}
	d, err := hashFile(abs, st.Size())
	if err != nil {
		return nil, fmt.Errorf("hash %s: %w", path, err)
	}
	if entryPath != "" {
		// Cache only a file that did not change while it was hashed.
		if after, err := os.Stat(abs); err == nil && after.Size() == st.Size() && after.ModTime().Equal(st.ModTime()) {
			writeDigest(entryPath, digestEntry{Path: abs, Size: st.Size(), MtimeNs: st.ModTime().UnixNano(), SHA256: hex.EncodeToString(d)})
		}
	}
	return d, nil
}

// cachedDigest reads the cache entry at entryPath and returns its digest if
// it is of the file abs as st describes it.
func cachedDigest(entryPath, abs string, st os.FileInfo) ([]byte, bool) {
	b, err := os.ReadFile(entryPath)
	if err != nil {
		return nil, false
	}
	var e digestEntry
	if json.Unmarshal(b, &e) != nil || e.Path != abs || e.Size != st.Size() || e.MtimeNs != st.ModTime().UnixNano() {
		return nil, false
	}
	d, err := hex.DecodeString(e.SHA256)
	if err != nil || len(d) != sha256.Size {
		return nil, false
	}
	return d, true
}

// writeDigest writes a cache entry atomically (a temporary file renamed
// over it), readable by the owner only. Errors are ignored.
func writeDigest(entryPath string, e digestEntry) {
	b, err := json.Marshal(e)
	if err != nil {
		return
	}
	dir := filepath.Dir(entryPath)
	if os.MkdirAll(dir, 0o700) != nil {
		return
	}
	f, err := os.CreateTemp(dir, ".digest-*")
	if err != nil {
		return
	}
	_, werr := f.Write(b)
	cerr := f.Close()
	if werr != nil || cerr != nil || os.Rename(f.Name(), entryPath) != nil {
		os.Remove(f.Name())
	}
	pruneDigests(dir)
}

// maxDigests is how many entries the cache holds before pruneDigests drops
// those of files that are gone or changed.
const maxDigests = 256

// pruneDigests removes, once the cache holds more than maxDigests entries,
// every entry whose file no longer exists with the size and time it
// records (checkpoints deleted, moved or rewritten).
func pruneDigests(dir string) {
	names, err := filepath.Glob(filepath.Join(dir, "*.json"))
	if err != nil || len(names) <= maxDigests {
		return
	}
	for _, name := range names {
		b, err := os.ReadFile(name)
		if err != nil {
			continue
		}
		var e digestEntry
		if json.Unmarshal(b, &e) == nil {
			if st, err := os.Stat(e.Path); err == nil && st.Size() == e.Size && st.ModTime().UnixNano() == e.MtimeNs {
				continue
			}
		}
		os.Remove(name)
	}
}

// hashFile hashes the size bytes of the file at path: the SHA-256 of its
// size and of the SHA-256 of each hashChunk-byte chunk, in order, the
// chunks hashed by up to GOMAXPROCS goroutines.
func hashFile(path string, size int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	n := int((size + hashChunk - 1) / hashChunk)
	sums := make([][sha256.Size]byte, n)
	errs := make([]error, n)
	next := make(chan int)
	var wg sync.WaitGroup
	for range min(runtime.GOMAXPROCS(0), max(n, 1)) {
		wg.Go(func() {
			buf := make([]byte, 1<<20)
			for i := range next {
				h := sha256.New()
				off := int64(i) * hashChunk
				r := io.NewSectionReader(f, off, min(hashChunk, size-off))
				k, err := io.CopyBuffer(h, r, buf)
				if err == nil && k != min(hashChunk, size-off) {
					err = io.ErrUnexpectedEOF
				}
				errs[i] = err
				h.Sum(sums[i][:0])
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	h := sha256.New()
	h.Write(binary.LittleEndian.AppendUint64(nil, uint64(size)))
	for i := range sums {
		h.Write(sums[i][:])
	}
	return h.Sum(nil), nil
}
