package daemon

import (
	"context"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// TestAdminToken checks the admin token on a guarded method: the Bearer
// scheme's name in any case and one space or more before the token (RFC
// 6750 via RFC 9110), nothing else; unguarded methods pass.
func TestAdminToken(t *testing.T) {
	a := tokenAuth{token: "s3cret"}
	for _, tc := range []struct {
		auth string
		ok   bool
	}{
		{"Bearer s3cret", true},
		{"bearer s3cret", true},
		{"BEARER s3cret", true},
		{"Bearer   s3cret", true},
		{"Bearer s3cre", false},
		{"Bearer s3cret ", false},
		{"Basic s3cret", false},
		{"Bearers3cret", false},
		{"Bearer ", false},
		{"s3cret", false},
		{"", false},
	} {
		ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs("authorization", tc.auth))
		err := a.check(ctx, "/tandem.v1.Admin/Status")
		if (err == nil) != tc.ok || (err != nil && status.Code(err) != codes.Unauthenticated) {
			t.Errorf("authorization %q: %v, want accepted %t (else UNAUTHENTICATED)", tc.auth, err, tc.ok)
		}
	}
	if err := a.check(context.Background(), "/tandem.v1.Inference/Generate"); err != nil {
		t.Errorf("Generate without a token: %v", err)
	}
}
