package cuda

import (
	"slices"
	"testing"
	"time"
)

// TestPickSplits: another count than fmaSplits' replaces it only when its
// pass is faster by more than tuneOSplitsMargin (0.5%), the fastest such.
func TestPickSplits(t *testing.T) {
	// trials: passes of 1, 2, 4, ... warps a unit, us.
	trials := func(us ...float64) []SplitsTrial {
		var tr []SplitsTrial
		for i, v := range us {
			tr = append(tr, SplitsTrial{Splits: 1 << i, Time: time.Duration(v * 1e3)})
		}
		return tr
	}
	for _, tc := range []struct {
		name  string
		def   int
		tried []SplitsTrial
		want  int
	}{
		// The whole check of phase 14: 1B 1: 811, 2: 802, 4: 812 us.
		{"1B: 2 beats 4 by 1.2%", 4, trials(811, 802, 812), 2},
		// 8B: 1: 4227, 2: 4099, 4: 4125, 8: 4173; fmaSplits' own 2.
		{"8B: the default is fastest", 2, trials(4227, 4099, 4125, 4173), 2},
		{"faster by under the margin", 4, trials(900, 809, 812), 4},
		{"the fastest of several past the margin", 8, trials(700, 650, 690, 1000), 2},
		{"only the default tried", 1, trials(800), 1},
	} {
		if !slices.ContainsFunc(tc.tried, func(tr SplitsTrial) bool { return tr.Splits == tc.def }) {
			t.Fatalf("%s: the default %d is not among the counts tried", tc.name, tc.def)
		}
		if got := pickSplits(tc.def, tc.tried); got != tc.want {
			t.Errorf("%s: %d warps a unit, want %d", tc.name, got, tc.want)
		}
	}
}
