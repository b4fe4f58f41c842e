package cpu

import (
	"cmp"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"

	"github.com/tandem-llm/tandem/stage"
)

// sampler draws tokens from logits. Its scratch is sized for the vocabulary
// once; it is used by one goroutine.
type sampler struct {
	cands []candidate // one per token
	heap  []int32     // top-n selection
}

// candidate is a token and its (unnormalised) probability.
type candidate struct {
	id int32
	p  float64
}

func newSampler(vocab int) sampler {
	return sampler{cands: make([]candidate, vocab), heap: make([]int32, 0, vocab)}
}

// sample draws a token from one row of logits (one value per token) with the
// parameters p; index is the number of tokens the sequence sampled before.
// The parameters must have passed stage.Sampling.Validate. A row holding
// NaN or an infinity has no distribution to draw from: it is an error.
func (sp *sampler) sample(logits []float32, p *stage.Sampling, index int) (stage.Sampled, error) {
	if err := checkFinite(logits); err != nil {
		return stage.Sampled{}, err
	}
	// log-softmax normaliser of the raw logits, in float64
	m := math.Inf(-1)
	for _, v := range logits {
		m = max(m, float64(v))
	}
	var sum float64
	for _, v := range logits {
		sum += math.Exp(float64(v) - m)
	}
	lse := m + math.Log(sum)

	tok := sp.choose(logits, p, index)
	out := stage.Sampled{Token: tok, Logprob: logprob(logits[tok], lse)}
	if p.Logprobs > 0 {
		ids := topN(logits, p.Logprobs, sp.heap)
		out.Top = make([]stage.TokenLogprob, len(ids))
		for i, id := range ids {
			out.Top[i] = stage.TokenLogprob{Token: id, Logprob: logprob(logits[id], lse)}
		}
	}
	return out, nil
}

// logprob is the log-probability of a token of logit v given the row's
// log-sum-exp lse, kept within the float32 range: with finite logits so far
// apart that it underflows (below -3.4e38), it is the lowest finite
// float32 rather than -Inf, which JSON cannot carry.
func logprob(v float32, lse float64) float32 {
	return float32(max(float64(v)-lse, -math.MaxFloat32))
}

// checkFinite fails for a logits row holding NaN or an infinity, saying how
// many values are bad and where the first is.
func checkFinite(logits []float32) error {
	bad, first := 0, -1
	for i, v := range logits {
		// v-v is 0 for a finite v, NaN for NaN and ±Inf.
		if v-v != 0 {
			if bad == 0 {
				first = i
			}
			bad++
		}
	}
	if bad == 0 {
		return nil
	}
	return fmt.Errorf("non-finite logits: %d of %d values are NaN or infinite (the first, token %d, is %v)", bad, len(logits), first, logits[first])
}

// choose picks the token: the arg-max for temperature 0, otherwise a draw
// from the tempered distribution restricted by top-k and top-p.
func (sp *sampler) choose(logits []float32, p *stage.Sampling, index int) int32 {
	if p.Temperature == 0 {
		return argmax(logits)
	}
	cands := sp.cands[:0]
	if p.TopK > 0 && p.TopK < len(logits) {
		for _, id := range topN(logits, p.TopK, sp.heap) {
			cands = append(cands, candidate{id: id})
		}
	} else {
		for id := range logits {
			cands = append(cands, candidate{id: int32(id)})
		}
	}
	lmax := math.Inf(-1)
	for _, c := range cands {
		lmax = max(lmax, float64(logits[c.id]))
	}
	invT := 1 / float64(p.Temperature)
	var total float64
	for i, c := range cands {
		pr := math.Exp((float64(logits[c.id]) - lmax) * invT)
		cands[i].p = pr
		total += pr
	}
	if topP := float64(p.TopP); topP > 0 && topP < 1 {
		cands, total = nucleus(cands, total, topP)
	}
	rng := rand.NewPCG(mix64(p.Seed), mix64(uint64(index)))
	u := float64(rng.Uint64()>>11) * 0x1p-53 * total
	var cum float64
	for _, c := range cands {
		cum += c.p
		if u < cum {
			return c.id
		}
	}
	return cands[len(cands)-1].id
}

// nucleus keeps the smallest set of most likely candidates (ties ordered by
// token id) whose probability reaches topP of total, sorted most likely
// first, and returns it with its total. Candidates below
// (1-topP)·total/len(cands) are dropped before sorting: together they weigh
// at most (1-topP)·total, so the kept ones, which come first in the sorted
// order, already reach topP.
func nucleus(cands []candidate, total, topP float64) ([]candidate, float64) {
	floor := (1 - topP) * total / float64(len(cands))
	kept := cands[:0]
	for _, c := range cands {
		if c.p >= floor {
			kept = append(kept, c)
		}
	}
	slices.SortFunc(kept, func(a, b candidate) int {
		if a.p != b.p {
			return cmp.Compare(b.p, a.p)
		}
		return cmp.Compare(a.id, b.id)
	})
	want := topP * total
	var cum float64
	for i, c := range kept {
		cum += c.p
		if cum >= want {
			return kept[:i+1], cum
		}
	}
	return kept, cum
}

// argmax returns the id of the largest logit, the lowest id among ties.
func argmax(logits []float32) int32 {
	best := 0
	for i, v := range logits {
		if v > logits[best] {
			best = i
		}
	}
	return int32(best)
}

// topN returns the ids of the n largest logits, largest first, ties by
// lowest id, using heap (capacity ≥ n) as scratch.
func topN(logits []float32, n int, heap []int32) []int32 {
	// better reports whether token a ranks before token b.
	better := func(a, b int32) bool {
		return logits[a] > logits[b] || (logits[a] == logits[b] && a < b)
	}
	// heap is a binary heap with the worst kept token at its root.
	down := func(h []int32, i int) {
		for {
			c := 2*i + 1
			if c >= len(h) {
				return
			}
			if c+1 < len(h) && better(h[c], h[c+1]) {
				c++
			}
			if !better(h[i], h[c]) {
				return
			}
			h[i], h[c] = h[c], h[i]
			i = c
		}
	}
	h := heap[:0]
	for id := range logits {
		t := int32(id)
		if len(h) < n {
			h = append(h, t)
			for i := len(h) - 1; i > 0; {
				parent := (i - 1) / 2
				if !better(h[parent], h[i]) {
					break
				}
				h[i], h[parent] = h[parent], h[i]
				i = parent
			}
			continue
		}
		if better(t, h[0]) {
			h[0] = t
			down(h, 0)
		}
	}
	slices.SortFunc(h, func(a, b int32) int {
		switch {
		case a == b:
			return 0
		case better(a, b):
			return -1
		}
		return 1
	})
	return h
}

// mix64 is the SplitMix64 finaliser: it spreads nearby seeds and indices
// over the whole generator state.
func mix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}
