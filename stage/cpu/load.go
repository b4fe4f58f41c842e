package cpu

import (
	"encoding/binary"
	"fmt"
	"math"
	"slices"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/safetensors"
	"github.com/tandem-llm/tandem/stage"
)

// load reads the stage's tensors and converts them to float32.
func (s *Stage) load(w stage.Weights) error {
	m := &s.m
	h, inter, vocab := m.HiddenSize, m.IntermediateSize, m.VocabSize
	s.layers = make([]layer, s.hi-s.lo)
	for i := s.lo; i < s.hi; i++ {
		l := &s.layers[i-s.lo]
		l.inNorm = make([]float32, h)
		l.postNorm = make([]float32, h)
		l.qkv = make([]float32, s.qkvDim*h)
		l.o = make([]float32, h*s.qDim)
		l.gateUp = make([]float32, 2*inter*h)
		l.down = make([]float32, h*inter)
		parts := []tensorPart{
			{model.InputNorm, l.inNorm, []int{h}},
			{model.PostNorm, l.postNorm, []int{h}},
			{model.QProj, l.qkv[:s.qDim*h], []int{s.qDim, h}},
			{model.KProj, l.qkv[s.qDim*h : (s.qDim+s.kvDim)*h], []int{s.kvDim, h}},
			{model.VProj, l.qkv[(s.qDim+s.kvDim)*h:], []int{s.kvDim, h}},
			{model.OProj, l.o, []int{h, s.qDim}},
			{model.GateProj, l.gateUp[:inter*h], []int{inter, h}},
			{model.UpProj, l.gateUp[inter*h:], []int{inter, h}},
			{model.DownProj, l.down, []int{h, inter}},
		}
		if m.AttentionBias {
			l.qkvBias = make([]float32, s.qkvDim)
			parts = append(parts,
				tensorPart{model.QBias, l.qkvBias[:s.qDim], []int{s.qDim}},
				tensorPart{model.KBias, l.qkvBias[s.qDim : s.qDim+s.kvDim], []int{s.kvDim}},
				tensorPart{model.VBias, l.qkvBias[s.qDim+s.kvDim:], []int{s.kvDim}},
			)
		}
		for _, p := range parts {
			if err := loadInto(w, model.LayerTensor(i, p.suffix), p.shape, p.dst); err != nil {
				return err
			}
		}
	}
	if s.first || (s.last && m.TieEmbedding) {
		s.embed = make([]float32, vocab*h)
		if err := loadInto(w, model.EmbedName, []int{vocab, h}, s.embed); err != nil {
			return err
		}
	}
	if s.last {
		s.norm = make([]float32, h)
		if err := loadInto(w, model.NormName, []int{h}, s.norm); err != nil {
			return err
		}
		if m.TieEmbedding {
			s.lmHead = s.embed
			if !s.first {
				s.embed = nil
			}
		} else {
			s.lmHead = make([]float32, vocab*h)
			if err := loadInto(w, model.LMHeadName, []int{vocab, h}, s.lmHead); err != nil {
				return err
			}
		}
	}
	return nil
}

// tensorPart is one layer tensor and the float32 slice it is converted into.
type tensorPart struct {
	suffix string
	dst    []float32
	shape  []int
}

// loadInto reads tensor name, checks that its shape is shape, and converts
// it into dst.
func loadInto(w stage.Weights, name string, shape []int, dst []float32) error {
	t, err := w.Tensor(name)
	if err != nil {
		return fmt.Errorf("load tensor %s: %w", name, err)
	}
	if !slices.Equal(t.Shape, shape) {
		return fmt.Errorf("tensor %s: shape %v, want %v", name, t.Shape, shape)
	}
	if err := toFloat32(dst, t.DType, t.Data); err != nil {
		return fmt.Errorf("tensor %s: %w", name, err)
	}
	return nil
}

// toFloat32 converts little-endian F32, BF16 or F16 data into dst, which
// must hold exactly as many elements as data.
func toFloat32(dst []float32, dt safetensors.DType, data []byte) error {
	var size int
	switch dt {
	case safetensors.F32:
		size = 4
	case safetensors.BF16, safetensors.F16:
		size = 2
	default:
		return fmt.Errorf("dtype %s is not supported (F32, BF16, F16)", dt)
	}
	if len(data) != size*len(dst) {
		return fmt.Errorf("%d bytes of %s data for %d elements", len(data), dt, len(dst))
	}
	switch dt {
	case safetensors.F32:
		for i := range dst {
			dst[i] = math.Float32frombits(binary.LittleEndian.Uint32(data[4*i:]))
		}
	case safetensors.BF16:
		for i := range dst {
			dst[i] = safetensors.BF16ToFloat32(binary.LittleEndian.Uint16(data[2*i:]))
		}
	case safetensors.F16:
		for i := range dst {
			dst[i] = safetensors.F16ToFloat32(binary.LittleEndian.Uint16(data[2*i:]))
		}
	}
	return nil
}
