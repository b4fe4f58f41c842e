package cpu

import (
	"math"
	"sync"
	"sync/atomic"
)

// minParallelWork is the number of multiply-adds below which a product is
// not worth spreading over goroutines.
const minParallelWork = 1 << 16

// parallelRows calls fn on contiguous ranges [lo, hi) covering [0, n), one
// range per goroutine, each range but the last a multiple of align long. It
// returns when every call has returned. work is the total number of
// multiply-adds, to keep small jobs on the calling goroutine.
func (s *Stage) parallelRows(n, align, work int, fn func(lo, hi int)) {
	threads := s.threads
	if work < minParallelWork {
		threads = 1
	}
	blocks := (n + align - 1) / align
	threads = min(threads, blocks)
	if threads <= 1 {
		fn(0, n)
		return
	}
	var wg sync.WaitGroup
	for t := 1; t < threads; t++ {
		lo := min(n, blocks*t/threads*align)
		hi := min(n, blocks*(t+1)/threads*align)
		wg.Go(func() { fn(lo, hi) })
	}
	fn(0, min(n, blocks/threads*align))
	wg.Wait()
}

// parallelItems calls fn(worker, item) for every item in [0, n), spreading
// items dynamically over up to Threads goroutines; worker identifies the
// goroutine (0 ≤ worker < Threads) so fn can use per-worker scratch.
func (s *Stage) parallelItems(n, work int, fn func(worker, item int)) {
	threads := s.threads
	if work < minParallelWork {
		threads = 1
	}
	threads = min(threads, n)
	if threads <= 1 {
		for i := range n {
			fn(0, i)
		}
		return
	}
	var next atomic.Int64
	run := func(worker int) {
		for {
			i := int(next.Add(1) - 1)
			if i >= n {
				return
			}
			fn(worker, i)
		}
	}
	var wg sync.WaitGroup
	for t := 1; t < threads; t++ {
		wg.Go(func() { run(t) })
	}
	run(0)
	wg.Wait()
}

// linear computes, for every row t < rows of x (rows of k values) and every
// row n of w ([N × k]), dst[t·stride+n] = x_t · w_n + bias[n] (bias may be
// nil), or adds that to dst when add is set. Output rows of w are spread over
// the stage's goroutines in blocks of four; every element is summed in the
// same order whatever the number of rows or goroutines.
func (s *Stage) linear(dst []float32, stride int, x []float32, rows, k int, w, bias []float32, add bool) {
	n := len(w) / k
	s.parallelRows(n, 4, rows*n*k, func(lo, hi int) {
		linearRange(dst, stride, x, rows, k, w, bias, add, lo, hi)
	})
}

func linearRange(dst []float32, stride int, x []float32, rows, k int, w, bias []float32, add bool, lo, hi int) {
	n := lo
	for ; n+4 <= hi; n += 4 {
		w0 := w[n*k : (n+1)*k]
		w1 := w[(n+1)*k : (n+2)*k]
		w2 := w[(n+2)*k : (n+3)*k]
		w3 := w[(n+3)*k : (n+4)*k]
		var b0, b1, b2, b3 float32
		if bias != nil {
			b0, b1, b2, b3 = bias[n], bias[n+1], bias[n+2], bias[n+3]
		}
		for t := range rows {
			s0, s1, s2, s3 := dot4(x[t*k:(t+1)*k], w0, w1, w2, w3)
			d := dst[t*stride+n : t*stride+n+4]
			if bias != nil {
				s0, s1, s2, s3 = s0+b0, s1+b1, s2+b2, s3+b3
			}
			if add {
				d[0] += s0
				d[1] += s1
				d[2] += s2
				d[3] += s3
			} else {
				d[0], d[1], d[2], d[3] = s0, s1, s2, s3
			}
		}
	}
	for ; n < hi; n++ {
		wn := w[n*k : (n+1)*k]
		for t := range rows {
			v := dot(x[t*k:(t+1)*k], wn)
			if bias != nil {
				v += bias[n]
			}
			if add {
				dst[t*stride+n] += v
			} else {
				dst[t*stride+n] = v
			}
		}
	}
}

// dot4 returns the dot products of x with four vectors of its length.
func dot4(x, w0, w1, w2, w3 []float32) (float32, float32, float32, float32) {
	n := len(x)
	w0, w1, w2, w3 = w0[:n], w1[:n], w2[:n], w3[:n]
	var a0, a1, a2, a3, c0, c1, c2, c3 float32
	i := 0
	for ; i < n-1; i += 2 {
		x0, x1 := x[i], x[i+1]
		a0 += x0 * w0[i]
		c0 += x1 * w0[i+1]
		a1 += x0 * w1[i]
		c1 += x1 * w1[i+1]
		a2 += x0 * w2[i]
		c2 += x1 * w2[i+1]
		a3 += x0 * w3[i]
		c3 += x1 * w3[i+1]
	}
	if i < n {
		x0 := x[i]
		a0 += x0 * w0[i]
		a1 += x0 * w1[i]
		a2 += x0 * w2[i]
		a3 += x0 * w3[i]
	}
	return a0 + c0, a1 + c1, a2 + c2, a3 + c3
}

// dot returns the dot product of x and y, which must be as long as x.
func dot(x, y []float32) float32 {
	n := len(x)
	y = y[:n]
	var a0, a1, a2, a3 float32
	i := 0
	for ; i < n-3; i += 4 {
		a0 += x[i] * y[i]
		a1 += x[i+1] * y[i+1]
		a2 += x[i+2] * y[i+2]
		a3 += x[i+3] * y[i+3]
	}
	for ; i < n; i++ {
		a0 += x[i] * y[i]
	}
	return (a0 + a1) + (a2 + a3)
}

// axpy adds a·x to y, which must be as long as x.
func axpy(a float32, x, y []float32) {
	y = y[:len(x)]
	for i, v := range x {
		y[i] += a * v
	}
}

// rmsNorm writes x·w/sqrt(mean(x²)+eps) into dst, for one row. The sum of
// squares is accumulated in float64, as accurate as a float32 reduction can
// be rounded.
func rmsNorm(dst, x, w []float32, eps float32) {
	dst, w = dst[:len(x)], w[:len(x)]
	var ss float64
	for _, v := range x {
		ss += float64(v) * float64(v)
	}
	variance := float32(ss / float64(len(x)))
	r := float32(1 / math.Sqrt(float64(variance+eps)))
	for i, v := range x {
		dst[i] = w[i] * (v * r)
	}
}

// silu returns x·sigmoid(x).
func silu(x float32) float32 {
	return x / (1 + float32(math.Exp(float64(-x))))
}
