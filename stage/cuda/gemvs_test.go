package cuda

import "testing"

// TestGemvsSplit checks which products of which steps gemvs takes, and
// over which split of k, at the 1B and 8B shapes and at their edges.
func TestGemvsSplit(t *testing.T) {
	const smem, sms, maxTokens = 227 << 10, 132, 2048
	for _, c := range []struct {
		name                  string
		p                     smallProd
		tokens, lo, in, out   int
		smem, maxTokens, want int // want 0: cuBLAS
	}{
		{"1B qkv, 2 tokens (the tune's choice)", prodQKV, 2, 2, 2048, 3072, smem, maxTokens, 512},
		{"1B qkv, 3 tokens", prodQKV, 3, 3, 2048, 3072, smem, maxTokens, 512},
		{"1B qkv, 8 tokens", prodQKV, 8, 8, 2048, 3072, smem, maxTokens, 512},
		{"1B o, 8 tokens", prodO, 8, 8, 2048, 2048, smem, maxTokens, 512},
		{"1B o, 9 tokens", prodO, 9, 9, 2048, 2048, smem, maxTokens, 256},
		{"1B o, 16 tokens", prodO, 16, 16, 2048, 2048, smem, maxTokens, 256},
		{"1B qkv, 16 tokens", prodQKV, 16, 16, 2048, 3072, smem, maxTokens, 256},
		{"1B qkv, 17 compensated tokens: cuBLAS", prodQKV, 17, 17, 2048, 3072, smem, maxTokens, 0},
		{"8B qkv, 8 tokens", prodQKV, 8, 8, 4096, 6144, smem, maxTokens, 1024},
		{"8B o, 16 tokens: two bursts a split, cuBLAS", prodO, 16, 16, 4096, 4096, smem, maxTokens, 0},
		{"uncompensated, 5 tokens: one n-tile", prodO, 5, 0, 2048, 2048, smem, maxTokens, 512},
		{"uncompensated, 16 tokens", prodO, 16, 0, 2048, 2048, smem, maxTokens, 256},
		{"1B qkv, 17 plain tokens: 4 splits", prodQKV, 17, 0, 2048, 3072, smem, maxTokens, 512},
		{"1B qkv, 32 plain tokens", prodQKV, 32, 0, 2048, 3072, smem, maxTokens, 512},
		{"1B o, 17 plain tokens: 8 splits", prodO, 17, 0, 2048, 2048, smem, maxTokens, 256},
		{"1B o, 32 plain tokens", prodO, 32, 0, 2048, 2048, smem, maxTokens, 256},
		{"1B down, 2 compensated tokens: 4 splits", prodDown, 2, 2, 8192, 2048, smem, maxTokens, 2048},
		{"1B down, 8 compensated tokens", prodDown, 8, 8, 8192, 2048, smem, maxTokens, 2048},
		{"1B down, 9 compensated tokens: 8 splits", prodDown, 9, 9, 8192, 2048, smem, maxTokens, 1024},
		{"1B down, 16 compensated tokens", prodDown, 16, 16, 8192, 2048, smem, maxTokens, 1024},
		{"1B down, 32 plain tokens", prodDown, 32, 0, 8192, 2048, smem, maxTokens, 1024},
		{"1B down, 33 plain tokens: cuBLAS", prodDown, 33, 0, 8192, 2048, smem, maxTokens, 0},
		{"8B down, 8 tokens: splits of 3,584 k, cuBLAS", prodDown, 8, 8, 14336, 4096, smem, maxTokens, 0},
		{"8B down, 32 plain tokens: splits of 1,792 k, cuBLAS", prodDown, 32, 0, 14336, 4096, smem, maxTokens, 0},
		{"1B qkv, 33 plain tokens: cuBLAS", prodQKV, 33, 0, 2048, 3072, smem, maxTokens, 0},
		{"8B qkv, 17 plain tokens: 2 splits, 96 blocks", prodQKV, 17, 0, 4096, 6144, smem, maxTokens, 2048},
		{"8B qkv, 32 plain tokens", prodQKV, 32, 0, 4096, 6144, smem, maxTokens, 2048},
		{"8B o, 24 plain tokens: 4 splits, 128 blocks", prodO, 24, 0, 4096, 4096, smem, maxTokens, 1024},
		{"8B o, 32 plain tokens", prodO, 32, 0, 4096, 4096, smem, maxTokens, 1024},
		{"8B qkv, 32 plain tokens, a byte short of its 224 KB", prodQKV, 32, 0, 4096, 6144, 224<<10 - 1, maxTokens, 0},
		{"8B qkv, 32 plain tokens in 224 KB", prodQKV, 32, 0, 4096, 6144, 224 << 10, maxTokens, 2048},
		{"out of 16,384: 2 splits are 256 blocks, cuBLAS", prodO, 32, 0, 4096, 16384, smem, maxTokens, 0},
		{"1B qkv, 32 plain tokens, planes past the workspace", prodQKV, 32, 0, 2048, 3072, smem, 63, 0},
		{"1B qkv, 32 plain tokens, planes at the workspace's edge", prodQKV, 32, 0, 2048, 3072, smem, 64, 512},
		{"out not a multiple of 128", prodQKV, 8, 8, 2048, 2000, smem, maxTokens, 0},
		{"k not a multiple of 4 x 256", prodQKV, 8, 8, 1536, 2048, smem, maxTokens, 0},
		{"splits past 1024 k", prodQKV, 8, 8, 8192, 2048, smem, maxTokens, 0},
		{"too little shared memory", prodQKV, 8, 8, 4096, 4096, 32 << 10, maxTokens, 0},
		{"planes past the workspace", prodQKV, 8, 8, 2048, 2048, smem, 15, 0},
		{"planes at the workspace's edge", prodQKV, 8, 8, 2048, 2048, smem, 16, 512},
	} {
		kb, ok := gemvsSplit(c.p, c.tokens, c.lo, c.in, c.out, c.smem, sms, c.maxTokens)
		if got := map[bool]int{true: kb}[ok]; got != c.want || ok != (c.want != 0) {
			t.Errorf("%s: gemvsSplit = %d, %v; want %d", c.name, kb, ok, c.want)
		}
	}
}

func TestGemvgFits(t *testing.T) {
	const sms, smem = 132, 227 << 10
	for _, c := range []struct {
		name                      string
		tokens, lo, hidden, inter int
		sms, smem                 int
		want                      bool
	}{
		{"1B, 2 compensated tokens", 2, 2, 2048, 8192, sms, smem, true},
		{"1B, 8 compensated tokens: 16 staged rows", 8, 8, 2048, 8192, sms, smem, true},
		{"1B, 9 compensated tokens: 32 staged rows", 9, 9, 2048, 8192, sms, smem, true},
		{"1B, 16 compensated tokens", 16, 16, 2048, 8192, sms, smem, true},
		{"1B, 17 compensated tokens: 64 staged rows, cuBLAS", 17, 17, 2048, 8192, sms, smem, false},
		{"1B, 1 plain token", 1, 0, 2048, 8192, sms, smem, true},
		{"1B, 16 plain tokens", 16, 0, 2048, 8192, sms, smem, true},
		{"1B, 17 plain tokens", 17, 0, 2048, 8192, sms, smem, true},
		{"1B, 32 plain tokens: staged rows and rings, 224 of 227 KB", 32, 0, 2048, 8192, sms, smem, true},
		{"1B, 32 plain tokens, a byte short of its 224 KB", 32, 0, 2048, 8192, sms, 224<<10 - 1, false},
		{"1B, 32 plain tokens in 224 KB", 32, 0, 2048, 8192, sms, 224 << 10, true},
		{"1B, 33 plain tokens: cuBLAS", 33, 0, 2048, 8192, sms, smem, false},
		{"8B: 224 blocks, two waves", 8, 8, 4096, 14336, sms, smem, false},
		{"blocks of one wave at the edge", 8, 8, 2048, 64 * 132, sms, smem, true},
		{"a device of fewer multiprocessors", 8, 8, 2048, 8192, 114, smem, false},
		{"k not a multiple of 64", 8, 8, 2048 + 32, 8192, sms, smem, false},
		{"inter not a multiple of 64", 8, 8, 2048, 8192 - 32, sms, smem, false},
		{"too little shared memory", 8, 8, 2048, 8192, sms, 64 << 10, false},
	} {
		if got := gemvgFits(c.tokens, c.lo, c.hidden, c.inter, c.sms, c.smem); got != c.want {
			t.Errorf("%s: gemvgFits = %v, want %v", c.name, got, c.want)
		}
	}
}

// TestGemvsWaveSplits: the splits of a one-wave product follow the
// device's multiprocessors.
func TestGemvsWaveSplits(t *testing.T) {
	for _, c := range []struct{ out, sms, want int }{
		{2048, 132, 8},  // 1B o and down: 128 blocks
		{3072, 132, 4},  // 1B q|k|v: 96
		{4096, 132, 4},  // 8B o: 128
		{6144, 132, 2},  // 8B q|k|v: 96
		{2048, 114, 4},  // 1B o on 114 multiprocessors: 64 blocks
		{6144, 95, 0},   // 2 splits: 96 blocks on 95
		{16384, 132, 0}, // 2 splits: 256 blocks
	} {
		if got := gemvsWaveSplits(c.out, c.sms); got != c.want {
			t.Errorf("gemvsWaveSplits(%d, %d) = %d, want %d", c.out, c.sms, got, c.want)
		}
	}
}

// TestLaunchSmem: the shared memory gemvs and gemvg blocks are launched
// with keeps a one-wave gemvs grid to a block a multiprocessor, and gemvg
// of 32 staged rows alone on its multiprocessor (227 KB a block, 132
// multiprocessors: one H200).
func TestLaunchSmem(t *testing.T) {
	const sms, optin = 132, 227 << 10
	half := optin/2 + 1
	for _, c := range []struct {
		name                 string
		nt, kb, blocks, want int
	}{
		{"1B o, 32 tokens: 128 blocks of 112 KB, raised", 4, 256, 128, half},
		{"1B q|k|v, 8 compensated tokens: 96 blocks of 112 KB, raised", 2, 512, 96, half},
		{"1B down, 32 tokens: 160 KB already alone", 4, 1024, 128, gemvsSmem(4, 1024)},
		{"1B q|k|v, 16 compensated tokens: 192 blocks, two a multiprocessor", 4, 256, 192, gemvsSmem(4, 256)},
		{"one block a multiprocessor at the edge", 1, 512, sms, half},
	} {
		if got := gemvsLaunchSmem(c.nt, c.kb, c.blocks, sms, optin); got != c.want {
			t.Errorf("%s: gemvsLaunchSmem = %d, want %d", c.name, got, c.want)
		}
	}
	for _, c := range []struct {
		name     string
		nt, want int
	}{
		{"32 staged rows: all of it", 4, optin},
		{"16 staged rows: its own", 2, gemvgSmem(2, 2048)},
		{"8 staged rows: its own", 1, gemvgSmem(1, 2048)},
	} {
		if got := gemvgLaunchSmem(c.nt, 2048, optin); got != c.want {
			t.Errorf("gemvgLaunchSmem, %s = %d, want %d", c.name, got, c.want)
		}
	}
	if gemvsSmem(4, 256) > optin/2-(1<<10) {
		t.Errorf("gemvsSmem(4, 256) = %d: the raise is not what keeps two from a multiprocessor", gemvsSmem(4, 256))
	}
}
