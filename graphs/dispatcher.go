package graphs

import (
	"fmt"
	"slices"
)

// Config configures a Dispatcher.
type Config struct {
	// Mode is the mode after Resolve: what every stage supports. The zero
	// Mode is None; say DefaultMode for the default.
	Mode Mode
	// CaptureSizes are the token counts to capture graphs for, ascending;
	// nil means DefaultCaptureSizes(MaxCaptureSize).
	CaptureSizes []int
	// MaxCaptureSize bounds CaptureSizes; 0 means the largest of
	// CaptureSizes, or DefaultMaxCaptureSize when CaptureSizes is nil.
	// Batches past the largest capture size run eagerly.
	MaxCaptureSize int
	// UniformDecodeQueryLen is the tokens per request of a uniform decode
	// batch: 1, or 1 + the speculative tokens; 0 means 1. Full decode
	// graphs exist only at capture sizes that are multiples of it, so with
	// speculative decoding choose such sizes: the defaults have few.
	UniformDecodeQueryLen int
	// MaxNumSeqs bounds the requests of a uniform decode graph (the
	// stages' most sequences per batch); 0 means no bound.
	MaxNumSeqs int
}

// Dispatcher picks, for each step, the runtime mode and the graph
// descriptor from the keys it was built with; those keys are the only
// graphs stages capture.
type Dispatcher struct {
	mode  Mode
	q     int
	sizes []int
	// pad pads every batch's token count; decodePad pads uniform decode
	// batches to the capture sizes that have a full decode key (0 where
	// none does).
	pad, decodePad PaddingTable
	// mixed is the runtime mode of a batch within the capture sizes that
	// has no full decode key.
	mixed Mode
	keys  []Step
}

// NewDispatcher checks c and builds the dispatcher's keys and padding
// tables.
func NewDispatcher(c Config) (*Dispatcher, error) {
	if !c.Mode.Valid() {
		return nil, fmt.Errorf("graph dispatcher: invalid mode %d", uint8(c.Mode))
	}
	q := c.UniformDecodeQueryLen
	switch {
	case q == 0:
		q = 1
	case q < 0 || q > MaxCaptureSizeLimit:
		return nil, fmt.Errorf("graph dispatcher: uniform decode query length %d out of range [1, %d]", q, MaxCaptureSizeLimit)
	}
	if c.MaxNumSeqs < 0 {
		return nil, fmt.Errorf("graph dispatcher: max num seqs %d, want at least 0", c.MaxNumSeqs)
	}
	maxSize, sizes := c.MaxCaptureSize, c.CaptureSizes
	switch {
	case maxSize == 0 && sizes == nil:
		maxSize = DefaultMaxCaptureSize
	case maxSize == 0:
		if len(sizes) == 0 {
			return nil, fmt.Errorf("graph dispatcher: no capture sizes")
		}
		maxSize = slices.Max(sizes)
	}
	if sizes == nil {
		sizes = DefaultCaptureSizes(maxSize)
	}
	if err := ValidateCaptureSizes(sizes, maxSize); err != nil {
		return nil, fmt.Errorf("graph dispatcher: %w", err)
	}
	d := &Dispatcher{mode: c.Mode, q: q, sizes: slices.Clone(sizes)}
	var err error
	if d.pad, err = NewPaddingTable(d.sizes); err != nil {
		return nil, fmt.Errorf("graph dispatcher: %w", err)
	}
	if c.Mode.DecodeMode() == Full {
		var decode []int
		for _, s := range d.sizes {
			if s%q == 0 && (c.MaxNumSeqs == 0 || s/q <= c.MaxNumSeqs) {
				decode = append(decode, s)
			}
		}
		if len(decode) == 0 {
			bound := ""
			if c.MaxNumSeqs > 0 {
				bound = fmt.Sprintf(" of at most %d requests", c.MaxNumSeqs)
			}
			return nil, fmt.Errorf("graph dispatcher: mode %s: no capture size is a multiple of the uniform decode query length %d%s, so no full decode graph could be used", c.Mode, q, bound)
		}
		if d.decodePad, err = NewPaddingTable(decode); err != nil {
			return nil, fmt.Errorf("graph dispatcher: %w", err)
		}
		for _, s := range slices.Backward(decode) {
			d.keys = append(d.keys, Step{Full, BatchDescriptor{NumTokens: s, NumReqs: s / q, UniformDecode: true, QueryLen: q}})
		}
	}
	d.mixed = c.Mode.MixedMode()
	if d.mixed != None {
		for _, s := range slices.Backward(d.sizes) {
			d.keys = append(d.keys, Step{d.mixed, BatchDescriptor{NumTokens: s}})
		}
	}
	return d, nil
}

// Mode is the configured mode.
func (d *Dispatcher) Mode() Mode { return d.mode }

// CaptureSizes are the token counts graphs are captured for.
func (d *Dispatcher) CaptureSizes() []int { return slices.Clone(d.sizes) }

// MaxCaptureSize is the largest capture size: larger batches run eagerly.
func (d *Dispatcher) MaxCaptureSize() int { return d.pad.Max() }

// UniformDecodeQueryLen is the tokens per request of a uniform decode
// batch.
func (d *Dispatcher) UniformDecodeQueryLen() int { return d.q }

// Keys lists every graph stages must capture, in capture order: full
// uniform decode graphs, then full graphs of mixed batches (mode Full) or
// piecewise graphs, each largest first.
func (d *Dispatcher) Keys() []Step { return slices.Clone(d.keys) }

// Dispatch picks the runtime mode and descriptor of a batch of numTokens
// tokens from numReqs requests; uniformDecode says every request decodes
// UniformDecodeQueryLen tokens, and counts only when numTokens is
// numReqs times that. The priority is a full uniform decode graph, then a
// full graph of mixed batches (mode Full), then a piecewise graph, each
// on the token count padded to a capture size; a batch that none fits,
// larger than every capture size for one, runs eagerly: None, with the
// unpadded token count.
func (d *Dispatcher) Dispatch(numTokens int, uniformDecode bool, numReqs int) (Mode, BatchDescriptor) {
	if uniformDecode && numTokens == numReqs*d.q {
		if p := d.decodePad.Pad(numTokens); p != 0 {
			return Full, BatchDescriptor{NumTokens: p, NumReqs: p / d.q, UniformDecode: true, QueryLen: d.q}
		}
	}
	if p := d.pad.Pad(numTokens); p != 0 && d.mixed != None {
		return d.mixed, BatchDescriptor{NumTokens: p}
	}
	return None, BatchDescriptor{NumTokens: numTokens}
}
