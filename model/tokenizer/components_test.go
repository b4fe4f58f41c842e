package tokenizer

import (
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/dlclark/regexp2"
)

// The expected pieces are the example of the Hugging Face documentation of
// SplitDelimiterBehavior, splitting "the-final--countdown" on "-".
func TestSplitBehaviors(t *testing.T) {
	cases := []struct {
		behavior splitBehavior
		invert   bool
		want     []string
	}{
		{splitRemoved, false, []string{"the", "final", "countdown"}},
		{splitIsolated, false, []string{"the", "-", "final", "-", "-", "countdown"}},
		{splitMergedWithPrevious, false, []string{"the-", "final-", "-", "countdown"}},
		{splitMergedWithNext, false, []string{"the", "-final", "-", "-countdown"}},
		{splitContiguous, false, []string{"the", "-", "final", "--", "countdown"}},
		{splitRemoved, true, []string{"-", "-", "-"}},
		// Inverted, the words are the matches: each is glued to the dash
		// before it.
		{splitMergedWithPrevious, true, []string{"the", "-final", "-", "-countdown"}},
	}
	for _, c := range cases {
		var got []string
		var firsts []bool
		splitBy(segment{"the-final--countdown", true}, literalMatcher{"-"}, c.behavior, c.invert, func(s segment) {
			got = append(got, s.text)
			firsts = append(firsts, s.first)
		})
		if !slices.Equal(got, c.want) {
			t.Errorf("behavior %d invert %v: got %q, want %q", c.behavior, c.invert, got, c.want)
		}
		for i, f := range firsts {
			if f != (i == 0 && strings.HasPrefix("the-final--countdown", got[0])) {
				t.Errorf("behavior %d: piece %d first=%v", c.behavior, i, f)
			}
		}
	}
}

// The expectations follow the Unicode standard's "U+FFFD substitution of
// maximal subparts" (chapter 3, table 3-8 and its neighbours), which Rust's
// String::from_utf8_lossy implements.
func TestAppendLossy(t *testing.T) {
	cases := []struct {
		in   string
		want string
	}{
		{"plain ascii", "plain ascii"},
		{"\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64", "a\uFFFD\uFFFD\uFFFDb\uFFFDc\uFFFD\uFFFDd"},
		{"Hello\xF0\x90\x80World", "Hello\uFFFDWorld"},
		{"\xC0\x80", "\uFFFD\uFFFD"},
		{"\xED\xA0\x80", "\uFFFD\uFFFD\uFFFD"},
		{"\xF4\x90\x80\x80", "\uFFFD\uFFFD\uFFFD\uFFFD"},
		{"\xE2\x82", "\uFFFD"},
		{"\xE2\x82\xAC", "€"},
		{"é\xFF", "é\uFFFD"},
	}
	for _, c := range cases {
		if got := string(appendLossy(nil, []byte(c.in))); got != c.want {
			t.Errorf("appendLossy(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

// Expectations from the Hugging Face tokenizers decoder tests.
func TestDecoders(t *testing.T) {
	cases := []struct {
		name string
		dec  decoder
		in   []string
		want []string
	}{
		{"byte fallback single", byteFallbackDec{}, []string{"<0x61>"}, []string{"a"}},
		{"byte fallback char", byteFallbackDec{}, []string{"<0xE5>", "<0x8f>", "<0xab>"}, []string{"叫"}},
		{"byte fallback then text", byteFallbackDec{}, []string{"<0xE5>", "<0x8f>", "<0xab>", "a"}, []string{"叫", "a"}},
		{"byte fallback broken", byteFallbackDec{}, []string{"<0xE5>", "<0x8f>", "a"}, []string{"\uFFFD", "\uFFFD", "a"}},
		{"byte fallback not bytes", byteFallbackDec{}, []string{"<0xZZ>", "<0x0A"}, []string{"<0xZZ>", "<0x0A"}},
		{"fuse", fuseDec{}, []string{"Hey", " friend", "!"}, []string{"Hey friend!"}},
		{"strip start", stripDec{'H', 1, 0}, []string{"Hey", " friend!", "HHey"}, []string{"ey", " friend!", "Hey"}},
		{"strip stop", stripDec{'y', 0, 1}, []string{"Hey", " friend!", "HHey"}, []string{"He", " friend!", "HHe"}},
		{"strip both", stripDec{' ', 2, 1}, []string{"  a  ", " b", "c"}, []string{"a ", "b", "c"}},
		{"metaspace always", metaspaceDec{'▁', prependAlways}, []string{"▁Hey", "▁friend!"}, []string{"Hey", " friend!"}},
		{"metaspace never", metaspaceDec{'▁', prependNever}, []string{"▁Hey", "▁friend!"}, []string{" Hey", " friend!"}},
		{"replace", replaceDec{literalMatcher{"▁"}, " "}, []string{"▁Hey", "▁friend!"}, []string{" Hey", " friend!"}},
		{"byte level", byteLevelDec{}, []string{"Hello", "Ġmy", "Ġfriend", ",", "Ġhow", "Ġis", "Ġyour", "Ġday", "Ġgoing", "?"},
			[]string{"Hello my friend, how is your day going?"}},
		{"byte level raw token", byteLevelDec{}, []string{"Ġa", "日本"}, []string{" a日本"}},
		{"sequence", sequenceDec{replaceDec{literalMatcher{"▁"}, " "}, fuseDec{}, stripDec{' ', 1, 0}}, []string{"▁Hey", "▁friend!"}, []string{"Hey friend!"}},
	}
	for _, c := range cases {
		if got := c.dec.decodeChain(c.in); !slices.Equal(got, c.want) {
			t.Errorf("%s: decodeChain(%q) = %q, want %q", c.name, c.in, got, c.want)
		}
	}
}

// scannerPatterns are the expressions with hand-written scanners.
var scannerPatterns = []string{llama3Pattern, qwen2Pattern, gpt2Pattern}

// scannerAlphabet mixes the characters the split expressions tell apart.
var scannerAlphabet = []rune("aZé日本ᛅ0٣½ⅷ '’sStTrReVvmMlLdD\r\n\t\v\f\u00a0\u3000\u2028\u0085.,!?-_$😀\u0301\u200d")

func randomScannerText(r *rand.Rand, n int) string {
	rs := make([]rune, n)
	for i := range rs {
		rs[i] = scannerAlphabet[r.IntN(len(scannerAlphabet))]
	}
	return string(rs)
}

// collectSpans returns the spans m finds in s.
func collectSpans(m matcher, s string) []span {
	var out []span
	m.find(s, func(sp span) { out = append(out, sp) })
	return out
}

// checkScanners compares each hand-written scanner with regexp2 running the
// expression it stands for. Text holding the long s (ſ) is left out: under
// (?i) Oniguruma folds it to s, regexp2 does not (TestContractionFolding).
func checkScanners(t *testing.T, text string) {
	t.Helper()
	if strings.ContainsRune(text, 'ſ') {
		return
	}
	for _, p := range scannerPatterns {
		fast, err := newRegexMatcher(p)
		if err != nil {
			t.Fatal(err)
		}
		re := regexMatcher{regexp2.MustCompile(p, regexp2.None)}
		got, want := collectSpans(fast, text), collectSpans(re, text)
		if !slices.Equal(got, want) {
			t.Fatalf("pattern %q on %q:\nscanner %v\nregexp2 %v", p, text, got, want)
		}
	}
}

func TestScannersMatchRegexp2(t *testing.T) {
	fixed := []string{
		"", "Hello world", "I'm here, they'LL see", "'said 'S", "a  b   c\n\n d \r\n e\t\tf  ",
		"123456789 12 ½½½½", " !!! ?? a", "x \n\n", "   ", "\u00a0word \u3000 x", "a\u0301b", "emoji 😀😀 ok",
		"tab\tword", "’quote", "  \n", "end with space ", "Ünïcödé ÀÉÎ 東京タワー",
	}
	for _, s := range fixed {
		checkScanners(t, s)
	}
	r := rand.New(rand.NewPCG(1, 2))
	for range 3000 {
		checkScanners(t, randomScannerText(r, 1+r.IntN(24)))
	}
}

// Under (?i) Oniguruma compares by Unicode case folding, where the long s
// (U+017F) folds to s, so "'ſ" is a contraction for the Llama 3 split but
// not for the case-sensitive GPT-2 one.
func TestContractionFolding(t *testing.T) {
	if got := contraction("'ſ x", 0, true); got != len("'ſ") {
		t.Errorf("folded contraction end = %d, want %d", got, len("'ſ"))
	}
	if got := contraction("'ſ x", 0, false); got != 0 {
		t.Errorf("unfolded contraction end = %d, want 0", got)
	}
	if got := contraction("'LL", 0, true); got != 3 {
		t.Errorf("'LL end = %d, want 3", got)
	}
	if got := contraction("'Ll", 0, false); got != 0 {
		t.Errorf("case-sensitive 'Ll end = %d, want 0", got)
	}
}

// An expression without a scanner runs on regexp2, lookahead included, and
// a string pattern splits on each occurrence.
func TestOtherPatterns(t *testing.T) {
	m, err := newRegexMatcher(`\d+(?=px)`)
	if err != nil {
		t.Fatal(err)
	}
	want := []span{{0, 3, false}, {3, 5, true}, {5, 12, false}}
	if got := collectSpans(m, "gap12px and 7em"[:12]); !slices.Equal(got, want) {
		t.Errorf("regexp2 spans = %v, want %v", got, want)
	}
	if _, err := newRegexMatcher(`(unclosed`); err == nil {
		t.Error("bad regex compiled")
	}
	if _, err := newStringMatcher(""); err == nil {
		t.Error("empty string pattern accepted")
	}
	if got := collectSpans(literalMatcher{"ab"}, "abxab"); !slices.Equal(got, []span{{0, 2, true}, {2, 3, false}, {3, 5, true}}) {
		t.Errorf("literal spans = %v", got)
	}
}
