package graphs

import (
	"encoding/json"
	"strings"
	"testing"
)

var allModes = []Mode{None, Piecewise, Full, FullDecodeOnly, FullAndPiecewise}

var allSupports = []Support{Never, UniformSingleTokenDecode, UniformBatch, Always}

func TestModeSplit(t *testing.T) {
	tests := []struct {
		m                        Mode
		name                     string
		decode, mixed            Mode
		full, piecewise, runtime bool
	}{
		{None, "NONE", None, None, false, false, true},
		{Piecewise, "PIECEWISE", Piecewise, Piecewise, false, true, true},
		{Full, "FULL", Full, Full, true, false, true},
		{FullDecodeOnly, "FULL_DECODE_ONLY", Full, None, true, false, false},
		{FullAndPiecewise, "FULL_AND_PIECEWISE", Full, Piecewise, true, true, false},
		{Mode(5), "Mode(5)", None, None, false, false, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.m.String(); got != tc.name {
				t.Errorf("String = %q, want %q", got, tc.name)
			}
			if got := tc.m.DecodeMode(); got != tc.decode {
				t.Errorf("DecodeMode = %s, want %s", got, tc.decode)
			}
			if got := tc.m.MixedMode(); got != tc.mixed {
				t.Errorf("MixedMode = %s, want %s", got, tc.mixed)
			}
			if got := tc.m.HasFull(); got != tc.full {
				t.Errorf("HasFull = %v, want %v", got, tc.full)
			}
			if got := tc.m.HasPiecewise(); got != tc.piecewise {
				t.Errorf("HasPiecewise = %v, want %v", got, tc.piecewise)
			}
			if got := tc.m.IsRuntime(); got != tc.runtime {
				t.Errorf("IsRuntime = %v, want %v", got, tc.runtime)
			}
		})
	}
	if DefaultMode != FullAndPiecewise {
		t.Errorf("DefaultMode = %s, want FULL_AND_PIECEWISE", DefaultMode)
	}
}

func TestParseMode(t *testing.T) {
	tests := []struct {
		in      string
		want    Mode
		wantErr bool
	}{
		{"NONE", None, false},
		{"piecewise", Piecewise, false},
		{"Full", Full, false},
		{"full_decode_only", FullDecodeOnly, false},
		{"FULL_AND_PIECEWISE", FullAndPiecewise, false},
		{"", None, true},
		{"FULL-AND-PIECEWISE", None, true},
		{"FULL ", None, true},
		{"2", None, true},
	}
	for _, tc := range tests {
		got, err := ParseMode(tc.in)
		if (err != nil) != tc.wantErr || got != tc.want {
			t.Errorf("ParseMode(%q) = %s, %v; want %s, error %v", tc.in, got, err, tc.want, tc.wantErr)
		}
		if err != nil && !strings.Contains(err.Error(), "FULL_DECODE_ONLY") {
			t.Errorf("ParseMode(%q) error %q does not list the modes", tc.in, err)
		}
	}
}

func TestModeSupportJSON(t *testing.T) {
	type cfg struct {
		Mode    Mode    `json:"mode"`
		Support Support `json:"support"`
	}
	b, err := json.Marshal(cfg{FullDecodeOnly, UniformBatch})
	if err != nil {
		t.Fatal(err)
	}
	if want := `{"mode":"FULL_DECODE_ONLY","support":"UNIFORM_BATCH"}`; string(b) != want {
		t.Errorf("marshal = %s, want %s", b, want)
	}
	var c cfg
	if err := json.Unmarshal([]byte(`{"mode":"piecewise","support":"always"}`), &c); err != nil {
		t.Fatal(err)
	}
	if c != (cfg{Piecewise, Always}) {
		t.Errorf("unmarshal = %+v", c)
	}
	for _, in := range []string{`{"mode":"FAST"}`, `{"support":"SOMETIMES"}`, `{"mode":2}`} {
		if err := json.Unmarshal([]byte(in), &c); err == nil {
			t.Errorf("unmarshal %s: no error", in)
		}
	}
	if _, err := json.Marshal(cfg{Mode: 9}); err == nil {
		t.Error("marshal of invalid mode: no error")
	}
	if _, err := json.Marshal(cfg{Support: 4}); err == nil {
		t.Error("marshal of invalid support: no error")
	}
}

func TestSupport(t *testing.T) {
	tests := []struct {
		s                Support
		name             string
		decode1, decode2 bool
		mixed            bool
		parseAs          string
	}{
		{Never, "NEVER", false, false, false, "never"},
		{UniformSingleTokenDecode, "UNIFORM_SINGLE_TOKEN_DECODE", true, false, false, "uniform_single_token_decode"},
		{UniformBatch, "UNIFORM_BATCH", true, true, false, "Uniform_Batch"},
		{Always, "ALWAYS", true, true, true, "always"},
	}
	for _, tc := range tests {
		if got := tc.s.String(); got != tc.name {
			t.Errorf("String = %q, want %q", got, tc.name)
		}
		if got := tc.s.FullDecode(1); got != tc.decode1 {
			t.Errorf("%s.FullDecode(1) = %v", tc.s, got)
		}
		if got := tc.s.FullDecode(2); got != tc.decode2 {
			t.Errorf("%s.FullDecode(2) = %v", tc.s, got)
		}
		if got := tc.s.FullMixed(); got != tc.mixed {
			t.Errorf("%s.FullMixed() = %v", tc.s, got)
		}
		if got, err := ParseSupport(tc.parseAs); err != nil || got != tc.s {
			t.Errorf("ParseSupport(%q) = %s, %v", tc.parseAs, got, err)
		}
	}
	if got := Support(7).String(); got != "Support(7)" {
		t.Errorf("invalid support String = %q", got)
	}
	if _, err := ParseSupport("SOMETIMES"); err == nil || !strings.Contains(err.Error(), "SOMETIMES") {
		t.Errorf("ParseSupport(SOMETIMES) error = %v", err)
	}
}

// TestResolveMatrix checks every configured mode against one stage of
// every support level, for single-token and speculative decoding.
func TestResolveMatrix(t *testing.T) {
	// want[support][q-1] lists the resolved mode for each of allModes.
	want := map[Support][2][5]Mode{
		Never: {
			{None, None, None, None, None},
			{None, None, None, None, None},
		},
		UniformSingleTokenDecode: {
			{None, Piecewise, FullAndPiecewise, FullDecodeOnly, FullAndPiecewise},
			{None, Piecewise, Piecewise, None, Piecewise},
		},
		UniformBatch: {
			{None, Piecewise, FullAndPiecewise, FullDecodeOnly, FullAndPiecewise},
			{None, Piecewise, FullAndPiecewise, FullDecodeOnly, FullAndPiecewise},
		},
		Always: {
			{None, Piecewise, Full, FullDecodeOnly, FullAndPiecewise},
			{None, Piecewise, Full, FullDecodeOnly, FullAndPiecewise},
		},
	}
	// The number of reasons: one per step down (Full to FullAndPiecewise
	// to Piecewise is two).
	steps := map[[2]Mode]int{
		{Full, FullAndPiecewise}:      1,
		{Full, Piecewise}:             2,
		{FullAndPiecewise, Piecewise}: 1,
		{FullDecodeOnly, None}:        1,
		{Piecewise, None}:             1,
		{Full, None}:                  1,
		{FullAndPiecewise, None}:      1,
	}
	for _, sup := range allSupports {
		for q := 1; q <= 2; q++ {
			for i, m := range allModes {
				stages := []StageSupport{{"a", Always}, {"weak", sup}, {"c", Always}}
				got, reasons, err := Resolve(m, q, stages)
				if err != nil {
					t.Fatalf("Resolve(%s, %d, %s): %v", m, q, sup, err)
				}
				if w := want[sup][q-1][i]; got != w {
					t.Errorf("Resolve(%s, q=%d, weakest %s) = %s, want %s", m, q, sup, got, w)
				}
				if n := steps[[2]Mode{m, got}]; len(reasons) != n {
					t.Errorf("Resolve(%s, q=%d, weakest %s): reasons %q, want %d", m, q, sup, reasons, n)
				}
				for _, r := range reasons {
					if !strings.Contains(r, "stage weak supports "+sup.String()) || !strings.Contains(r, "-> ") {
						t.Errorf("reason %q does not name the weakest stage, its level and the change", r)
					}
				}
				// What the resolved mode runs, the weakest stage supports.
				if got.DecodeMode() == Full && !sup.FullDecode(q) || got.MixedMode() == Full && !sup.FullMixed() || sup == Never && got != None {
					t.Errorf("Resolve(%s, q=%d, weakest %s) = %s, more than the stage supports", m, q, sup, got)
				}
			}
		}
	}
}

func TestResolveEdges(t *testing.T) {
	got, reasons, err := Resolve(Full, 1, nil)
	if err != nil || got != Full || reasons != nil {
		t.Errorf("Resolve with no stages = %s, %q, %v; want FULL unchanged", got, reasons, err)
	}
	got, reasons, err = Resolve(FullAndPiecewise, 1, []StageSupport{{"0 (cuda)", Always}, {"1 (cpu)", Never}})
	if err != nil || got != None || len(reasons) != 1 || !strings.Contains(reasons[0], "stage 1 (cpu) supports NEVER") {
		t.Errorf("Resolve with a CPU stage = %s, %q, %v; want NONE naming stage 1 (cpu)", got, reasons, err)
	}
	// The first of equally weak stages is named.
	_, reasons, _ = Resolve(Full, 1, []StageSupport{{"x", Always}, {"y", UniformBatch}, {"z", UniformBatch}})
	if len(reasons) != 1 || !strings.Contains(reasons[0], "stage y ") {
		t.Errorf("reasons %q, want one naming stage y", reasons)
	}
	bad := []struct {
		m      Mode
		q      int
		stages []StageSupport
		want   string
	}{
		{Mode(8), 1, nil, "invalid mode 8"},
		{Full, 0, nil, "query length 0"},
		{Full, 1, []StageSupport{{"s3", Support(9)}}, "stage s3: invalid support level 9"},
	}
	for _, tc := range bad {
		if _, _, err := Resolve(tc.m, tc.q, tc.stages); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Resolve(%d, %d, %v) error = %v, want one containing %q", tc.m, tc.q, tc.stages, err, tc.want)
		}
	}
}

func FuzzParseMode(f *testing.F) {
	for _, s := range []string{"NONE", "full_and_piecewise", "FULL_DECODE_ONLY", "ALWAYS", "uniform_batch", "", "\xff", "FULL\x00"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if m, err := ParseMode(s); err == nil {
			if !m.Valid() || !strings.EqualFold(m.String(), s) {
				t.Errorf("ParseMode(%q) = %s", s, m)
			}
			var back Mode
			if err := back.UnmarshalText([]byte(m.String())); err != nil || back != m {
				t.Errorf("round trip of %s = %s, %v", m, back, err)
			}
		}
		if sup, err := ParseSupport(s); err == nil {
			if !sup.Valid() || !strings.EqualFold(sup.String(), s) {
				t.Errorf("ParseSupport(%q) = %s", s, sup)
			}
		}
	})
}
