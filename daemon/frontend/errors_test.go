package frontend

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/tandem-llm/tandem/daemon/apierr"
	"github.com/tandem-llm/tandem/daemon/openai"
)

// TestOpenAIError checks the mapping of the frontend's domain errors onto
// the OpenAI API's kinds: each kind to its own, the message kept as it
// is, context errors and errors of no kind unchanged.
func TestOpenAIError(t *testing.T) {
	for _, tc := range []struct {
		err  error
		kind error // nil: none of the API's kinds
	}{
		{apierr.Invalidf("prompt is empty"), openai.ErrInvalid},
		{apierr.Exhaustedf("too large to ever run: 9000 positions"), openai.ErrInvalid},
		{apierr.Overloadedf("1024 requests wait"), openai.ErrOverloaded},
		{apierr.Unavailablef("node a is draining"), openai.ErrUnavailable},
		{NotLeader("b", "10.0.0.2:7400"), openai.ErrUnavailable},
		{apierr.Preconditionf("stale epoch"), openai.ErrUnavailable},
		{context.Canceled, nil},
		{fmt.Errorf("wrapped: %w", context.DeadlineExceeded), nil},
		{errors.New("something else"), nil},
		{nil, nil},
	} {
		got := openaiError(tc.err)
		for _, k := range []error{openai.ErrInvalid, openai.ErrUnavailable, openai.ErrOverloaded} {
			if errors.Is(got, k) != (k == tc.kind) {
				t.Errorf("%v: maps to %v, want kind %v", tc.err, got, tc.kind)
			}
		}
		if tc.err != nil && (got.Error() != tc.err.Error() || !errors.Is(got, tc.err)) {
			t.Errorf("%v: mapped to %q, want the same message, wrapping it", tc.err, got)
		}
	}
}
