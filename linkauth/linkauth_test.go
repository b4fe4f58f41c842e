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

// TestSign checks Sign and Verify: the same credential verifies, another
// secret, purpose or field does not, and moving bytes between fields
// changes the MAC (fields are length-prefixed).
func TestSign(t *testing.T) {
	a := mustCred(t, "0123456789abcdef0123456789abcdef")
	same := mustCred(t, "0123456789abcdef0123456789abcdef")
	other := mustCred(t, "fedcba9876543210fedcba9876543210")
	sig := a.Sign("node call", []byte("Load"), []byte("leader"))
	if !same.Verify(sig, "node call", []byte("Load"), []byte("leader")) {
		t.Error("the same secret does not verify")
	}
	for name, ok := range map[string]bool{
		"another secret":  other.Verify(sig, "node call", []byte("Load"), []byte("leader")),
		"another purpose": same.Verify(sig, "other", []byte("Load"), []byte("leader")),
		"another field":   same.Verify(sig, "node call", []byte("Load"), []byte("stage-1")),
		"moved bytes":     same.Verify(sig, "node call", []byte("Loadl"), []byte("eader")),
		"truncated":       same.Verify(sig[:16], "node call", []byte("Load"), []byte("leader")),
		"a link proof":    same.Verify(a.Prove(Dialer, "Load", 0, []byte("leader"), nil), "node call", []byte("Load"), []byte("leader")),
	} {
		if ok {
			t.Errorf("%s verifies", name)
		}
	}
	k1, err := DeriveKey([]byte("0123456789abcdef"), "gossip", 32)
	if err != nil {
		t.Fatal(err)
	}
	k2, _ := DeriveKey([]byte("0123456789abcdef"), "other", 32)
	if len(k1) != 32 || bytes.Equal(k1, k2) {
		t.Errorf("derived keys: %x and %x", k1, k2)
	}
	if _, err := DeriveKey([]byte("short"), "gossip", 32); err == nil {
		t.Error("a 5-byte secret was accepted")
	}
}
