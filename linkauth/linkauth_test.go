package linkauth

import (
	"bytes"
	"errors"
	"fmt"
	"testing"
)

func mustCred(t *testing.T, secret string) *Credential {
	t.Helper()
	c, err := NewCredential([]byte(secret))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestHandshake runs the challenge-response between two ends with the same
// secret, and every way it must fail: another secret, another link or
// epoch, reflected or replayed proofs, a credential on one end only.
func TestHandshake(t *testing.T) {
	a := mustCred(t, "0123456789abcdef0123456789abcdef")
	same := mustCred(t, "0123456789abcdef0123456789abcdef")
	other := mustCred(t, "fedcba9876543210fedcba9876543210")
	dn, ln := NewNonce(), NewNonce()
	const link, epoch = "activations->layer3", 7
	lp := a.Prove(Listener, link, epoch, dn, ln)
	dp := a.Prove(Dialer, link, epoch, dn, ln)
	if err := same.Check(Listener, link, epoch, dn, ln, lp); err != nil {
		t.Errorf("same secret, listener's proof: %v", err)
	}
	if err := same.Check(Dialer, link, epoch, dn, ln, dp); err != nil {
		t.Errorf("same secret, dialer's proof: %v", err)
	}
	for _, c := range []struct {
		name  string
		cred  *Credential
		role  Role
		link  string
		epoch uint64
		dn    []byte
		ln    []byte
		proof []byte
		want  error
	}{
		{"another secret", other, Dialer, link, epoch, dn, ln, dp, ErrBadProof},
		{"another link", same, Dialer, "activations->layer4", epoch, dn, ln, dp, ErrBadProof},
		{"another epoch", same, Dialer, link, epoch + 1, dn, ln, dp, ErrBadProof},
		{"reflected", same, Dialer, link, epoch, dn, ln, lp, ErrBadProof},
		{"replayed with a new nonce", same, Dialer, link, epoch, dn, NewNonce(), dp, ErrBadProof},
		{"no proof", same, Dialer, link, epoch, dn, ln, nil, ErrNoProof},
		{"truncated proof", same, Dialer, link, epoch, dn, ln, dp[:16], ErrBadProof},
		{"short nonce", same, Dialer, link, epoch, dn[:8], ln, dp, ErrBadNonce},
		{"proof but no credential", nil, Dialer, link, epoch, dn, ln, dp, ErrUnexpectedProof},
	} {
		if err := c.cred.Check(c.role, c.link, c.epoch, c.dn, c.ln, c.proof); !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
	var none *Credential
	if err := none.Check(Dialer, link, epoch, dn, ln, none.ProveIf(Dialer, link, epoch, dn, ln)); err != nil {
		t.Errorf("no credential on either end: %v", err)
	}
	if _, err := NewCredential([]byte("short")); err == nil {
		t.Error("a 5-byte secret was accepted")
	}
	if bytes.Equal(NewNonce(), NewNonce()) {
		t.Error("two nonces are equal")
	}
	for _, s := range []string{fmt.Sprint(a), fmt.Sprintf("%v %+v", a, a)} {
		if bytes.Contains([]byte(s), a.key) {
			t.Errorf("formatting shows the key: %q", s)
		}
	}
}
