package stagetest

import (
	"bytes"
	"encoding/binary"
	"math"
	"slices"
	"testing"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/safetensors"
)

func TestHalfValue(t *testing.T) {
	cases := []struct {
		bits uint16
		want float64
	}{
		{0x0000, 0},
		{0x3c00, 1},
		{0xc000, -2},
		{0x3800, 0.5},
		{0x7bff, 65504},
		{0x0400, math.Pow(2, -14)},
		{0x0001, math.Pow(2, -24)},
		{0x8200, -512 * math.Pow(2, -24)},
		{0x7c00, math.Inf(1)},
	}
	for _, tc := range cases {
		if got := halfValue(tc.bits); got != tc.want {
			t.Errorf("halfValue(%#04x) = %v, want %v", tc.bits, got, tc.want)
		}
	}
}

func TestRandomWeights(t *testing.T) {
	for _, sh := range Shapes() {
		w := RandomWeights(&sh.Model, sh.DType, 5)
		shapes := TensorShapes(&sh.Model)
		if len(w) != len(shapes) {
			t.Errorf("%s: %d tensors, want %d", sh.Name, len(w), len(shapes))
		}
		again := RandomWeights(&sh.Model, sh.DType, 5)
		other := RandomWeights(&sh.Model, sh.DType, 6)
		for name, shape := range shapes {
			tn := w[name]
			n := 1
			for _, d := range shape {
				n *= d
			}
			size := 2
			if sh.DType == safetensors.F32 {
				size = 4
			}
			if tn == nil || !slices.Equal(tn.Shape, shape) || tn.DType != sh.DType || len(tn.Data) != n*size {
				t.Fatalf("%s: tensor %s is %+v, want shape %v of %s", sh.Name, name, tn, shape, sh.DType)
			}
			if !bytes.Equal(tn.Data, again[name].Data) {
				t.Errorf("%s: tensor %s differs between two draws with one seed", sh.Name, name)
			}
			if n > 8 && bytes.Equal(tn.Data, other[name].Data) {
				t.Errorf("%s: tensor %s is the same for seeds 5 and 6", sh.Name, name)
			}
		}
	}
}

// TestRopeBands checks that the rope-scaled shape exercises the three
// llama3 bands: kept, interpolated and divided frequencies.
func TestRopeBands(t *testing.T) {
	for _, sh := range Shapes() {
		m := sh.Model
		if m.RopeScaling == nil {
			continue
		}
		plain := m
		plain.RopeScaling = nil
		base, scaled := referenceFreqs(&plain), referenceFreqs(&m)
		var kept, divided, between int
		for i := range base {
			switch r := scaled[i] / base[i]; {
			case r == 1:
				kept++
			case math.Abs(r*m.RopeScaling.Factor-1) < 1e-12:
				divided++
			case r > 1/m.RopeScaling.Factor && r < 1:
				between++
			default:
				t.Errorf("%s: frequency %d scaled by %v", sh.Name, i, r)
			}
		}
		if kept == 0 || divided == 0 || between == 0 {
			t.Errorf("%s: %d kept, %d interpolated, %d divided frequencies: a band is unused", sh.Name, kept, between, divided)
		}
	}
}

func TestReferenceCausal(t *testing.T) {
	sh := Shapes()[4]
	ref, err := NewReference(&sh.Model, RandomWeights(&sh.Model, sh.DType, 8))
	if err != nil {
		t.Fatal(err)
	}
	tokens := []int32{3, 140, 7, 7, 99, 0, 150, 42}
	full := ref.Logits(tokens)
	for p := range tokens {
		if !slices.Equal(ref.Logits(tokens[:p+1])[p], full[p]) {
			t.Errorf("position %d depends on later tokens", p)
		}
	}
}

// TestReferenceRope checks the rotate_half layout on two heads of dim 4:
// the pair (0, 2) turns by the angle pos·1 and the pair (1, 3) by
// pos/theta^(1/2), each as the complex number x_i + i·x_{i+2}.
func TestReferenceRope(t *testing.T) {
	r := &Reference{cfg: model.Config{HeadDim: 4, RopeTheta: 100}}
	r.freqs = referenceFreqs(&r.cfg)
	const pos = 3
	got := r.rope([]float64{1, 0, 2, 0, 0, 1, 0, -1}, pos)
	c3, s3, c03, s03 := math.Cos(3), math.Sin(3), math.Cos(0.3), math.Sin(0.3)
	want := []float64{c3 - 2*s3, 0, 2*c3 + s3, 0, 0, c03 + s03, 0, -c03 + s03}
	for i := range want {
		if math.Abs(got[i]-want[i]) > 1e-15 {
			t.Fatalf("rope = %v, want %v", got, want)
		}
	}
}

// TestReferenceByHand runs a one-layer model small enough to follow by
// hand: hidden 2, one head of dim 2, zero q and k (so attention averages
// the values seen so far), identity v and o, a one-unit MLP that adds
// silu(g)·g to the first coordinate, identity LM head.
func TestReferenceByHand(t *testing.T) {
	cfg := model.Config{
		HiddenSize: 2, NumLayers: 1, NumHeads: 1, NumKVHeads: 1, HeadDim: 2,
		IntermediateSize: 1, VocabSize: 2, RMSNormEps: 0, RopeTheta: 10000, MaxPositions: 8,
	}
	f32 := func(shape []int, v ...float32) *safetensors.Tensor {
		data := make([]byte, 4*len(v))
		for i, x := range v {
			binary.LittleEndian.PutUint32(data[4*i:], math.Float32bits(x))
		}
		return &safetensors.Tensor{DType: safetensors.F32, Shape: shape, Data: data}
	}
	l := func(s string) string { return model.LayerTensor(0, s) }
	w := Weights{
		model.EmbedName:    f32([]int{2, 2}, 1, 0, 0, 2),
		model.NormName:     f32([]int{2}, 1, 1),
		model.LMHeadName:   f32([]int{2, 2}, 1, 0, 0, 1),
		l(model.InputNorm): f32([]int{2}, 1, 1),
		l(model.PostNorm):  f32([]int{2}, 1, 1),
		l(model.QProj):     f32([]int{2, 2}, 0, 0, 0, 0),
		l(model.KProj):     f32([]int{2, 2}, 0, 0, 0, 0),
		l(model.VProj):     f32([]int{2, 2}, 1, 0, 0, 1),
		l(model.OProj):     f32([]int{2, 2}, 1, 0, 0, 1),
		l(model.GateProj):  f32([]int{1, 2}, 1, 0),
		l(model.UpProj):    f32([]int{1, 2}, 1, 0),
		l(model.DownProj):  f32([]int{2, 1}, 1, 0),
	}
	ref, err := NewReference(&cfg, w)
	if err != nil {
		t.Fatal(err)
	}
	got := ref.Logits([]int32{0, 1})
	s2 := math.Sqrt2
	silu := func(g float64) float64 { return g / (1 + math.Exp(-g)) }
	// Position 1: embedding (0,2), normed (0,√2); the average of the values
	// (√2,0) and (0,√2) is (√2/2,√2/2).
	x := []float64{s2 / 2, 2 + s2/2}
	n := math.Hypot(x[0], x[1]) / s2 // root mean square
	g := x[0] / n
	x[0] += silu(g) * g
	n = math.Hypot(x[0], x[1]) / s2
	want1 := []float64{x[0] / n, x[1] / n}
	// Position 0: everything points along the first axis; the final norm
	// brings it back to (√2, 0).
	want0 := []float64{s2, 0}
	for i := range 2 {
		if math.Abs(got[0][i]-want0[i]) > 1e-12 || math.Abs(got[1][i]-want1[i]) > 1e-12 {
			t.Fatalf("logits %v, want [%v %v]", got, want0, want1)
		}
	}
}
