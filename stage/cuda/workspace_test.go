package cuda

import (
	"slices"
	"testing"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/stage/stagetest"
)

// TestWorkspaceBytes: the estimate placement uses covers the workspace of
// a stage in every place of the pipeline, and every buffer lies inside it.
func TestWorkspaceBytes(t *testing.T) {
	for _, sh := range append(stagetest.Shapes(), stagetest.Shape{Name: "llama1b", Model: *llama1B()}) {
		m := sh.Model
		cfg := Config{Model: &m, MaxTokens: 48, MaxSeqs: 5}
		est, err := WorkspaceBytes(cfg)
		if err != nil {
			t.Fatalf("%s: %v", sh.Name, err)
		}
		cfg.Lo, cfg.Hi = 0, m.NumLayers
		if err := checkConfig(&cfg); err != nil {
			t.Fatal(err)
		}
		lay := newLayout(&cfg)
		for _, skinny := range []int{0, -1, 32} {
			sk := planSkinny(&m, skinny, true, smemOptinDefault)
			sk.widen(skinny)
			for _, pl := range []struct{ first, last bool }{{true, true}, {true, false}, {false, false}, {false, true}} {
				w := planWorkspace(&m, lay, pl.first, pl.last, &sk, newAttnPlan(&m, smsEstimate))
				if int64(w.size) > est {
					t.Errorf("%s (first %v, last %v, skinny %d): %d bytes, estimate %d", sh.Name, pl.first, pl.last, skinny, w.size, est)
				}
				for _, off := range []int{w.in, w.resid, w.q, w.normed, w.qkv, w.attnB, w.y, w.gateUp, w.act, w.attnF, w.actF,
					w.logits, w.stats, w.sampleOut, w.hoOut, w.hoIn, w.hoTokens, w.batch, w.invFreq, w.part, w.partML, w.counts,
					w.gtPart, w.gtCounts, w.blas} {
					if off >= w.size || off%256 != 0 && off != -1 {
						t.Errorf("%s: offset %d outside %d bytes or unaligned", sh.Name, off, w.size)
					}
				}
				// A first and last stage's status words end where the
				// sampler's output begins (one copy reads both back).
				switch {
				case pl.first && pl.last && w.status != w.sampleOut-statusWords*4:
					t.Errorf("%s: status at %d, sampler's output at %d: not adjacent", sh.Name, w.status, w.sampleOut)
				case pl.first && (w.status < 0 || w.status >= w.size || w.status%16 != 0):
					t.Errorf("%s: status at %d of %d bytes, or not 16-byte aligned", sh.Name, w.status, w.size)
				case !pl.first && w.status != -1:
					t.Errorf("%s: a stage that is not first has a status array at %d", sh.Name, w.status)
				}
			}
		}
	}
}

// TestPlanSkinny: which models the skinny kernels take, and the row
// mapping of their products.
func TestPlanSkinny(t *testing.T) {
	m := *llama1B()
	p := planSkinny(&m, 0, true, smemOptinDefault)
	if p.maxTokens != 8 || p.fmaTokens != 2 || p.qkv.mma.grid != 48*2 || p.qkv.mma.v != (gemvVariant{epiRope, 2}) ||
		p.head.mma.grid != (128256+63)/64 || p.gateUp.mma.grid != 8192/16 || p.qkv.fma.grid != 48*16 {
		t.Errorf("1B plan %+v", p)
	}
	if p := planSkinny(&m, 8, true, smemOptinDefault); p.maxTokens != 8 || !p.use(8) || p.use(9) || p.use(0) {
		t.Errorf("SkinnyTokens 8: %+v", p)
	}
	if p := planSkinny(&m, 100, true, smemOptinDefault); p.maxTokens != 32 {
		t.Errorf("SkinnyTokens 100: max %d, want the kernels' 32", p.maxTokens)
	}
	if p := planSkinny(&m, 0, false, smemOptinDefault); p.maxTokens != 2 || p.fmaTokens != 2 {
		t.Errorf("no tensor cores: %+v, want the fp32 kernels alone", p)
	}
	if p := planSkinny(&m, 0, true, 48<<10); p.fmaTokens != 1 || p.call(&p.o, 2) != &p.o.mma {
		t.Errorf("48 KiB of shared memory: %+v, want 1 token on the fp32 kernels (8192 floats staged)", p)
	}
	for _, off := range []func(*planTest){
		func(c *planTest) { c.m.HiddenSize = 100 }, // rows not 16-byte multiples
		func(c *planTest) { c.skinny = -1 },
	} {
		c := planTest{m: *llama1B(), tc: true}
		off(&c)
		if p := planSkinny(&c.m, c.skinny, c.tc, smemOptinDefault); p.maxTokens != 0 {
			t.Errorf("%+v: skinny plan %+v, want none", c, p)
		}
	}
	// A head dim whose rotary pairs no tensor-core block holds: fp32 only.
	hd48 := *llama1B()
	hd48.HeadDim = 48
	if p := planSkinny(&hd48, 0, true, smemOptinDefault); p.maxTokens != 2 {
		t.Errorf("head dim 48: max %d, want 2 (fp32 kernels only)", p.maxTokens)
	}
	// The 8B shape's 14336-wide down projection: 2 rows take 112 KiB.
	if p := planSkinny(llama8B(), 0, true, 100<<10); p.fmaTokens != 1 {
		t.Errorf("8B with 100 KiB of shared memory: fp32 kernels for %d tokens, want 1", p.fmaTokens)
	}
	// Rows of the gate|up product: tile 0 of block b is gate rows 16b..,
	// tile 1 the up rows I + 16b...
	c := p.gateUp.mma
	row := func(b, l, r int) int { return (l/c.mh)*c.seg + (b/c.s)*c.u + (b%c.s)*16*c.mh + (l%c.mh)*16 + r }
	if row(3, 0, 5) != 48+5 || row(3, 1, 5) != 8192+48+5 {
		t.Errorf("gate|up rows %d, %d", row(3, 0, 5), row(3, 1, 5))
	}
	// q|k|v: block 2h+s holds rows i and i + 32 of head h.
	c = p.qkv.mma
	if row(2*7+1, 0, 3) != 7*64+16+3 || row(2*7+1, 1, 3) != 7*64+32+16+3 {
		t.Errorf("q|k|v rows %d, %d", row(15, 0, 3), row(15, 1, 3))
	}
}

// TestPlanGemvt: which plans run steps past 8 tokens on the gemvt kernels,
// and how their launches split k on an H200 (132 multiprocessors).
func TestPlanGemvt(t *testing.T) {
	m := *llama1B()
	p := planSkinny(&m, 0, true, smemOptinDefault)
	if !p.tune || p.maxTokens != DefaultSkinnyTokens {
		t.Errorf("1B plan with SkinnyTokens 0: %+v, want %d tokens to be tuned", p, DefaultSkinnyTokens)
	}
	p.widen(0)
	if !p.tune || p.maxTokens != 32 || !p.use(32) || p.call(&p.down, 32) != &p.down.mma || !p.down.mma.wide {
		t.Errorf("1B plan widened with SkinnyTokens 0: %+v, want 32 tokens to be tuned", p)
	}
	if l := p.down.mma.launch(32, 132, smemOptinDefault); l.name != "gemvt_resid_m1" || l.threads != gtThreads || l.grid != 2048/16/gtWarps || l.splits < 2 {
		t.Errorf("1B down at 32 tokens: %+v", l)
	}
	if l := p.down.mma.launch(8, 132, smemOptinDefault); l.name != "gemv_resid_m1_n1" || l.splits != 0 {
		t.Errorf("1B down at 8 tokens: %+v, want gemv.cu's kernel", l)
	}
	if l := p.head.mma.launch(20, 132, smemOptinDefault); l.name != "gemvt_head_m4" || l.splits != 1 {
		t.Errorf("1B LM head at 20 tokens: %+v, want one split (its blocks fill the device)", l)
	}
	for _, c := range p.mmaCalls() {
		// Splits never depend on the token count, cover k with non-empty
		// splits of at least gtMinChunks chunks (but for one), and stay
		// within the workspace's bound.
		sp := c.gemvtSplits(132)
		nch := (c.k + gtKC - 1) / gtKC
		per := (nch + sp - 1) / sp
		if sp < 1 || sp > c.gemvtMaxSplits() || sp > 1 && per < gtMinChunks || (sp-1)*per >= nch {
			t.Errorf("%+v: %d splits of %d chunks (bound %d)", c.v, sp, nch, c.gemvtMaxSplits())
		}
		for _, tok := range []int{9, 16, 32} {
			if l := c.launch(tok, 132, smemOptinDefault); l.splits != sp || l.smem != gemvtSmem(c.v.mt) {
				t.Errorf("%+v at %d tokens: %+v, want %d splits", c.v, tok, l, sp)
			}
		}
	}
	q := planSkinny(&m, 16, true, smemOptinDefault)
	q.widen(16)
	if q.tune || q.maxTokens != 16 || !q.o.mma.wide {
		t.Errorf("SkinnyTokens 16 widened: %+v, want 16 tokens, not tuned", q)
	}
	q = planSkinny(&m, 0, false, smemOptinDefault)
	q.widen(0)
	if q.tune || q.maxTokens != 2 {
		t.Errorf("no tensor cores widened: %+v, want the fp32 kernels alone", q)
	}
	if gemvtSmem(1)*gemvtBlocksPerSM(1) > 227<<10 || gemvtSmem(2)*gemvtBlocksPerSM(2) > 227<<10 || gemvtSmem(4) > 227<<10 {
		t.Errorf("gemvt shared memory %d, %d, %d does not fit the blocks compiled for", gemvtSmem(1), gemvtSmem(2), gemvtSmem(4))
	}
	// Attention on 132 multiprocessors: up to 132 (token, kv head) units
	// one block of 16 warps per multiprocessor, parts of 256 keys or more
	// (head dim 64); past that 4 blocks of 4 warps, parts of 64 or more.
	at := newAttnPlan(&m, 132)
	for _, tc := range []struct {
		t    int
		want attnLaunch
	}{
		{1, attnLaunch{name: "attention_r4_w16", threads: 512, smem: attentionSmem(4, 16, 64), splits: 16, minChunk: 256}},
		{8, attnLaunch{name: "attention_r4_w16", threads: 512, smem: attentionSmem(4, 16, 64), splits: 2, minChunk: 256}},
		{32, attnLaunch{name: "attention_r4_w4", threads: 128, smem: attentionSmem(4, 4, 64), splits: 2, minChunk: 64}},
	} {
		if got := at.launch(tc.t); got != tc.want || at.splits(tc.t) != tc.want.splits {
			t.Errorf("attention at %d tokens: %+v, want %+v", tc.t, got, tc.want)
		}
	}
	if l := newAttnPlan(llama8B(), 132).launch(1); l.minChunk != 64 || l.threads != 512 {
		t.Errorf("8B attention at 1 token: %+v, want 16 warps, parts of 64 keys or more", l)
	}
	// With the tensor-core kernel: 8 warps and 16 splits at 1 token, 1
	// split at 32: 8 warps at head dim 64, 4 at 128.
	at.gqa = true
	if l := at.launch(1); l.name != "attention_gqa_d64_w8" || l.threads != 256 || l.splits != 16 || l.smem != gqaSmem(64, 8) {
		t.Errorf("gqa attention at 1 token: %+v", l)
	}
	if l := at.launch(32); l.name != "attention_gqa_d64_w8" || l.threads != 256 || l.splits != 1 {
		t.Errorf("gqa attention at 32 tokens: %+v", l)
	}
	at8 := newAttnPlan(llama8B(), 132)
	at8.gqa = true
	if l := at8.launch(32); l.name != "attention_gqa_d128_w4" || l.threads != 128 || l.splits != 1 || l.smem != gqaSmem(128, 4) {
		t.Errorf("8B gqa attention at 32 tokens: %+v", l)
	}
}

type planTest struct {
	m      model.Config
	skinny int
	tc     bool
}

// TestPlanFmaSplits: how many warps share a unit of the fp32 kernels on an
// H200 (132 multiprocessors, two 8-warp blocks each: 2,112 warps), and that
// the choice is the same at 1 and 2 tokens.
func TestPlanFmaSplits(t *testing.T) {
	for _, tc := range []struct {
		name                         string
		m                            *model.Config
		qkv, o, gateUp, down, lmHead int
	}{
		// 1B: 768 / 512 units of q|k|v / o and down, 4,096 of gate|up.
		{"llama1b", llama1B(), 2, 4, 1, 4, 1},
		// 8B: 1,536 units of q|k|v (4 splits: 6,144 warps, 2.9 rounds),
		// 1,024 of o and down, 7,168 of gate|up.
		{"llama8b", llama8B(), 4, 2, 2, 2, 1},
	} {
		p := planSkinny(tc.m, 0, true, smemOptinDefault)
		for i, want := range []int{tc.qkv, tc.o, tc.gateUp, tc.down, tc.lmHead} {
			c := []*gemvCall{&p.qkv.fma, &p.o.fma, &p.gateUp.fma, &p.down.fma, &p.head.fma}[i]
			l1, l2 := c.launch(1, 132, smemOptinDefault), c.launch(2, 132, smemOptinDefault)
			if l1.ks != want || l2.ks != want {
				t.Errorf("%s product %d (%d units, k %d): %d / %d warps a unit at 1 / 2 tokens, want %d", tc.name, i, c.grid, c.k, l1.ks, l2.ks, want)
			}
			if l1.grid*gemvWarps%l1.ks != 0 || l1.grid > 132*2 || l1.smem != gemvfSmem(1, c.k) {
				t.Errorf("%s product %d: launch %+v", tc.name, i, l1)
			}
		}
	}
	c := planSkinny(llama1B(), 0, true, smemOptinDefault).o.fma
	c.ks = 8
	if l := c.launch(1, 132, smemOptinDefault); l.ks != 8 || l.grid != 132*2 { // 512 blocks' work on the resident 264
		t.Errorf("fixed 8 warps a unit: %+v", l)
	}
	// The counts tuneOSplits tries: each warp keeps at least 512 elements.
	for k, want := range map[int][]int{256: {1}, 512: {1}, 1024: {1, 2}, 2048: {1, 2, 4}, 4096: {1, 2, 4, 8}, 14336: {1, 2, 4, 8}} {
		c := gemvCall{k: k}
		if got := c.splitCounts(); !slices.Equal(got, want) {
			t.Errorf("k %d: split counts %v, want %v", k, got, want)
		}
	}
}
