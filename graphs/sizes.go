package graphs

import "fmt"

const (
	// DefaultMaxCaptureSize is the largest token count captured when the
	// configuration names neither capture sizes nor a maximum.
	DefaultMaxCaptureSize = 512
	// MaxCaptureSizeLimit bounds capture sizes, and so the dense padding
	// tables.
	MaxCaptureSizeLimit = 1 << 16
)

// DefaultCaptureSizes are the token counts to capture graphs for, up to
// maxSize: 1, 2, 4, then every multiple of 8. It is empty when maxSize < 1.
func DefaultCaptureSizes(maxSize int) []int {
	var sizes []int
	for _, s := range []int{1, 2, 4} {
		if s <= maxSize {
			sizes = append(sizes, s)
		}
	}
	for s := 8; s <= maxSize; s += 8 {
		sizes = append(sizes, s)
	}
	return sizes
}

// ValidateCaptureSizes checks that sizes is not empty, ascending without
// repeats, and within [1, maxSize]; the error names the first bad value.
func ValidateCaptureSizes(sizes []int, maxSize int) error {
	if maxSize < 1 || maxSize > MaxCaptureSizeLimit {
		return fmt.Errorf("max capture size %d out of range [1, %d]", maxSize, MaxCaptureSizeLimit)
	}
	if len(sizes) == 0 {
		return fmt.Errorf("no capture sizes")
	}
	for i, s := range sizes {
		switch {
		case s < 1:
			return fmt.Errorf("capture size %d (index %d): want at least 1", s, i)
		case s > maxSize:
			return fmt.Errorf("capture size %d (index %d) exceeds the max capture size %d", s, i, maxSize)
		case i > 0 && s == sizes[i-1]:
			return fmt.Errorf("capture size %d (index %d) repeats", s, i)
		case i > 0 && s < sizes[i-1]:
			return fmt.Errorf("capture size %d (index %d) follows %d: sizes must ascend", s, i, sizes[i-1])
		}
	}
	return nil
}

// PaddingTable pads token counts to capture sizes in one lookup: entry n
// is the smallest capture size at least n. It covers 0 to the largest
// size; entry 0 is 0.
type PaddingTable []int

// NewPaddingTable makes the table of sizes, which must pass
// ValidateCaptureSizes with their largest value as the max.
func NewPaddingTable(sizes []int) (PaddingTable, error) {
	if len(sizes) == 0 {
		return nil, fmt.Errorf("padding table: no capture sizes")
	}
	if err := ValidateCaptureSizes(sizes, sizes[len(sizes)-1]); err != nil {
		return nil, fmt.Errorf("padding table: %w", err)
	}
	t := make(PaddingTable, sizes[len(sizes)-1]+1)
	n := 1
	for _, s := range sizes {
		for ; n <= s; n++ {
			t[n] = s
		}
	}
	return t, nil
}

// Pad is the smallest capture size at least n, or 0 when n < 1 or n
// exceeds the largest size.
func (t PaddingTable) Pad(n int) int {
	if uint(n) >= uint(len(t)) {
		return 0
	}
	return t[n]
}

// Max is the largest capture size (0 for an empty table).
func (t PaddingTable) Max() int {
	if len(t) == 0 {
		return 0
	}
	return t[len(t)-1]
}
