package cuda

import (
	"strings"
	"testing"
)

// TestTimelineReport checks tlGroup and tlReport on a made-up step: a
// norm of 2 blocks, gemvs of 3 (a dependent launch: its blocks start
// early and wait), a gap where cuBLAS ran, a silu of 2 and the next norm.
func TestTimelineReport(t *testing.T) {
	rec := func(tag, grid, block int, start, wait, end int64) blockRecord {
		return blockRecord{tag: tag, grid: grid, block: block, start: start, wait: wait, mark: wait, end: end}
	}
	recs := []blockRecord{
		rec(tlGemvs, 3, 2, 1500, 1500, 4000), // started early, waited for the norm
		rec(tlNorm, 2, 0, 1000, 0, 900),
		rec(tlNorm, 2, 1, 1100, 0, 1000), // the norm ends at 2100
		rec(tlGemvs, 3, 0, 1200, 1000, 3000),
		rec(tlGemvs, 3, 1, 1300, 900, 3500), // gemvs: first wait 2200, last end 5500
		rec(tlSilu, 2, 0, 9500, 0, 500),     // 4 us after gemvs: cuBLAS
		rec(tlSilu, 2, 1, 9600, 0, 600),     // silu ends at 10200
		rec(tlNorm, 2, 0, 10400, 0, 1000),
		rec(tlNorm, 2, 1, 10500, 0, 1000), // the second norm: wait 10400, end 11500
	}
	for i := range recs {
		if recs[i].tag == tlGemvs {
			recs[i].mark += 100 // its rows staged 100 ns after its wait
		}
	}
	ks := tlGroup(recs)
	var names []string
	for _, k := range ks {
		names = append(names, k.name)
		if len(k.rs) != k.rs[0].grid {
			t.Errorf("%s: %d records of a grid of %d", k.name, len(k.rs), k.rs[0].grid)
		}
	}
	if got := strings.Join(names, " "); got != "norm gemvs silu norm" {
		t.Fatalf("kernels %q, want norm gemvs silu norm", got)
	}
	r := tlReport(ks)
	for _, want := range []string{
		"norm                       2        2        1.10      2.2       0.00", // 1000 -> 2100, 10400 -> 11500
		"gemvs                      1        3        3.30      3.3       0.10", // 2200 -> 5500; marks 100 after waits
		"silu                       1        2        0.70      0.7       0.00", // 9500 -> 10200
		"gemvs -> silu              1                 4.00      4.0        0.0",
		"norm -> gemvs              1                 0.10      0.1        3.0", // every gemvs block started before 2100
		"silu -> norm               1                 0.20      0.2        0.0",
	} {
		if !strings.Contains(r, want) {
			t.Errorf("report lacks %q:\n%s", want, r)
		}
	}
}
