package cuda

import "testing"

// TestGemvsSplit checks which products of which steps gemvs takes, and
// over which split of k, at the 1B and 8B shapes and at their edges.
func TestGemvsSplit(t *testing.T) {
	const smem, maxTokens = 227 << 10, 2048
	for _, c := range []struct {
		name                  string
		tokens, lo, in, out   int
		smem, maxTokens, want int // want 0: cuBLAS
	}{
		{"1B qkv, 2 tokens (the tune's choice)", 2, 2, 2048, 3072, smem, maxTokens, 512},
		{"1B qkv, 3 tokens", 3, 3, 2048, 3072, smem, maxTokens, 512},
		{"1B qkv, 8 tokens", 8, 8, 2048, 3072, smem, maxTokens, 512},
		{"1B o, 9 tokens", 9, 9, 2048, 2048, smem, maxTokens, 256},
		{"1B o, 16 tokens", 16, 16, 2048, 2048, smem, maxTokens, 256},
		{"1B qkv, 17 tokens: cuBLAS", 17, 17, 2048, 3072, smem, maxTokens, 0},
		{"8B qkv, 8 tokens", 8, 8, 4096, 6144, smem, maxTokens, 1024},
		{"8B o, 16 tokens: two bursts a split, cuBLAS", 16, 16, 4096, 4096, smem, maxTokens, 0},
		{"uncompensated, 5 tokens: one n-tile", 5, 0, 2048, 2048, smem, maxTokens, 512},
		{"uncompensated, 16 tokens", 16, 0, 2048, 2048, smem, maxTokens, 256},
		{"uncompensated, 32 tokens: cuBLAS", 32, 0, 2048, 2048, smem, maxTokens, 0},
		{"out not a multiple of 128", 8, 8, 2048, 2000, smem, maxTokens, 0},
		{"k not a multiple of 4 x 256", 8, 8, 1536, 2048, smem, maxTokens, 0},
		{"splits past 1024 k", 8, 8, 8192, 2048, smem, maxTokens, 0},
		{"too little shared memory", 8, 8, 4096, 4096, 32 << 10, maxTokens, 0},
		{"planes past the workspace", 8, 8, 2048, 2048, smem, 15, 0},
		{"planes at the workspace's edge", 8, 8, 2048, 2048, smem, 16, 512},
	} {
		kb, ok := gemvsSplit(c.tokens, c.lo, c.in, c.out, c.smem, c.maxTokens)
		if got := map[bool]int{true: kb}[ok]; got != c.want || ok != (c.want != 0) {
			t.Errorf("%s: gemvsSplit = %d, %v; want %d", c.name, kb, ok, c.want)
		}
	}
}
