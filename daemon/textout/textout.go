package textout

import (
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/tandem-llm/tandem/model/tokenizer"
)

// Config is how one request's text is produced.
type Config struct {
	// Stop strings end the output where the first of them appears; the
	// text stops before it.
	Stop []string
	// KeepSpecial keeps special tokens in the text (vLLM's
	// skip_special_tokens=false); by default they are left out.
	KeepSpecial bool
}

// Processor turns one request's generated tokens into text: incremental
// detokenisation (a character split over tokens comes out whole), stop
// strings, and holding back text that may still become the start of a
// stop string.
type Processor struct {
	dec     *tokenizer.Stream
	stop    []string
	pending string // decoded, not yet released
	stopped string // the stop string that matched; "" while none has
	done    bool
}

// New starts the text of one request.
func New(tok *tokenizer.Tokenizer, cfg Config) *Processor {
	stop := make([]string, 0, len(cfg.Stop))
	for _, s := range cfg.Stop {
		if s != "" {
			stop = append(stop, s)
		}
	}
	return &Processor{dec: tok.NewStream(!cfg.KeepSpecial), stop: stop}
}

// Delta is what one token adds to the output.
type Delta struct {
	// Text is the text released now; it may be empty while text is held
	// back (an incomplete character, a possible start of a stop string).
	Text string
	// Stopped reports that a stop string has appeared: Text ends before it
	// and the output is complete. The caller cancels the request, which
	// frees it in the scheduler; further tokens add nothing.
	Stopped bool
}

// Add decodes the next generated token. A token that ended the request as
// a stop token (EOS or a stop_token_id) is not added: its text is not part
// of the output, as in vLLM; call Finish instead.
func (p *Processor) Add(id int32) Delta {
	if p.done {
		return Delta{Stopped: p.stopped != ""}
	}
	return p.release(p.dec.Add(id), false)
}

// Finish ends the output (the request finished by length or on a stop
// token) and returns the text still held back. After a stop string it
// returns "".
func (p *Processor) Finish() string {
	if p.done {
		return ""
	}
	d := p.release(p.dec.Flush(), true)
	p.done = true
	return d.Text
}

// StopString is the stop string that ended the output, "" if none has.
func (p *Processor) StopString() string { return p.stopped }

func (p *Processor) release(s string, final bool) Delta {
	p.pending += s
	if i, st := firstStop(p.pending, p.stop); i >= 0 {
		out := p.pending[:i]
		p.pending, p.stopped, p.done = "", st, true
		return Delta{Text: out, Stopped: true}
	}
	keep := 0
	if !final {
		keep = heldBack(p.pending, p.stop)
	}
	out := p.pending[:len(p.pending)-keep]
	p.pending = p.pending[len(p.pending)-keep:]
	return Delta{Text: out}
}

// firstStop is the index in s of the earliest occurrence of any stop
// string, and that string; -1 when none occurs. Of two starting at the
// same index the longer wins, which ends the text at the same place.
func firstStop(s string, stop []string) (int, string) {
	first, which := -1, ""
	for _, st := range stop {
		if i := strings.Index(s, st); i >= 0 && (first < 0 || i < first || i == first && len(st) > len(which)) {
			first, which = i, st
		}
	}
	return first, which
}

// heldBack is the length of the longest suffix of s that is a proper prefix
// of a stop string: text that the next tokens may turn into a stop string.
func heldBack(s string, stop []string) int {
	keep := 0
	for _, st := range stop {
		for n := min(len(st)-1, len(s)); n > keep; n-- {
			if strings.HasSuffix(s, st[:n]) {
				keep = n
				break
			}
		}
	}
	return keep
}

// Limits on a request's stop strings.
const (
	MaxStops     = 16
	MaxStopBytes = 256
)

// CheckStop validates a request's stop strings: at most MaxStops, each 1 to
// MaxStopBytes bytes of UTF-8. The error names the offending entry by its
// index ("stop[2]: ...").
func CheckStop(stop []string) error {
	if len(stop) > MaxStops {
		return fmt.Errorf("%d stop strings, at most %d", len(stop), MaxStops)
	}
	for i, st := range stop {
		if st == "" || len(st) > MaxStopBytes || !utf8.ValidString(st) {
			return fmt.Errorf("stop[%d]: want 1 to %d bytes of UTF-8, got %d bytes", i, MaxStopBytes, len(st))
		}
	}
	return nil
}
