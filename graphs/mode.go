package graphs

import (
	"fmt"
	"strings"
)

// Mode is a CUDA-graph mode. None, Piecewise and Full are runtime modes:
// what one step runs as. FullDecodeOnly and FullAndPiecewise are dual
// modes, configured but never run as such: each names one runtime mode for
// uniform decode batches (DecodeMode) and one for the rest (MixedMode).
//
// The zero Mode is None; a configuration that wants the default must say
// DefaultMode.
type Mode uint8

// The modes.
const (
	// None runs every step eagerly.
	None Mode = iota
	// Piecewise replays graphs of everything but attention, which runs
	// eagerly between them; the graphs depend only on the padded token
	// count.
	Piecewise
	// Full replays one graph of the whole forward pass, for uniform decode
	// batches and mixed ones alike (mixed batches need Always support).
	Full
	// FullDecodeOnly replays full graphs for uniform decode batches and runs
	// the rest eagerly.
	FullDecodeOnly
	// FullAndPiecewise replays full graphs for uniform decode batches and
	// piecewise graphs for the rest.
	FullAndPiecewise
)

// DefaultMode is the mode a pipeline is configured with unless told
// otherwise.
const DefaultMode = FullAndPiecewise

var modeNames = [...]string{
	None:             "NONE",
	Piecewise:        "PIECEWISE",
	Full:             "FULL",
	FullDecodeOnly:   "FULL_DECODE_ONLY",
	FullAndPiecewise: "FULL_AND_PIECEWISE",
}

// Valid reports whether m is one of the five modes.
func (m Mode) Valid() bool { return int(m) < len(modeNames) }

// String is the mode's name as configured: NONE, PIECEWISE, FULL,
// FULL_DECODE_ONLY or FULL_AND_PIECEWISE.
func (m Mode) String() string {
	if !m.Valid() {
		return fmt.Sprintf("Mode(%d)", uint8(m))
	}
	return modeNames[m]
}

// ParseMode reads a mode name, in any letter case.
func ParseMode(s string) (Mode, error) {
	for m, name := range modeNames {
		if strings.EqualFold(s, name) {
			return Mode(m), nil
		}
	}
	return None, fmt.Errorf("unknown CUDA-graph mode %q (want one of %s)", s, strings.Join(modeNames[:], ", "))
}

// MarshalText writes the mode's name.
func (m Mode) MarshalText() ([]byte, error) {
	if !m.Valid() {
		return nil, fmt.Errorf("marshal CUDA-graph mode: invalid value %d", uint8(m))
	}
	return []byte(m.String()), nil
}

// UnmarshalText reads a mode name (see ParseMode).
func (m *Mode) UnmarshalText(b []byte) error {
	v, err := ParseMode(string(b))
	if err != nil {
		return err
	}
	*m = v
	return nil
}

// IsRuntime reports whether m is a mode one step can run as: None,
// Piecewise or Full.
func (m Mode) IsRuntime() bool { return m <= Full }

// DecodeMode is the runtime mode of uniform decode batches under m.
func (m Mode) DecodeMode() Mode {
	switch m {
	case FullDecodeOnly, FullAndPiecewise:
		return Full
	case Piecewise, Full:
		return m
	}
	return None
}

// MixedMode is the runtime mode of every other batch (prefill, mixed
// prefill and decode, decode of uneven query lengths) under m.
func (m Mode) MixedMode() Mode {
	switch m {
	case FullAndPiecewise:
		return Piecewise
	case Piecewise, Full:
		return m
	}
	return None
}

// HasFull reports whether m replays full graphs for some batches.
func (m Mode) HasFull() bool { return m.DecodeMode() == Full || m.MixedMode() == Full }

// HasPiecewise reports whether m replays piecewise graphs for some batches.
func (m Mode) HasPiecewise() bool {
	return m.DecodeMode() == Piecewise || m.MixedMode() == Piecewise
}

// Support is how much of the CUDA-graph machinery a stage backend can
// capture. The levels are ordered: each allows everything the ones below
// it do.
//
// Unlike vLLM, where the levels describe only the attention backend and
// piecewise graphs are always possible, a level here describes the whole
// stage: Never means the stage captures no graphs at all (the CPU
// backend), and every level above it allows piecewise graphs.
type Support uint8

// The support levels, weakest first.
const (
	// Never: no CUDA graphs (the CPU backend).
	Never Support = iota
	// UniformSingleTokenDecode: piecewise graphs, and full graphs of
	// batches where every request decodes exactly one token.
	UniformSingleTokenDecode
	// UniformBatch: piecewise graphs, and full graphs of batches where
	// every request has the same query length (speculative decoding's
	// uniform decode batches included).
	UniformBatch
	// Always: full graphs of any batch, mixed ones included.
	Always
)

var supportNames = [...]string{
	Never:                    "NEVER",
	UniformSingleTokenDecode: "UNIFORM_SINGLE_TOKEN_DECODE",
	UniformBatch:             "UNIFORM_BATCH",
	Always:                   "ALWAYS",
}

// Valid reports whether s is one of the four levels.
func (s Support) Valid() bool { return int(s) < len(supportNames) }

// String is the level's name: NEVER, UNIFORM_SINGLE_TOKEN_DECODE,
// UNIFORM_BATCH or ALWAYS.
func (s Support) String() string {
	if !s.Valid() {
		return fmt.Sprintf("Support(%d)", uint8(s))
	}
	return supportNames[s]
}

// ParseSupport reads a support level name, in any letter case.
func ParseSupport(str string) (Support, error) {
	for s, name := range supportNames {
		if strings.EqualFold(str, name) {
			return Support(s), nil
		}
	}
	return Never, fmt.Errorf("unknown CUDA-graph support level %q (want one of %s)", str, strings.Join(supportNames[:], ", "))
}

// MarshalText writes the level's name.
func (s Support) MarshalText() ([]byte, error) {
	if !s.Valid() {
		return nil, fmt.Errorf("marshal CUDA-graph support level: invalid value %d", uint8(s))
	}
	return []byte(s.String()), nil
}

// UnmarshalText reads a level name (see ParseSupport).
func (s *Support) UnmarshalText(b []byte) error {
	v, err := ParseSupport(string(b))
	if err != nil {
		return err
	}
	*s = v
	return nil
}

// FullDecode reports whether s allows full graphs of uniform decode
// batches of queryLen tokens per request.
func (s Support) FullDecode(queryLen int) bool {
	return s >= UniformBatch || s == UniformSingleTokenDecode && queryLen == 1
}

// FullMixed reports whether s allows full graphs of mixed batches.
func (s Support) FullMixed() bool { return s == Always }

// StageSupport is one stage's support level, with a name for the reasons
// Resolve gives.
type StageSupport struct {
	Name    string // e.g. "stage 1 (cuda:0)"
	Support Support
}

// Resolve reduces the configured mode to what the weakest stage supports,
// for uniform decode batches of queryLen tokens per request (1, or more
// with speculative decoding). Each downgrade comes with a reason naming the
// stage that forced it, for the caller to log. With no stages nothing
// constrains the mode.
//
// The rules, applied in order:
//   - a stage that supports Never (no graphs) forces None;
//   - full graphs of mixed batches (Full) need Always, else Full becomes
//     FullAndPiecewise;
//   - full graphs of uniform decode batches need FullDecode(queryLen),
//     else FullAndPiecewise becomes Piecewise and FullDecodeOnly None.
func Resolve(configured Mode, queryLen int, stages []StageSupport) (Mode, []string, error) {
	if !configured.Valid() {
		return None, nil, fmt.Errorf("resolve CUDA-graph mode: invalid mode %d", uint8(configured))
	}
	if queryLen < 1 {
		return None, nil, fmt.Errorf("resolve CUDA-graph mode: uniform decode query length %d, want at least 1", queryLen)
	}
	weakest := -1
	for i, s := range stages {
		if !s.Support.Valid() {
			return None, nil, fmt.Errorf("resolve CUDA-graph mode: stage %s: invalid support level %d", s.Name, uint8(s.Support))
		}
		if weakest < 0 || s.Support < stages[weakest].Support {
			weakest = i
		}
	}
	if weakest < 0 || configured == None {
		return configured, nil, nil
	}
	w := stages[weakest]
	var reasons []string
	m := configured
	downgrade := func(to Mode, why string) {
		reasons = append(reasons, fmt.Sprintf("stage %s supports %s: %s; %s -> %s", w.Name, w.Support, why, m, to))
		m = to
	}
	if w.Support == Never {
		downgrade(None, "it captures no CUDA graphs")
		return m, reasons, nil
	}
	if m.MixedMode() == Full && !w.Support.FullMixed() {
		downgrade(FullAndPiecewise, "full graphs of mixed batches need ALWAYS")
	}
	if m.DecodeMode() == Full && !w.Support.FullDecode(queryLen) {
		to := None
		if m.HasPiecewise() {
			to = Piecewise
		}
		downgrade(to, fmt.Sprintf("full graphs of uniform decode batches of %d tokens per request need %s", queryLen, UniformBatch))
	}
	return m, reasons, nil
}
