package stagetest

import (
	"encoding/binary"
	"fmt"
	"math"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/safetensors"
)

// TensorSource gives tensors by Hugging Face name (Weights, or a checkpoint).
type TensorSource interface {
	Tensor(name string) (*safetensors.Tensor, error)
}

// Reference is the float64 reference model: the whole Llama-family forward
// pass written out plainly, position by position, with no cache.
type Reference struct {
	cfg    model.Config
	embed  [][]float64 // [vocab][hidden]
	norm   []float64
	lmHead [][]float64 // [vocab][hidden]
	layers []refLayer
	freqs  []float64 // rotary inverse frequencies
}

type refLayer struct {
	inNorm, postNorm []float64
	q, k, v, o       [][]float64 // [out][in]
	qBias            []float64   // nil without attention bias
	kBias, vBias     []float64
	gate, up, down   [][]float64
}

// NewReference reads every tensor of the model from w.
func NewReference(cfg *model.Config, w TensorSource) (*Reference, error) {
	r := &Reference{cfg: *cfg}
	h, inter := cfg.HiddenSize, cfg.IntermediateSize
	q, kv := cfg.NumHeads*cfg.HeadDim, cfg.NumKVHeads*cfg.HeadDim
	var err error
	vec := func(name string, n int) []float64 {
		if err != nil {
			return nil
		}
		var v []float64
		v, err = readTensor(w, name, []int{n})
		return v
	}
	mat := func(name string, rows, cols int) [][]float64 {
		if err != nil {
			return nil
		}
		var flat []float64
		flat, err = readTensor(w, name, []int{rows, cols})
		m := make([][]float64, rows)
		for i := range m {
			if err == nil {
				m[i] = flat[i*cols : (i+1)*cols]
			}
		}
		return m
	}
	r.embed = mat(model.EmbedName, cfg.VocabSize, h)
	r.norm = vec(model.NormName, h)
	if cfg.TieEmbedding {
		r.lmHead = r.embed
	} else {
		r.lmHead = mat(model.LMHeadName, cfg.VocabSize, h)
	}
	for i := range cfg.NumLayers {
		name := func(suffix string) string { return model.LayerTensor(i, suffix) }
		l := refLayer{
			inNorm:   vec(name(model.InputNorm), h),
			postNorm: vec(name(model.PostNorm), h),
			q:        mat(name(model.QProj), q, h),
			k:        mat(name(model.KProj), kv, h),
			v:        mat(name(model.VProj), kv, h),
			o:        mat(name(model.OProj), h, q),
			gate:     mat(name(model.GateProj), inter, h),
			up:       mat(name(model.UpProj), inter, h),
			down:     mat(name(model.DownProj), h, inter),
		}
		if cfg.AttentionBias {
			l.qBias = vec(name(model.QBias), q)
			l.kBias = vec(name(model.KBias), kv)
			l.vBias = vec(name(model.VBias), kv)
		}
		r.layers = append(r.layers, l)
	}
	if err != nil {
		return nil, err
	}
	r.freqs = referenceFreqs(cfg)
	return r, nil
}

// referenceFreqs returns the rotary inverse frequencies theta^(-2i/d),
// rescaled by the llama3 rule when configured.
func referenceFreqs(cfg *model.Config) []float64 {
	d := cfg.HeadDim
	freqs := make([]float64, d/2)
	for i := range freqs {
		freqs[i] = math.Pow(cfg.RopeTheta, -float64(2*i)/float64(d))
	}
	s := cfg.RopeScaling
	if s == nil {
		return freqs
	}
	old := float64(s.OriginalMaxPositions)
	for i, f := range freqs {
		wavelen := 2 * math.Pi / f
		if wavelen < old/s.HighFreqFactor {
			continue // high frequency: unchanged
		}
		if wavelen > old/s.LowFreqFactor {
			freqs[i] = f / s.Factor // low frequency: scaled
			continue
		}
		smooth := (old/wavelen - s.LowFreqFactor) / (s.HighFreqFactor - s.LowFreqFactor)
		freqs[i] = (1-smooth)*f/s.Factor + smooth*f
	}
	return freqs
}

// readTensor decodes a tensor to float64 after checking its shape.
func readTensor(w TensorSource, name string, shape []int) ([]float64, error) {
	t, err := w.Tensor(name)
	if err != nil {
		return nil, fmt.Errorf("reference: %w", err)
	}
	n := 1
	for _, d := range shape {
		n *= d
	}
	if fmt.Sprint(t.Shape) != fmt.Sprint(shape) {
		return nil, fmt.Errorf("reference: tensor %s has shape %v, want %v", name, t.Shape, shape)
	}
	out := make([]float64, n)
	switch t.DType {
	case safetensors.F32:
		if len(t.Data) != 4*n {
			return nil, fmt.Errorf("reference: tensor %s has %d bytes, want %d", name, len(t.Data), 4*n)
		}
		for i := range out {
			out[i] = float64(math.Float32frombits(binary.LittleEndian.Uint32(t.Data[4*i:])))
		}
	case safetensors.BF16, safetensors.F16:
		if len(t.Data) != 2*n {
			return nil, fmt.Errorf("reference: tensor %s has %d bytes, want %d", name, len(t.Data), 2*n)
		}
		for i := range out {
			bits := binary.LittleEndian.Uint16(t.Data[2*i:])
			if t.DType == safetensors.BF16 {
				out[i] = float64(math.Float32frombits(uint32(bits) << 16))
			} else {
				out[i] = halfValue(bits)
			}
		}
	default:
		return nil, fmt.Errorf("reference: tensor %s has dtype %s", name, t.DType)
	}
	return out, nil
}

// halfValue is the value of an IEEE 754 binary16 number.
func halfValue(bits uint16) float64 {
	sign := 1.0
	if bits&0x8000 != 0 {
		sign = -1
	}
	exp := int(bits>>10) & 0x1f
	frac := float64(bits & 0x3ff)
	switch exp {
	case 0:
		return sign * frac * math.Pow(2, -24)
	case 31:
		if frac != 0 {
			return math.NaN()
		}
		return sign * math.Inf(1)
	}
	return sign * (1 + frac/1024) * math.Pow(2, float64(exp-15))
}

// Logits returns the logits at every position of a sequence of token ids
// (Logits(tokens)[p] predicts the token after tokens[p]).
func (r *Reference) Logits(tokens []int32) [][]float64 {
	c := &r.cfg
	x := make([][]float64, len(tokens))
	for p, tok := range tokens {
		x[p] = append([]float64(nil), r.embed[tok]...)
	}
	for _, l := range r.layers {
		// self-attention block
		normed := make([][]float64, len(x))
		qs := make([][]float64, len(x))
		ks := make([][]float64, len(x))
		vs := make([][]float64, len(x))
		for p := range x {
			normed[p] = rmsNormRef(x[p], l.inNorm, c.RMSNormEps)
			qs[p] = r.rope(matVec(l.q, normed[p], l.qBias), p)
			ks[p] = r.rope(matVec(l.k, normed[p], l.kBias), p)
			vs[p] = matVec(l.v, normed[p], l.vBias)
		}
		for p := range x {
			attn := r.attend(qs[p], ks[:p+1], vs[:p+1])
			for i, v := range matVec(l.o, attn, nil) {
				x[p][i] += v
			}
		}
		// MLP block
		for p := range x {
			n := rmsNormRef(x[p], l.postNorm, c.RMSNormEps)
			g := matVec(l.gate, n, nil)
			u := matVec(l.up, n, nil)
			for i := range g {
				g[i] = g[i] / (1 + math.Exp(-g[i])) * u[i]
			}
			for i, v := range matVec(l.down, g, nil) {
				x[p][i] += v
			}
		}
	}
	logits := make([][]float64, len(x))
	for p := range x {
		logits[p] = matVec(r.lmHead, rmsNormRef(x[p], r.norm, c.RMSNormEps), nil)
	}
	return logits
}

// attend is grouped-query attention of one position's query heads over the
// keys and values of positions 0..p.
func (r *Reference) attend(q []float64, ks, vs [][]float64) []float64 {
	c := &r.cfg
	d := c.HeadDim
	perKV := c.NumHeads / c.NumKVHeads
	out := make([]float64, c.NumHeads*d)
	for h := range c.NumHeads {
		g := h / perKV
		qh := q[h*d : (h+1)*d]
		scores := make([]float64, len(ks))
		top := math.Inf(-1)
		for j, k := range ks {
			var s float64
			for i := range d {
				s += qh[i] * k[g*d+i]
			}
			scores[j] = s / math.Sqrt(float64(d))
			top = math.Max(top, scores[j])
		}
		var total float64
		for j := range scores {
			scores[j] = math.Exp(scores[j] - top)
			total += scores[j]
		}
		for j, v := range vs {
			for i := range d {
				out[h*d+i] += scores[j] / total * v[g*d+i]
			}
		}
	}
	return out
}

// rope rotates every head of v by its position: dimension i of a head pairs
// with dimension i+d/2 ("rotate_half").
func (r *Reference) rope(v []float64, pos int) []float64 {
	d := r.cfg.HeadDim
	out := make([]float64, len(v))
	for h := 0; h < len(v); h += d {
		for i := range d / 2 {
			angle := float64(pos) * r.freqs[i]
			a, b := v[h+i], v[h+i+d/2]
			out[h+i] = a*math.Cos(angle) - b*math.Sin(angle)
			out[h+i+d/2] = b*math.Cos(angle) + a*math.Sin(angle)
		}
	}
	return out
}

func rmsNormRef(x, w []float64, eps float64) []float64 {
	var ss float64
	for _, v := range x {
		ss += v * v
	}
	scale := 1 / math.Sqrt(ss/float64(len(x))+eps)
	out := make([]float64, len(x))
	for i, v := range x {
		out[i] = v * scale * w[i]
	}
	return out
}

// matVec returns m·x + bias (bias may be nil).
func matVec(m [][]float64, x, bias []float64) []float64 {
	out := make([]float64, len(m))
	for i, row := range m {
		var s float64
		for j, v := range row {
			s += v * x[j]
		}
		if bias != nil {
			s += bias[i]
		}
		out[i] = s
	}
	return out
}

// RelErr is the relative error ‖a−b‖/‖b‖ of a against the reference b;
// +Inf when a is not comparable (other length, NaN).
func RelErr(a []float32, b []float64) float64 {
	if len(a) != len(b) {
		return math.Inf(1)
	}
	var num, den float64
	for i, v := range b {
		d := float64(a[i]) - v
		num += d * d
		den += v * v
	}
	if e := math.Sqrt(num / den); !math.IsNaN(e) {
		return e
	}
	return math.Inf(1)
}

// LogSoftmax returns the log-probabilities of a row of logits.
func LogSoftmax(logits []float64) []float64 {
	top := math.Inf(-1)
	for _, v := range logits {
		top = math.Max(top, v)
	}
	var total float64
	for _, v := range logits {
		total += math.Exp(v - top)
	}
	lse := top + math.Log(total)
	out := make([]float64, len(logits))
	for i, v := range logits {
		out[i] = v - lse
	}
	return out
}
