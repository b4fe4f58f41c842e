package cuda

import (
	"fmt"
	"math"
	"slices"

	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/safetensors"
	"github.com/tandem-llm/tandem/stage"
)

// part is one checkpoint tensor bound for the device: its expected shape
// and its byte offset in the weights allocation. Fused weights are several
// parts at consecutive offsets.
type part struct {
	name  string
	shape []int
	off   int
}

func numel(shape []int) int {
	n := 1
	for _, d := range shape {
		n *= d
	}
	return n
}

// loadWeights reads the stage's tensors, checks their shapes, converts them
// to bf16 and uploads them into one device allocation: the layers [lo, hi),
// the embedding on the first stage, the final norm and LM head on the last
// (the embedding again when the model ties them). Device goroutine only.
func (s *Stage) loadWeights(w stage.Weights) error {
	m := &s.m
	H, I, V := m.HiddenSize, m.IntermediateSize, m.VocabSize
	var a arena
	var parts []part
	// add lays out tensors back to back (a fused weight) and returns the
	// offset of the first.
	add := func(ps ...part) int {
		n := 0
		for _, p := range ps {
			n += numel(p.shape) * 2
		}
		off := a.take(n)
		o := off
		for _, p := range ps {
			p.off = o
			o += numel(p.shape) * 2
			parts = append(parts, p)
		}
		return off
	}
	type layerOffs struct{ inNorm, postNorm, qkv, qkvBias, o, gateUp, down int }
	var embed, norm, lmHead int
	if s.first {
		embed = add(part{name: model.EmbedName, shape: []int{V, H}})
	}
	offs := make([]layerOffs, 0, s.hi-s.lo)
	for l := s.lo; l < s.hi; l++ {
		t := func(suffix string, shape ...int) part {
			return part{name: model.LayerTensor(l, suffix), shape: shape}
		}
		var lo layerOffs
		lo.inNorm = add(t(model.InputNorm, H))
		lo.qkv = add(t(model.QProj, s.qDim, H), t(model.KProj, s.kvDim, H), t(model.VProj, s.kvDim, H))
		lo.qkvBias = -1
		if m.AttentionBias {
			lo.qkvBias = add(t(model.QBias, s.qDim), t(model.KBias, s.kvDim), t(model.VBias, s.kvDim))
		}
		lo.o = add(t(model.OProj, H, s.qDim))
		lo.postNorm = add(t(model.PostNorm, H))
		lo.gateUp = add(t(model.GateProj, I, H), t(model.UpProj, I, H))
		lo.down = add(t(model.DownProj, H, I))
		offs = append(offs, lo)
	}
	if s.last {
		norm = add(part{name: model.NormName, shape: []int{H}})
		switch {
		case m.TieEmbedding && s.first:
			lmHead = embed
		case m.TieEmbedding:
			lmHead = add(part{name: model.EmbedName, shape: []int{V, H}})
		default:
			lmHead = add(part{name: model.LMHeadName, shape: []int{V, H}})
		}
	}
	mem, err := s.alloc(a.size, "weights")
	if err != nil {
		return err
	}
	s.mem.WeightBytes = int64(a.size)
	base := mem.Ptr()
	p := func(off int) gpu.DevicePtr { return base + gpu.DevicePtr(off) }
	var staging []uint16
	for _, pt := range parts {
		t, err := w.Tensor(pt.name)
		if err != nil {
			return fmt.Errorf("load %s: %w", pt.name, err)
		}
		data, err := bf16Bytes(t, pt.shape, &staging)
		if err != nil {
			return err
		}
		if err := gpu.CopyHtoD(p(pt.off), data); err != nil {
			return fmt.Errorf("upload %s: %w", pt.name, err)
		}
	}
	if s.first {
		s.weights.embed = p(embed)
	}
	if s.last {
		s.weights.norm, s.weights.lmHead = p(norm), p(lmHead)
	}
	for _, lo := range offs {
		lw := layerW{inNorm: p(lo.inNorm), postNorm: p(lo.postNorm), qkv: p(lo.qkv), o: p(lo.o),
			gateUp: p(lo.gateUp), down: p(lo.down)}
		if lo.qkvBias >= 0 {
			lw.qkvBias = p(lo.qkvBias)
		}
		s.layers = append(s.layers, lw)
	}
	return nil
}

// bf16Bytes returns t's elements as little-endian bf16 bytes, after
// checking its shape: BF16 data as stored, F16 and F32 converted (rounded
// to nearest even) into *staging, which it grows as needed.
func bf16Bytes(t *safetensors.Tensor, shape []int, staging *[]uint16) ([]byte, error) {
	if !slices.Equal(t.Shape, shape) {
		return nil, fmt.Errorf("tensor %s has shape %v; the config implies %v", t.Name, t.Shape, shape)
	}
	n := numel(shape)
	size := t.DType.Size()
	if size == 0 || len(t.Data) != n*size {
		return nil, fmt.Errorf("tensor %s: %d bytes of %s for shape %v", t.Name, len(t.Data), t.DType, shape)
	}
	if t.DType == safetensors.BF16 {
		return t.Data, nil
	}
	if cap(*staging) < n {
		*staging = make([]uint16, n)
	}
	out := (*staging)[:n]
	switch t.DType {
	case safetensors.F16:
		for i := range out {
			h := uint16(t.Data[2*i]) | uint16(t.Data[2*i+1])<<8
			out[i] = safetensors.Float32ToBF16(safetensors.F16ToFloat32(h))
		}
	case safetensors.F32:
		for i := range out {
			b := t.Data[4*i:]
			u := uint32(b[0]) | uint32(b[1])<<8 | uint32(b[2])<<16 | uint32(b[3])<<24
			out[i] = safetensors.Float32ToBF16(math.Float32frombits(u))
		}
	default:
		return nil, fmt.Errorf("tensor %s: dtype %s is not supported (BF16, F16 or F32)", t.Name, t.DType)
	}
	return gpu.AsBytes(out), nil
}
