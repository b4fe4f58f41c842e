package cuda

import (
	"fmt"
	"slices"

	"github.com/tandem-llm/tandem/gpu"
)

// cuBLAS spends milliseconds of host time on the first product of a shape
// it has not seen: measured on one H200 (NOTES.md, phase 25), the first
// eager step of a decode row and 31 prompts of 64 tokens (1,985 rows, 1B
// shape) took 17.8 ms of GPU time against 8.5 for the next ones, and 17.4
// with every kernel module loaded up front (CUDA_MODULE_LOADING=EAGER), so
// the cost is the shape's, not a kernel's first load. For 1B the host's
// share outruns the short kernels and the device waits for it.
//
// So Capture records the rows each product ran with in its warm-ups and
// captures, warms up the shapes eager steps past the largest key reach
// (warmEager), and after it linear pads a product's rows up to the
// smallest warmed count at or above them. The padding rows compute from
// whatever the input buffer holds past the step's rows, into output rows
// no kernel reads; the buffers hold the padded rows (planWorkspace: twice
// the stage's tokens for the layers' products, MaxLogitRows logits rows).
const (
	// eagerRowStep is the layer products' rows warmed past the largest
	// key: every multiple up to the most an eager step can have (24
	// shapes from 512 to 2,048 rows).
	eagerRowStep = 64
	// headRowStep is the LM head's rows warmed: every multiple up to
	// MaxLogitRows (the default capture sizes warm most of them already).
	headRowStep = 8
)

// gemmShapes are the row counts each cuBLAS product, by its weight's in
// and out features, has run with. The zero value is empty.
type gemmShapes struct {
	rows map[[2]int][]int // ascending, without repeats
}

// record notes that the product in -> out ran with rows rows.
func (g *gemmShapes) record(in, out, rows int) {
	if g.rows == nil {
		g.rows = map[[2]int][]int{}
	}
	k := [2]int{in, out}
	r := g.rows[k]
	if i, found := slices.BinarySearch(r, rows); !found {
		g.rows[k] = slices.Insert(r, i, rows)
	}
}

// has reports whether the product in -> out ran with rows rows.
func (g *gemmShapes) has(in, out, rows int) bool {
	_, found := slices.BinarySearch(g.rows[[2]int{in, out}], rows)
	return found
}

// pad is the rows the product in -> out of rows rows runs with: the
// smallest recorded count at or above rows, else rows.
func (g *gemmShapes) pad(in, out, rows int) int {
	r := g.rows[[2]int{in, out}]
	if i, _ := slices.BinarySearch(r, rows); i < len(r) {
		return r[i]
	}
	return rows
}

// warmRows is the row counts past from up to to that warmEager runs a
// product with: every multiple of step, and to.
func warmRows(from, to, step int) []int {
	var rows []int
	for m := (from/step + 1) * step; m < to; m += step {
		rows = append(rows, m)
	}
	if to > from {
		rows = append(rows, to)
	}
	return rows
}

// warmEager runs, after Capture's keys (the largest with maxKey tokens),
// each cuBLAS product of the stage's layers at every multiple of
// eagerRowStep past maxKey (and the most rows an eager step gives it)
// and, on the last stage, the LM head at every multiple of headRowStep up
// to MaxLogitRows that gemvh does not take (each shape the keys did not
// run already), so that linear's padding finds them warm. Their outputs
// go to the products' own buffers and are never read. Device goroutine
// only, while Capture records.
func (s *Stage) warmEager(maxKey int) error {
	m := &s.m
	H, I := m.HiddenSize, m.IntermediateSize
	lay := s.pl.lay
	// The most rows a step past the largest key gives a product: its
	// tokens, and as many remainder rows where it is compensated.
	maxRows := 0
	for T := maxKey + 1; T <= lay.maxTokens; T++ {
		maxRows = max(maxRows, T+s.remainders(T))
	}
	// warm runs a product at rows unless the keys ran it so already.
	warm := func(label string, y, x, w gpu.DevicePtr, rows, in, out int) error {
		if s.g.gemm.has(in, out, rows) {
			return nil
		}
		if err := s.linear(label, y, x, w, rows, in, out); err != nil {
			return fmt.Errorf("warm up %s of %d rows: %w", label, rows, err)
		}
		return nil
	}
	if len(s.layers) > 0 {
		lw := s.layers[0]
		// The layer's products as forward.go orders them on cuBLAS.
		prods := []struct {
			label   string
			y, x, w gpu.DevicePtr
			in, out int
		}{
			{"qkv", s.b.qkv, s.b.normed, lw.qkv, H, s.qkvDim},
			{"o", s.b.y, s.b.attnB, lw.o, s.qDim, H},
			{"gate_up", s.b.gateUp, s.b.normed, lw.gateUp, H, 2 * I},
			{"down", s.b.y, s.b.act, lw.down, I, H},
		}
		for _, rows := range warmRows(maxKey, maxRows, eagerRowStep) {
			for _, p := range prods {
				if err := warm(p.label, p.y, p.x, p.w, rows, p.in, p.out); err != nil {
					return err
				}
			}
		}
	}
	if s.last {
		for _, rows := range warmRows(0, lay.maxLogitRows, headRowStep) {
			if s.gemvh(rows) {
				continue // not on cuBLAS
			}
			if err := warm("lm_head", s.b.logits, s.b.normed, s.weights.lmHead, rows, H, m.VocabSize); err != nil {
				return err
			}
		}
	}
	return nil
}
