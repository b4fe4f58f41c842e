package cuda

import (
	"bytes"
	"crypto/sha256"
	"os"
	"path/filepath"
	"testing"
)

func TestCacheKey(t *testing.T) {
	base := cacheKey("src", "sm_90", "13.0", []string{"-a", "-b"})
	if len(base) != 64 {
		t.Fatalf("key %q: want 64 hex digits", base)
	}
	if again := cacheKey("src", "sm_90", "13.0", []string{"-a", "-b"}); again != base {
		t.Fatalf("same inputs gave %s and %s", base, again)
	}
	tests := []struct {
		name string
		key  string
	}{
		{"source", cacheKey("src2", "sm_90", "13.0", []string{"-a", "-b"})},
		{"arch", cacheKey("src", "sm_80", "13.0", []string{"-a", "-b"})},
		{"nvrtc version", cacheKey("src", "sm_90", "12.8", []string{"-a", "-b"})},
		{"options", cacheKey("src", "sm_90", "13.0", []string{"-a"})},
		{"option order", cacheKey("src", "sm_90", "13.0", []string{"-b", "-a"})},
		{"boundary shift", cacheKey("srcs", "m_90", "13.0", []string{"-a", "-b"})},
		{"options joined", cacheKey("src", "sm_90", "13.0", []string{"-a-b"})},
	}
	seen := map[string]string{base: "base"}
	for _, tc := range tests {
		if prev, dup := seen[tc.key]; dup {
			t.Errorf("%s: key equals the %s key", tc.name, prev)
		}
		seen[tc.key] = tc.name
	}
}

func TestCacheRoundTrip(t *testing.T) {
	c := kernelCache{dir: filepath.Join(t.TempDir(), "a", "b")}
	key := cacheKey("x", "sm_90", "13.0", nil)
	img, err := c.get(key)
	if err != nil || img != nil {
		t.Fatalf("get before put = %v, %v; want nil, nil", img, err)
	}
	want := []byte("\x7fELF some cubin bytes")
	if err := c.put(key, want); err != nil {
		t.Fatal(err)
	}
	got, err := c.get(key)
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("get = %q, %v; want %q", got, err, want)
	}
	// Overwriting replaces the image.
	want2 := []byte("another image")
	if err := c.put(key, want2); err != nil {
		t.Fatal(err)
	}
	if got, err := c.get(key); err != nil || !bytes.Equal(got, want2) {
		t.Fatalf("get after overwrite = %q, %v; want %q", got, err, want2)
	}
	ents, err := os.ReadDir(c.dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != 1 || ents[0].Name() != key+".cubin" {
		names := []string{}
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Fatalf("cache dir holds %v; want only %s.cubin (no temporary files)", names, key)
	}
}

func TestCacheCorrupt(t *testing.T) {
	img := []byte("a perfectly good kernel image")
	tests := []struct {
		name   string
		damage func([]byte) []byte
	}{
		{"flipped payload byte", func(b []byte) []byte { b[len(b)-1] ^= 1; return b }},
		{"flipped checksum byte", func(b []byte) []byte { b[len(cacheMagic)] ^= 1; return b }},
		{"truncated payload", func(b []byte) []byte { return b[:len(b)-3] }},
		{"truncated header", func(b []byte) []byte { return b[:10] }},
		{"empty file", func(b []byte) []byte { return nil }},
		{"wrong magic", func(b []byte) []byte { b[0] = 'X'; return b }},
		{"raw cubin without header", func([]byte) []byte { return img }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := kernelCache{dir: t.TempDir()}
			if err := c.put("k", img); err != nil {
				t.Fatal(err)
			}
			data, err := os.ReadFile(c.path("k"))
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(c.path("k"), tc.damage(data), 0o644); err != nil {
				t.Fatal(err)
			}
			got, err := c.get("k")
			if err == nil {
				t.Fatalf("get of a damaged file = %q, nil; want an error", got)
			}
			// A fresh put repairs the entry.
			if err := c.put("k", img); err != nil {
				t.Fatal(err)
			}
			if got, err := c.get("k"); err != nil || !bytes.Equal(got, img) {
				t.Fatalf("get after repair = %q, %v", got, err)
			}
		})
	}
}

func TestCachePutUnwritable(t *testing.T) {
	dir := t.TempDir()
	blocker := filepath.Join(dir, "file")
	if err := os.WriteFile(blocker, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	c := kernelCache{dir: filepath.Join(blocker, "kernels")}
	if err := c.put("k", []byte("x")); err == nil {
		t.Fatal("put under a regular file succeeded; want an error")
	}
}

// FuzzCacheGet feeds arbitrary file contents to the cache reader: it must
// never panic, and it returns an image only when the checksum holds.
func FuzzCacheGet(f *testing.F) {
	good := append([]byte{}, cacheMagic...)
	sum := sha256.Sum256([]byte("img"))
	good = append(good, sum[:]...)
	good = append(good, "img"...)
	f.Add(good)
	f.Add([]byte{})
	f.Add(cacheMagic)
	f.Add(append(append([]byte{}, cacheMagic...), make([]byte, 40)...))
	f.Fuzz(func(t *testing.T, data []byte) {
		c := kernelCache{dir: t.TempDir()}
		if err := os.WriteFile(c.path("k"), data, 0o644); err != nil {
			t.Fatal(err)
		}
		img, err := c.get("k")
		if err != nil {
			return
		}
		head := len(cacheMagic) + sha256.Size
		s := sha256.Sum256(img)
		if len(data) < head || !bytes.Equal(data[len(cacheMagic):head], s[:]) || !bytes.Equal(data[head:], img) {
			t.Fatalf("accepted a file whose checksum does not match its image")
		}
	})
}
