package cpu

// Memory is the host memory a CPU stage holds, in bytes.
type Memory struct {
	// WeightBytes are its weights in float32: its layers, the embedding
	// (first stage), the final norm and LM head (last stage; a tied head
	// counts once).
	WeightBytes int64
	// WorkspaceBytes are its activation and scratch buffers.
	WorkspaceBytes int64
	// KVBytes is its paged KV cache.
	KVBytes int64
}

// Memory reports what the stage holds (zero once closed).
func (s *Stage) Memory() Memory {
	var m Memory
	for _, l := range s.layers {
		m.WeightBytes += floats(l.inNorm, l.postNorm, l.qkv, l.qkvBias, l.o, l.gateUp, l.down)
	}
	m.WeightBytes += floats(s.embed, s.norm)
	if len(s.lmHead) > 0 && (len(s.embed) == 0 || &s.lmHead[0] != &s.embed[0]) {
		m.WeightBytes += floats(s.lmHead)
	}
	b := &s.buf
	m.WorkspaceBytes = floats(b.in, b.x, b.xn, b.qkv, b.attn, b.gateUp, b.act, b.cos, b.sin, b.scores, b.logits)
	m.KVBytes = floats(s.kPool...) + floats(s.vPool...)
	return m
}

// floats is the size of float32 slices in bytes.
func floats(xs ...[]float32) int64 {
	var n int64
	for _, x := range xs {
		n += 4 * int64(len(x))
	}
	return n
}
