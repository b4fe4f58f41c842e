package cuda

import (
	"slices"
	"testing"
)

func TestWarmRows(t *testing.T) {
	for _, tc := range []struct {
		from, to, step int
		want           []int
	}{
		{512, 2048, 64, nil}, // filled below: 576, 640, ..., 2048
		{512, 1000, 64, []int{576, 640, 704, 768, 832, 896, 960, 1000}},
		{500, 512, 64, []int{512}},
		{512, 512, 64, nil},
		{600, 500, 64, nil},
		{0, 20, 8, []int{8, 16, 20}},
		{0, 8, 8, []int{8}},
		{0, 1, 8, []int{1}},
	} {
		want := tc.want
		if tc.from == 512 && tc.to == 2048 {
			for m := 576; m <= 2048; m += 64 {
				want = append(want, m)
			}
		}
		if got := warmRows(tc.from, tc.to, tc.step); !slices.Equal(got, want) {
			t.Errorf("warmRows(%d, %d, %d) = %v, want %v", tc.from, tc.to, tc.step, got, want)
		}
	}
}

func TestGemmShapesPad(t *testing.T) {
	var g gemmShapes
	if got := g.pad(2048, 3072, 100); got != 100 {
		t.Fatalf("empty: pad(100) = %d, want 100", got)
	}
	// Recorded out of order and twice; another product's rows apart.
	for _, r := range []int{512, 8, 1, 576, 2048, 8, 640} {
		g.record(2048, 3072, r)
	}
	g.record(8192, 2048, 4)
	if want := []int{1, 8, 512, 576, 640, 2048}; !slices.Equal(g.rows[[2]int{2048, 3072}], want) {
		t.Fatalf("recorded %v, want %v", g.rows[[2]int{2048, 3072}], want)
	}
	for _, tc := range []struct{ in, out, rows, want int }{
		{2048, 3072, 1, 1},
		{2048, 3072, 2, 8},
		{2048, 3072, 8, 8},
		{2048, 3072, 513, 576},
		{2048, 3072, 600, 640},
		{2048, 3072, 1985, 2048},
		{2048, 3072, 2049, 2049}, // past every warmed shape: as asked
		{8192, 2048, 3, 4},
		{8192, 2048, 5, 5},
		{2048, 2048, 5, 5}, // a product never recorded
	} {
		if got := g.pad(tc.in, tc.out, tc.rows); got != tc.want {
			t.Errorf("pad(%d -> %d, %d rows) = %d, want %d", tc.in, tc.out, tc.rows, got, tc.want)
		}
	}
}
