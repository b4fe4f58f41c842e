package nodewire

import (
	"fmt"

	"github.com/tandem-llm/tandem/graphs"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// EncodeGraphKeys writes the dispatcher's keys for Node.Capture.
func EncodeGraphKeys(keys []graphs.Step) []*tandemv1.GraphKey {
	out := make([]*tandemv1.GraphKey, len(keys))
	for i, k := range keys {
		out[i] = &tandemv1.GraphKey{Mode: k.Mode.String(), NumTokens: uint32(k.Desc.NumTokens), NumReqs: uint32(k.Desc.NumReqs),
			UniformDecode: k.Desc.UniformDecode, QueryLen: uint32(k.Desc.QueryLen)}
	}
	return out
}

// DecodeGraphKeys reads the keys of a Capture request.
func DecodeGraphKeys(in []*tandemv1.GraphKey) ([]graphs.Step, error) {
	out := make([]graphs.Step, len(in))
	for i, k := range in {
		m, err := graphs.ParseMode(k.GetMode())
		if err != nil {
			return nil, fmt.Errorf("graph key %d: %w", i, err)
		}
		if m != graphs.Full && m != graphs.Piecewise {
			return nil, fmt.Errorf("graph key %d: mode %s: graphs are captured for FULL or PIECEWISE", i, m)
		}
		if k.GetNumTokens() == 0 || k.GetNumTokens() > graphs.MaxCaptureSizeLimit {
			return nil, fmt.Errorf("graph key %d: %d tokens, want [1, %d]", i, k.GetNumTokens(), graphs.MaxCaptureSizeLimit)
		}
		out[i] = graphs.Step{Mode: m, Desc: graphs.BatchDescriptor{NumTokens: int(k.GetNumTokens()), NumReqs: int(k.GetNumReqs()),
			UniformDecode: k.GetUniformDecode(), QueryLen: int(k.GetQueryLen())}}
	}
	return out, nil
}
