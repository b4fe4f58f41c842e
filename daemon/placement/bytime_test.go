package placement

import (
	"slices"
	"strings"
	"testing"
	"time"
)

func TestByTime(t *testing.T) {
	us := func(n float64) time.Duration { return time.Duration(n * float64(time.Microsecond)) }
	two := func(lo0, hi0 int, b0 float64, hi1 int, b1 float64) []StageTime {
		return []StageTime{{"gpu0", lo0, hi0, us(b0)}, {"gpu1", hi0, hi1, us(b1)}}
	}
	tests := []struct {
		name   string
		stages []StageTime
		want   []int // layer counts
		layer  time.Duration
		head   time.Duration
		same   bool
	}{
		// One H200, 64 sequences (TestSplitDecodeTiming): the halves of the
		// Llama-3.2-1B shape take 679 and 851 µs, of the 8B shape 2979 and
		// 3288 µs.
		{"1B halves", two(0, 8, 679, 16, 851), []int{9, 7}, us(84.875), us(172), false},
		{"8B halves", two(0, 16, 2979, 32, 3288), []int{17, 15}, us(186.1875), us(3288) - 16*us(186.1875), false},
		// The two-H200 trace: 782 and 953 µs for 8 and 8 layers.
		{"1B pipeline", two(0, 8, 782, 16, 953), []int{9, 7}, us(97.75), us(171), false},
		{"balanced already", two(0, 9, 765, 16, 766), []int{9, 7}, us(85), us(171), true},
		// A last stage no slower than its layers: the head costs nothing,
		// and the layers split evenly, the earlier stage taking the odd one.
		{"no head", two(0, 3, 300, 7, 380), []int{4, 3}, us(100), 0, false},
		{"three stages", []StageTime{{"a", 0, 4, us(400)}, {"b", 4, 8, us(400)}, {"c", 8, 12, us(700)}}, []int{5, 5, 2}, us(100), us(300), false},
		// Every stage keeps a layer however slow the head.
		{"heavy head", two(0, 1, 100, 2, 5000), []int{1, 1}, us(100), us(4900), true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			fit, err := ByTime(tc.stages)
			if err != nil {
				t.Fatal(err)
			}
			var counts []int
			for i, r := range fit.After {
				counts = append(counts, r.Hi-r.Lo)
				if r.Node != tc.stages[i].Node || (i > 0 && r.Lo != fit.After[i-1].Hi) || (i == 0 && r.Lo != 0) {
					t.Fatalf("ranges %v: not contiguous over the same nodes", fit.After)
				}
			}
			if !slices.Equal(counts, tc.want) {
				t.Errorf("layers %v, want %v", counts, tc.want)
			}
			if fit.Layer != tc.layer || fit.Head != tc.head {
				t.Errorf("layer %v head %v, want %v and %v", fit.Layer, fit.Head, tc.layer, tc.head)
			}
			if fit.Unchanged() != tc.same {
				t.Errorf("unchanged %v, want %v", fit.Unchanged(), tc.same)
			}
			// Independent check: no other split of the layers has a slower
			// stage faster than the plan's, by the same model.
			if best := bruteForce(fit.Layer, fit.Head, len(tc.stages), tc.stages[len(tc.stages)-1].Hi); Slowest(fit.Predicted) != best {
				t.Errorf("predicted slowest %v, the best split gives %v", Slowest(fit.Predicted), best)
			}
		})
	}
}

// bruteForce is the smallest slowest-stage time over every split of layers
// into p non-empty contiguous stages, the last carrying head.
func bruteForce(layer, head time.Duration, p, layers int) time.Duration {
	if p == 1 {
		return time.Duration(layers)*layer + head
	}
	best := time.Duration(1 << 62)
	for n := 1; n <= layers-(p-1); n++ {
		best = min(best, max(time.Duration(n)*layer, bruteForce(layer, head, p-1, layers-n)))
	}
	return best
}

func TestByTimeRefuses(t *testing.T) {
	for _, tc := range []struct {
		name   string
		stages []StageTime
		want   string
	}{
		{"one stage", []StageTime{{"a", 0, 4, time.Second}}, "two stages or more"},
		{"no time", []StageTime{{"a", 0, 2, time.Second}, {"b", 2, 4, 0}}, "stage 1 (b) has measured no time"},
		{"gap", []StageTime{{"a", 0, 2, time.Second}, {"b", 3, 4, time.Second}}, "holds [3,4), want a non-empty range from 2"},
	} {
		if _, err := ByTime(tc.stages); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error containing %q", tc.name, err, tc.want)
		}
	}
}
