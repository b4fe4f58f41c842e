package textout

import (
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/tandem-llm/tandem/model/randinit"
	"github.com/tandem-llm/tandem/model/tokenizer"
)

var loadTok = sync.OnceValues(func() (*tokenizer.Tokenizer, error) {
	dir, err := os.MkdirTemp("", "textout")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	o := randinit.DefaultOptions()
	o.Layers = 1
	if err := randinit.Write(dir, o); err != nil {
		return nil, err
	}
	return tokenizer.Load(filepath.Join(dir, "tokenizer.json"))
})

// testTokenizer is the byte-level BPE of tandemctl model init's
// checkpoints: multi-byte characters span several tokens, and it has the
// special tokens BOS and EOS.
func testTokenizer(t testing.TB) *tokenizer.Tokenizer {
	t.Helper()
	tok, err := loadTok()
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// run feeds ids one at a time and returns the deltas, whether a stop
// string ended the output (and after how many tokens), then Finish's text
// when none did.
func run(p *Processor, ids []int32) (deltas []string, stoppedAt int) {
	for i, id := range ids {
		d := p.Add(id)
		deltas = append(deltas, d.Text)
		if d.Stopped {
			return deltas, i + 1
		}
	}
	return append(deltas, p.Finish()), 0
}

func TestProcessor(t *testing.T) {
	tok := testTokenizer(t)
	bos, eos := "<|begin_of_text|>", "<|end_of_text|>"
	for _, c := range []struct {
		name     string
		text     string
		cfg      Config
		want     string
		stop     string // the stop string that matched
		heldBack string // must never be released before the end
	}{
		{name: "no stop", text: "Hello world, hello again.", want: "Hello world, hello again."},
		{name: "stop mid text", text: "Hello world, hello again.", cfg: Config{Stop: []string{"world"}}, want: "Hello ", stop: "world", heldBack: "wor"},
		{name: "stop at the start", text: "Hello world", cfg: Config{Stop: []string{"He"}}, want: "", stop: "He"},
		{name: "stop never completes", text: "Hello wor", cfg: Config{Stop: []string{"world"}}, want: "Hello wor"},
		{name: "earliest of several", text: "one two three", cfg: Config{Stop: []string{"three", "two", "xyz"}}, want: "one ", stop: "two"},
		{name: "stop inside a multi-byte run", text: "naïve café ☕ 😀 done", cfg: Config{Stop: []string{"☕"}}, want: "naïve café ", stop: "☕"},
		{name: "emoji stop", text: "a😀b😀c", cfg: Config{Stop: []string{"😀c"}}, want: "a😀b", stop: "😀c"},
		{name: "multi-byte text kept whole", text: "日本語のテキスト", want: "日本語のテキスト"},
		{name: "newline stop", text: "line one\n\nline two", cfg: Config{Stop: []string{"\n\n"}}, want: "line one", stop: "\n\n"},
		{name: "empty stop ignored", text: "abc", cfg: Config{Stop: []string{""}}, want: "abc"},
		{name: "special skipped", text: bos + "hi" + eos + "there", want: "hithere"},
		{name: "special kept", text: bos + "hi" + eos + "there", cfg: Config{KeepSpecial: true}, want: bos + "hi" + eos + "there"},
		{name: "stop on a special token's text", text: "hi" + eos + "there", cfg: Config{KeepSpecial: true, Stop: []string{eos}}, want: "hi", stop: eos},
	} {
		t.Run(c.name, func(t *testing.T) {
			ids := tok.Encode(c.text, false)
			p := New(tok, c.cfg)
			deltas, stoppedAt := run(p, ids)
			if got := strings.Join(deltas, ""); got != c.want {
				t.Errorf("text %q, want %q (deltas %q)", got, c.want, deltas)
			}
			if (stoppedAt > 0) != (c.stop != "") || p.StopString() != c.stop {
				t.Errorf("stopped after %d tokens on %q, want stop %q", stoppedAt, p.StopString(), c.stop)
			}
			if c.heldBack != "" {
				sofar := ""
				for _, d := range deltas[:len(deltas)-1] {
					if sofar += d; strings.Contains(sofar, c.heldBack) {
						t.Errorf("released %q, which holds %q, before the end", sofar, c.heldBack)
					}
				}
			}
			// After the end nothing more comes.
			if d := p.Add(ids[0]); d.Text != "" || d.Stopped != (c.stop != "") {
				t.Errorf("Add after the end: %+v", d)
			}
			if s := p.Finish(); s != "" {
				t.Errorf("Finish after the end: %q", s)
			}
		})
	}
}

// TestStopTokenExcluded: a request that ends on a stop token does not add
// it, and Finish releases what was held back for a stop string that never
// came.
func TestStopTokenExcluded(t *testing.T) {
	tok := testTokenizer(t)
	p := New(tok, Config{Stop: []string{"world"}})
	var got string
	for _, id := range tok.Encode("Hello wor", false) {
		got += p.Add(id).Text
	}
	if got != "Hello " {
		t.Fatalf("before the end %q, want the possible stop held back", got)
	}
	if got += p.Finish(); got != "Hello wor" {
		t.Fatalf("after Finish %q", got)
	}
}

// FuzzProcessor checks the Processor against a direct computation over
// the incremental decoder's text: the output is the text up to the first
// stop string in the shortest prefix (by tokens) of the decoded text that
// holds one, or all of it; released text is always a prefix of the final
// text.
func FuzzProcessor(f *testing.F) {
	f.Add("Hello world, hello again.", "world", "lo w", false)
	f.Add("naïve café ☕ 😀 done", "☕", "é ☕", true)
	f.Add("aaaa", "aa", "a", false)
	f.Add("<|end_of_text|>x<|begin_of_text|>", "x<", ">", true)
	f.Fuzz(func(t *testing.T, text, stop1, stop2 string, keep bool) {
		tok := testTokenizer(t)
		ids := tok.Encode(text, false)
		if len(ids) > 200 {
			return
		}
		var stops []string // empty stops are ignored, as New does
		for _, s := range []string{stop1, stop2} {
			if s != "" {
				stops = append(stops, s)
			}
		}
		// Reference: the decoder's cumulative text after each token.
		ref := tok.NewStream(!keep)
		want, wantStopped := "", false
		cum := ""
		for _, id := range ids {
			cum += ref.Add(id)
			if i, _ := firstStop(cum, stops); i >= 0 {
				want, wantStopped = cum[:i], true
				break
			}
		}
		if !wantStopped {
			cum += ref.Flush()
			want = cum
			if i, _ := firstStop(cum, stops); i >= 0 {
				want, wantStopped = cum[:i], true
			}
		}
		p := New(tok, Config{Stop: stops, KeepSpecial: keep})
		got, stopped := "", false
		for _, id := range ids {
			d := p.Add(id)
			got += d.Text
			if !strings.HasPrefix(want, got) {
				t.Fatalf("released %q, not a prefix of the final %q", got, want)
			}
			if d.Stopped {
				stopped = true
				break
			}
		}
		if !stopped {
			got += p.Finish()
			stopped = p.StopString() != ""
		}
		if got != want || stopped != wantStopped {
			t.Fatalf("text %q stopped %v; want %q stopped %v (stops %q)", got, stopped, want, wantStopped, stops)
		}
	})
}

func TestCheckStop(t *testing.T) {
	if err := CheckStop([]string{"a", "\n\n", strings.Repeat("x", MaxStopBytes)}); err != nil {
		t.Fatal(err)
	}
	for _, bad := range [][]string{
		make([]string, MaxStops+1),
		{"ok", ""},
		{strings.Repeat("x", MaxStopBytes+1)},
		{"\xff"},
	} {
		if err := CheckStop(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
