package graphs

import (
	"fmt"
	"strconv"
)

// BatchDescriptor is the shape a CUDA graph is captured for and replayed
// at. It is comparable and serves as a map key.
type BatchDescriptor struct {
	// NumTokens is the padded token count: the graph's row count.
	NumTokens int
	// NumReqs is the padded request count of a uniform decode graph (0
	// otherwise).
	NumReqs int
	// UniformDecode marks a graph of NumReqs requests of QueryLen tokens
	// each.
	UniformDecode bool
	// QueryLen is the tokens per request of a uniform decode graph: 1, or
	// more with speculative decoding (0 otherwise).
	QueryLen int
}

// Relaxed is the descriptor with only the token count: the key of
// piecewise graphs (and of full graphs of mixed batches), which do not
// depend on how the tokens divide among requests.
func (d BatchDescriptor) Relaxed() BatchDescriptor { return BatchDescriptor{NumTokens: d.NumTokens} }

// String writes the descriptor as "tokens=8" or
// "tokens=8 reqs=4 uniform q=2".
func (d BatchDescriptor) String() string {
	s := "tokens=" + strconv.Itoa(d.NumTokens)
	if d.NumReqs != 0 {
		s += " reqs=" + strconv.Itoa(d.NumReqs)
	}
	if d.UniformDecode {
		s += " uniform"
	}
	if d.QueryLen != 0 {
		s += " q=" + strconv.Itoa(d.QueryLen)
	}
	return s
}

// Step is what the leader's dispatcher decided for one step: the runtime
// mode and the descriptor of the graph to replay (for None, the unpadded
// token count). It travels with the batch description, and every stage
// obeys it. It is also a dispatch key: Dispatcher.Keys lists the Steps a
// stage must capture.
type Step struct {
	Mode Mode
	Desc BatchDescriptor
}

// String writes the step as "FULL tokens=8 reqs=8 uniform q=1".
func (s Step) String() string { return s.Mode.String() + " " + s.Desc.String() }

// KeySet is the set of keys a stage has captured graphs for. The nil
// KeySet (a stage that captures nothing) holds no keys.
type KeySet map[Step]struct{}

// NewKeySet makes the set of keys.
func NewKeySet(keys []Step) KeySet {
	ks := make(KeySet, len(keys))
	for _, k := range keys {
		ks[k] = struct{}{}
	}
	return ks
}

// Has reports whether k is in the set.
func (ks KeySet) Has(k Step) bool {
	_, ok := ks[k]
	return ok
}

// Validate checks, on the named stage, that the step can run a batch of
// numTokens tokens from numReqs requests with the graphs captured: a
// Piecewise or Full step needs its key captured and a descriptor the
// batch fits; a None step carries the unpadded token count. A stage that
// cannot replay the step must fail it, never run it eagerly while its
// neighbours replay.
func (s Step) Validate(stage string, numTokens, numReqs int, captured KeySet) error {
	switch s.Mode {
	case None:
		if s.Desc.NumTokens != numTokens {
			return fmt.Errorf("stage %s: eager step describes %d tokens, the batch has %d", stage, s.Desc.NumTokens, numTokens)
		}
		return nil
	case Piecewise, Full:
	default:
		return fmt.Errorf("stage %s: step mode %s is not a runtime mode", stage, s.Mode)
	}
	if !captured.Has(s) {
		return fmt.Errorf("stage %s cannot replay key %s: no graph captured for it", stage, s)
	}
	if numTokens > s.Desc.NumTokens {
		return fmt.Errorf("stage %s: batch of %d tokens exceeds the graph of key %s", stage, numTokens, s)
	}
	if s.Desc.UniformDecode {
		if numReqs > s.Desc.NumReqs {
			return fmt.Errorf("stage %s: batch of %d requests exceeds the graph of key %s", stage, numReqs, s)
		}
		if numTokens != numReqs*s.Desc.QueryLen {
			return fmt.Errorf("stage %s: batch of %d tokens from %d requests is not a uniform decode of %d tokens per request (key %s)", stage, numTokens, numReqs, s.Desc.QueryLen, s)
		}
	}
	return nil
}
