package nodewire

import (
	"fmt"
	"testing"

	"github.com/tandem-llm/tandem/graphs"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

func TestGraphKeysRoundTrip(t *testing.T) {
	d, err := graphs.NewDispatcher(graphs.Config{Mode: graphs.FullAndPiecewise, MaxNumSeqs: 8, MaxCaptureSize: 64})
	if err != nil {
		t.Fatal(err)
	}
	keys := d.Keys()
	got, err := DecodeGraphKeys(EncodeGraphKeys(keys))
	if err != nil || fmt.Sprint(got) != fmt.Sprint(keys) {
		t.Errorf("keys %v came back as %v, %v", keys, got, err)
	}
	for _, bad := range []*tandemv1.GraphKey{{Mode: "NONE", NumTokens: 8}, {Mode: "FULL", NumTokens: 0}, {Mode: "HALF", NumTokens: 8}} {
		if _, err := DecodeGraphKeys([]*tandemv1.GraphKey{bad}); err == nil {
			t.Errorf("key %v: no error", bad)
		}
	}
}
