package graphs

import (
	"slices"
	"strings"
	"testing"
)

func TestDefaultCaptureSizes(t *testing.T) {
	tests := []struct {
		max  int
		want []int
	}{
		{-1, nil},
		{0, nil},
		{1, []int{1}},
		{3, []int{1, 2}},
		{4, []int{1, 2, 4}},
		{7, []int{1, 2, 4}},
		{8, []int{1, 2, 4, 8}},
		{20, []int{1, 2, 4, 8, 16}},
		{33, []int{1, 2, 4, 8, 16, 24, 32}},
	}
	for _, tc := range tests {
		if got := DefaultCaptureSizes(tc.max); !slices.Equal(got, tc.want) {
			t.Errorf("DefaultCaptureSizes(%d) = %v, want %v", tc.max, got, tc.want)
		}
	}
	got := DefaultCaptureSizes(DefaultMaxCaptureSize)
	if len(got) != 3+DefaultMaxCaptureSize/8 || got[len(got)-1] != DefaultMaxCaptureSize {
		t.Errorf("DefaultCaptureSizes(%d): %d sizes ending %d", DefaultMaxCaptureSize, len(got), got[len(got)-1])
	}
}

func TestValidateCaptureSizes(t *testing.T) {
	tests := []struct {
		sizes []int
		max   int
		want  string // error substring; "" for none
	}{
		{[]int{1, 2, 4}, 4, ""},
		{[]int{3}, 100, ""},
		{nil, 8, "no capture sizes"},
		{[]int{0, 1}, 8, "capture size 0 (index 0): want at least 1"},
		{[]int{1, -4}, 8, "capture size -4 (index 1)"},
		{[]int{1, 2, 16}, 8, "capture size 16 (index 2) exceeds the max capture size 8"},
		{[]int{1, 2, 2}, 8, "capture size 2 (index 2) repeats"},
		{[]int{1, 4, 2}, 8, "capture size 2 (index 2) follows 4"},
		{[]int{1}, 0, "max capture size 0 out of range"},
		{[]int{1}, MaxCaptureSizeLimit + 1, "out of range"},
	}
	for _, tc := range tests {
		err := ValidateCaptureSizes(tc.sizes, tc.max)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("ValidateCaptureSizes(%v, %d): %v", tc.sizes, tc.max, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("ValidateCaptureSizes(%v, %d) error = %v, want one containing %q", tc.sizes, tc.max, err, tc.want)
		}
	}
}

// refPad is the smallest size at least n by a scan, or 0.
func refPad(sizes []int, n int) int {
	if n < 1 {
		return 0
	}
	for _, s := range sizes {
		if s >= n {
			return s
		}
	}
	return 0
}

func TestPaddingTable(t *testing.T) {
	for _, sizes := range [][]int{DefaultCaptureSizes(DefaultMaxCaptureSize), {3, 5, 16}, {1}, {7}} {
		tab, err := NewPaddingTable(sizes)
		if err != nil {
			t.Fatalf("NewPaddingTable(%v): %v", sizes, err)
		}
		last := sizes[len(sizes)-1]
		if tab.Max() != last {
			t.Errorf("Max() = %d, want %d", tab.Max(), last)
		}
		for n := -1; n <= last+1; n++ {
			if got, want := tab.Pad(n), refPad(sizes, n); got != want {
				t.Errorf("sizes %v: Pad(%d) = %d, want %d", sizes, n, got, want)
			}
		}
	}
	tab, _ := NewPaddingTable(DefaultCaptureSizes(512))
	for n, want := range map[int]int{0: 0, 1: 1, 3: 4, 5: 8, 9: 16, 17: 24, 500: 504, 512: 512, 513: 0, 1 << 40: 0} {
		if got := tab.Pad(n); got != want {
			t.Errorf("default sizes: Pad(%d) = %d, want %d", n, got, want)
		}
	}
	if _, err := NewPaddingTable(nil); err == nil {
		t.Error("NewPaddingTable(nil): no error")
	}
	if _, err := NewPaddingTable([]int{4, 2}); err == nil || !strings.Contains(err.Error(), "capture size 2") {
		t.Errorf("NewPaddingTable([4 2]) error = %v", err)
	}
	if (PaddingTable{}).Max() != 0 || (PaddingTable{}).Pad(1) != 0 {
		t.Error("empty table pads")
	}
}
