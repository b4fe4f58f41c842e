package cuda

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/graphs"
)

// SkinnyChoice is what a stage measured when it chose how many token rows
// its skinny kernels take (Config.SkinnyTokens 0, tensor cores): per
// size tried, the device time of a forward pass on the skinny kernels and
// on cuBLAS, and how far apart their outputs were.
type SkinnyChoice struct {
	// MaxTokens is the choice: steps of at most that many rows run on the
	// skinny kernels.
	MaxTokens int
	Tried     []SkinnyTrial
	// OSplits is how many warps share a unit of the attention output
	// product (o) on the fp32 kernels, chosen by measurement
	// (tuneOSplits; 0 when nothing was measured: fmaSplits' count);
	// OTried the passes timed for each count.
	OSplits int
	OTried  []SplitsTrial
}

// SplitsTrial is one count of warps a unit tried: the device time of a
// replayed one-row pass with it.
type SplitsTrial struct {
	Splits int
	Time   time.Duration
}

// SkinnyTrial is one size tried.
type SkinnyTrial struct {
	Tokens         int
	Skinny, CuBLAS time.Duration
	// RelDiff is the relative L2 distance between the two passes'
	// outputs (residual stream and logits).
	RelDiff float64
}

// tuneTol bounds the relative distance between the skinny kernels' and
// cuBLAS's outputs for the skinny kernels to be used: both carry the
// activations to about 16 bits, so they agree far closer than this.
const tuneTol = 1e-2

// tuneSpin holds the stream busy before each timed replay, so that the
// device starts it only once the host has queued it.
const tuneSpin = 5 * time.Millisecond

// Skinny reports the choice the stage made (zero when it made none: a
// fixed Config.SkinnyTokens, or no tensor cores).
func (s *Stage) Skinny() SkinnyChoice { return s.skinnyChoice }

// tuneSizes are the step sizes tuneSkinny measures, in order.
var tuneSizes = []int{4, 8, 16, 32}

// tuneSkinny narrows the plan's skinny steps by measurement, once the o
// product's splits are chosen (tuneOSplits). It runs passes of padding rows
// (padPass) on the skinny kernels and on cuBLAS: first at the fp32 kernels'
// largest step (2 rows; cuBLAS taking it, its small products on gemvs),
// which goes to cuBLAS if cuBLAS is faster there and agrees with them, and
// nothing larger is tried; then at 4, 8, 16 and 32 rows (those the plan
// takes), keeping the skinny kernels up to the largest size at which they,
// and they at every smaller size tried, were faster and agreed with cuBLAS.
// Steps of one row always run on the fp32 kernels. Measured on one H200:
// gemv.cu's kernels lose to cuBLAS from 4 rows (a pass of 4 rows 1.63
// against 1.26 ms on the 1B shape, 6.90 against 5.23 on the 8B, eager);
// with its small products on gemvs the cuBLAS path's pass of 2 rows beats
// the fp32 kernels' (1B 0.98 against 1.05 ms, 8B 4.53 against 5.10,
// replayed; NOTES.md, phase 13).
// Device goroutine only, before any step.
func (s *Stage) tuneSkinny() (err error) {
	top := s.sk.maxTokens
	s.sk.tune = false
	choice := SkinnyChoice{MaxTokens: s.sk.fmaTokens}
	defer func() {
		if err != nil {
			return
		}
		s.sk.maxTokens = choice.MaxTokens
		s.skinnyChoice = choice
		for _, tr := range choice.Tried {
			s.log.Info("cuda stage: skinny kernels against cuBLAS", "layers", fmt.Sprintf("[%d,%d)", s.lo, s.hi), "tokens", tr.Tokens,
				"skinny", tr.Skinny, "cublas", tr.CuBLAS, "rel_diff", tr.RelDiff)
		}
		for _, tr := range choice.OTried {
			s.log.Info("cuda stage: warps a unit of the o product", "layers", fmt.Sprintf("[%d,%d)", s.lo, s.hi), "splits", tr.Splits,
				"pass", tr.Time)
		}
		s.log.Info("cuda stage: skinny kernels chosen", "layers", fmt.Sprintf("[%d,%d)", s.lo, s.hi), "max_tokens", choice.MaxTokens,
			"o_splits", choice.OSplits)
	}()
	if err := s.tuneOSplits(&choice); err != nil {
		return fmt.Errorf("measure the o product's splits: %w", err)
	}
	if f := s.sk.fmaTokens; f > 1 && f <= s.pl.lay.maxTokens && f <= s.pl.kv.blocks {
		tr, err := s.trySkinny(f, f-1)
		if err != nil {
			return fmt.Errorf("measure the fp32 kernels at %d tokens: %w", f, err)
		}
		choice.Tried = append(choice.Tried, tr)
		if tr.CuBLAS < tr.Skinny && tr.RelDiff <= tuneTol {
			choice.MaxTokens = f - 1
			return nil
		}
	}
	for _, T := range tuneSizes {
		if T <= s.sk.fmaTokens {
			continue
		}
		if T > top || T > s.pl.lay.maxTokens || T > s.pl.kv.blocks {
			break
		}
		tr, err := s.trySkinny(T, s.sk.fmaTokens)
		if err != nil {
			return fmt.Errorf("measure the skinny kernels at %d tokens: %w", T, err)
		}
		choice.Tried = append(choice.Tried, tr)
		if !(tr.Skinny < tr.CuBLAS && tr.RelDiff <= tuneTol) {
			break
		}
		choice.MaxTokens = T
	}
	return nil
}

// trySkinny times and compares the two paths on T padding rows: the
// skinny kernels, and cuBLAS with the skinny kernels limited to below
// (< T) rows. Device goroutine only.
func (s *Stage) trySkinny(T, below int) (SkinnyTrial, error) {
	tr := SkinnyTrial{Tokens: T}
	f, sh, err := s.padPass(T)
	if err != nil {
		return tr, err
	}
	defer s.unpad(f, sh)
	H := s.m.HiddenSize
	saved := s.sk.maxTokens
	defer func() { s.sk.maxTokens = saved }()
	var outs [2][]float32
	for i, limit := range []int{T, below} {
		s.sk.maxTokens = limit
		// Warm-up, and the output compared.
		if err := s.forwardPass(graphs.Step{}, sh); err != nil {
			return tr, err
		}
		out := make([]float32, T*H+sh.rows*s.m.VocabSize)
		if err := gpu.CopyDtoHAsync(gpu.AsBytes(out[:T*H]), s.b.resid, s.stream); err != nil {
			return tr, err
		}
		if sh.rows > 0 {
			if err := gpu.CopyDtoHAsync(gpu.AsBytes(out[T*H:]), s.b.logits, s.stream); err != nil {
				return tr, err
			}
		}
		if err := s.stream.Synchronize(); err != nil {
			return tr, err
		}
		outs[i] = out
		best, err := s.timeReplay(f, sh)
		if err != nil {
			return tr, err
		}
		if i == 0 {
			tr.Skinny = best
		} else {
			tr.CuBLAS = best
		}
	}
	tr.RelDiff = relDistance(outs[0], outs[1])
	return tr, nil
}

// padPass readies a pass of T padding rows (distinct tokens, or distinct
// activations on a later stage, each row its own sequence with a KV block
// of its own) in the oldest flight: its description on the device, the
// shape to run. unpad undoes it. Device goroutine only.
func (s *Stage) padPass(T int) (*flight, shape, error) {
	lay := s.pl.lay
	f := &s.fl[s.oldest]
	sh := shape{tokens: T, decode: true} // each padding row its own sequence, as in decode steps
	if s.last {
		sh.rows = min(T, lay.maxLogitRows)
	}
	s.pl.padding(&f.p, sh)
	w := f.p.words
	bs := s.pl.kv.blockSize
	for r := 0; r < T; r++ {
		if s.first {
			w[lay.tokens()+r] = int32((r*7919 + 13) % s.m.VocabSize)
		}
		w[lay.tables()+1+r] = int32(r)
		w[lay.tableOff()+r] = int32(1 + r)
		w[lay.cacheRow()+r] = int32(r * bs)
	}
	for r := 0; r < sh.rows; r++ {
		w[lay.logitRows()+r] = int32(r)
	}
	// Scratch block back in word 0 for the steps to come.
	if err := gpu.CopyHtoDAsync(s.b.batch, f.hostBatch[:4*lay.words()], s.stream); err != nil {
		return f, sh, err
	}
	H := s.m.HiddenSize
	if !s.first {
		in := make([]float32, T*H)
		for r := 0; r < T; r++ {
			for i := 0; i < H; i++ {
				in[r*H+i] = float32(0.5 * math.Sin(0.37*float64(i)+1.3*float64(r)))
			}
		}
		if err := gpu.CopyHtoDAsync(s.b.in, gpu.AsBytes(in), s.stream); err != nil {
			return f, sh, err
		}
	}
	return f, sh, nil
}

// unpad writes the padding's description of f again, scratch rows and
// all, after a pass padPass readied. Device goroutine only.
func (s *Stage) unpad(f *flight, sh shape) {
	s.pl.padding(&f.p, sh)
	for r := 0; r < sh.tokens; r++ {
		f.p.words[s.pl.lay.tables()+1+r] = 0
	}
}

// tuneOSplitsMargin is how much faster than fmaSplits' count another
// count of warps a unit of the o product must make a pass to replace it.
const tuneOSplitsMargin = 0.005

// tuneOSplits chooses how many warps share a unit of the o product on the
// fp32 kernels (one- and two-row steps) by timing a replayed one-row pass
// with each count gemvf can take. fmaSplits' count fills every resident
// warp slot; a smaller one leaves slots free, where the gate|up product's
// blocks start as dependents while o runs and load their first weights
// before their wait. Measured on one H200 (NOTES.md, phase 14): the 1B
// shape's o on 2 warps a unit (128 blocks) instead of 4 (256) took 5.1 us
// a layer instead of 2.7 and its gate|up 16.3 instead of 19.6: the step
// 0.838 -> 0.823 ms; the 8B shape's o (33.5 MB, not one burst a warp) on
// 1 instead of 2 lost (4.163 -> 4.289 ms). Another count replaces
// fmaSplits' only when its pass is faster by more than tuneOSplitsMargin.
// Device goroutine only, before any step.
func (s *Stage) tuneOSplits(choice *SkinnyChoice) error {
	c := &s.sk.o.fma
	info := s.dev.Info()
	def := c.fmaSplits(info.SMs, info.MaxSharedPerBlockOptin)
	counts := c.splitCounts()
	if len(counts) < 2 || s.sk.fmaTokens < 1 || s.pl.kv.blocks < 1 {
		return nil
	}
	f, sh, err := s.padPass(1)
	if err != nil {
		return err
	}
	defer s.unpad(f, sh)
	for _, ks := range counts {
		c.ks = ks
		d, err := s.timeReplay(f, sh)
		if err != nil {
			c.ks = 0
			return fmt.Errorf("%d warps a unit: %w", ks, err)
		}
		choice.OTried = append(choice.OTried, SplitsTrial{Splits: ks, Time: d})
	}
	best := pickSplits(def, choice.OTried)
	c.ks, choice.OSplits = best, best
	return nil
}

// pickSplits is the count among tried whose pass beat def's by more than
// tuneOSplitsMargin, the fastest of them, else def (also when def was not
// tried).
func pickSplits(def int, tried []SplitsTrial) int {
	var defTime time.Duration
	for _, tr := range tried {
		if tr.Splits == def {
			defTime = tr.Time
		}
	}
	best, bar := def, time.Duration(float64(defTime)*(1-tuneOSplitsMargin))
	for _, tr := range tried {
		if tr.Splits != def && tr.Time < bar {
			best, bar = tr.Splits, tr.Time
		}
	}
	return best
}

// timeReplay captures one pass of shape sh into a graph and times its
// replays, the best of three, as decode steps run. Passes ordered eagerly
// misjudged the 1B shape's 2-row steps: on two H200s its fp32 kernels took
// 1.072 and 1.089 ms eagerly, the cuBLAS path 1.128 and 1.074, while
// replayed they took 1.049 against 0.983 (NOTES.md, phase 13). Device
// goroutine only.
func (s *Stage) timeReplay(f *flight, sh shape) (time.Duration, error) {
	exec, _, err := s.captureExec(func() error { return s.forwardPass(graphs.Step{}, sh) })
	if err != nil {
		return 0, fmt.Errorf("trial pass: %w", err)
	}
	best := time.Duration(math.MaxInt64)
	for range 3 {
		if err = s.spin(tuneSpin); err != nil {
			break
		}
		if err = f.events[0].Record(s.stream); err != nil {
			break
		}
		if err = exec.Launch(s.stream); err != nil {
			break
		}
		if err = f.events[1].Record(s.stream); err != nil {
			break
		}
		if err = f.events[1].Synchronize(); err != nil {
			break
		}
		var d time.Duration
		if d, err = gpu.Elapsed(f.events[0], f.events[1]); err != nil {
			break
		}
		best = min(best, d)
	}
	return best, errors.Join(err, exec.Destroy())
}

// relDistance is ‖a−b‖/‖b‖, +Inf when either holds a NaN or an infinity.
func relDistance(a, b []float32) float64 {
	var num, den float64
	for i := range a {
		x, y := float64(a[i]), float64(b[i])
		if math.IsNaN(x) || math.IsInf(x, 0) || math.IsNaN(y) || math.IsInf(y, 0) {
			return math.Inf(1)
		}
		num += (x - y) * (x - y)
		den += y * y
	}
	if den == 0 {
		if num == 0 {
			return 0
		}
		return math.Inf(1)
	}
	return math.Sqrt(num / den)
}
