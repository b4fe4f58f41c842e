package tokenizer

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"unicode/utf8"
)

// sharedDir locates the shared test data: $TANDEM_SHARED, else ../shared
// beside the module root; "" when neither can be found.
func sharedDir() string {
	if d := os.Getenv("TANDEM_SHARED"); d != "" {
		return d
	}
	dir, err := os.Getwd()
	if err != nil {
		return ""
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return filepath.Join(filepath.Dir(dir), "shared")
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return ""
		}
		dir = parent
	}
}

// tokenizersPath returns the path of a file under shared/tokenizers, or
// skips the test when the shared data is absent.
func tokenizersPath(t testing.TB, name string) string {
	t.Helper()
	p := filepath.Join(sharedDir(), "tokenizers", name)
	if _, err := os.Stat(p); err != nil {
		t.Skipf("shared test data not found (%v); set TANDEM_SHARED to the shared/ directory to run this test", err)
	}
	return p
}

// refCase is one reference result of Hugging Face tokenizers 0.23.2.
type refCase struct {
	Text               string  `json:"text"`
	IDs                []int32 `json:"ids"`
	IDsNoSpecial       []int32 `json:"ids_no_special"`
	Decoded            string  `json:"decoded"`
	DecodedSkipSpecial string  `json:"decoded_skip_special"`
}

// refNames are the tokenizers the reference covers.
var refNames = []string{"llama3", "qwen3", "llama2"}

var (
	refOnce sync.Once
	refData map[string][]refCase
	refErr  error
	// sharedLoads maps a tokenizer path to the sync.OnceValues loading it,
	// so each file is parsed once per test binary.
	sharedLoads sync.Map
)

func loadReference(t testing.TB) map[string][]refCase {
	t.Helper()
	p := tokenizersPath(t, "reference.json")
	refOnce.Do(func() {
		var data []byte
		if data, refErr = os.ReadFile(p); refErr != nil {
			return
		}
		var f struct {
			Tokenizers map[string][]refCase `json:"tokenizers"`
		}
		refErr = json.Unmarshal(data, &f)
		refData = f.Tokenizers
	})
	if refErr != nil {
		t.Fatalf("read reference: %v", refErr)
	}
	return refData
}

// loadShared loads (once per test binary) one of the shared tokenizers.
func loadShared(t testing.TB, name string) *Tokenizer {
	t.Helper()
	p := tokenizersPath(t, name+".json")
	v, _ := sharedLoads.LoadOrStore(p, sync.OnceValues(func() (*Tokenizer, error) { return Load(p) }))
	tk, err := v.(func() (*Tokenizer, error))()
	if err != nil {
		t.Fatalf("load %s: %v", name, err)
	}
	return tk
}

// TestReference checks every reference case of every shared tokenizer:
// encode with and without special tokens, decode with and without skipping
// them. All must match exactly.
func TestReference(t *testing.T) {
	ref := loadReference(t)
	total, ok := 0, 0
	for _, name := range refNames {
		cases := ref[name]
		if len(cases) == 0 {
			t.Fatalf("reference has no cases for %s", name)
		}
		tk := loadShared(t, name)
		bad := 0
		for i, c := range cases {
			total++
			var fails []string
			if got := tk.Encode(c.Text, true); !slices.Equal(got, c.IDs) {
				fails = append(fails, "ids")
				if bad < 5 {
					t.Errorf("%s case %d %q: Encode(addSpecial) = %v, want %v", name, i, c.Text, got, c.IDs)
				}
			}
			if got := tk.Encode(c.Text, false); !slices.Equal(got, c.IDsNoSpecial) {
				fails = append(fails, "ids_no_special")
				if bad < 5 {
					t.Errorf("%s case %d %q: Encode = %v, want %v", name, i, c.Text, got, c.IDsNoSpecial)
				}
			}
			if got := tk.Decode(c.IDs, false); got != c.Decoded {
				fails = append(fails, "decoded")
				if bad < 5 {
					t.Errorf("%s case %d: Decode = %q, want %q", name, i, got, c.Decoded)
				}
			}
			if got := tk.Decode(c.IDs, true); got != c.DecodedSkipSpecial {
				fails = append(fails, "decoded_skip_special")
				if bad < 5 {
					t.Errorf("%s case %d: Decode(skipSpecial) = %q, want %q", name, i, got, c.DecodedSkipSpecial)
				}
			}
			if len(fails) > 0 {
				bad++
			} else {
				ok++
			}
		}
		t.Logf("%s: %d/%d cases match on all four checks", name, len(cases)-bad, len(cases))
	}
	t.Logf("total: %d/%d cases match", ok, total)
	if ok != total {
		t.Errorf("%d of %d reference cases differ", total-ok, total)
	}
}

// TestReferenceStream decodes every reference case id by id and checks the
// pieces against Decode's reference results.
func TestReferenceStream(t *testing.T) {
	ref := loadReference(t)
	for _, name := range refNames {
		tk := loadShared(t, name)
		for i, c := range ref[name] {
			for _, skip := range []bool{false, true} {
				want := c.Decoded
				if skip {
					want = c.DecodedSkipSpecial
				}
				got := streamAll(t, tk, c.IDs, skip)
				if got != want {
					t.Errorf("%s case %d skip=%v: stream = %q, want %q", name, i, skip, got, want)
				}
			}
		}
	}
}

// streamAll feeds ids to a new Stream and returns the concatenated output,
// failing the test on any piece that is not valid UTF-8.
func streamAll(t testing.TB, tk *Tokenizer, ids []int32, skip bool) string {
	t.Helper()
	s := tk.NewStream(skip)
	var out []byte
	for _, id := range ids {
		piece := s.Add(id)
		if !utf8.ValidString(piece) {
			t.Fatalf("Add(%d) returned invalid UTF-8 %q", id, piece)
		}
		out = append(out, piece...)
	}
	rest := s.Flush()
	if !utf8.ValidString(rest) {
		t.Fatalf("Flush returned invalid UTF-8 %q", rest)
	}
	return string(append(out, rest...))
}
