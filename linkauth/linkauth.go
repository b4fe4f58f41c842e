package linkauth

import (
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
)

// MinSecret is the shortest secret a Credential is derived from, in bytes.
const MinSecret = 16

// NonceSize is the size of a challenge nonce; ProofSize of a proof.
const (
	NonceSize = 32
	ProofSize = sha256.Size
)

// Role says which end of a link a proof is made by: the two ends' proofs
// over the same nonces differ, so a proof cannot be reflected back.
type Role string

// The ends of a link.
const (
	Dialer   Role = "dialer"
	Listener Role = "listener"
)

// Credential is the cluster credential: a key derived from the configured
// secret, the same on every node configured with the same secret. The zero
// value is not usable; a nil *Credential means "no authentication".
type Credential struct {
	key []byte
}

// credentialInfo is HKDF's info string: it binds the key to this use, so
// that the same secret used elsewhere (memberlist's gossip encryption)
// yields an unrelated key.
const credentialInfo = "tandem link authentication v1"

// NewCredential derives the cluster credential from secret (the gossip key
// or the contents of a cluster key file), at least MinSecret bytes.
func NewCredential(secret []byte) (*Credential, error) {
	if len(secret) < MinSecret {
		return nil, fmt.Errorf("link authentication: secret of %d bytes, want at least %d", len(secret), MinSecret)
	}
	key, err := hkdf.Key(sha256.New, secret, nil, credentialInfo, sha256.Size)
	if err != nil {
		return nil, fmt.Errorf("link authentication: derive the credential: %w", err)
	}
	return &Credential{key: key}, nil
}

// String never shows the key.
func (c *Credential) String() string {
	if c == nil {
		return "no credential"
	}
	return "cluster credential"
}

// NewNonce returns NonceSize fresh random bytes.
func NewNonce() []byte {
	n := make([]byte, NonceSize)
	rand.Read(n) // never fails (crypto/rand since go1.24)
	return n
}

// Prove returns role's proof of holding the credential for one handshake:
// HMAC-SHA256 over the role, the link's name, the epoch and both nonces
// (the dialer's first), so it is good for that link, epoch and handshake
// only.
func (c *Credential) Prove(role Role, link string, epoch uint64, dialerNonce, listenerNonce []byte) []byte {
	m := hmac.New(sha256.New, c.key)
	field(m, []byte(credentialInfo))
	field(m, []byte(role))
	field(m, []byte(link))
	m.Write(binary.BigEndian.AppendUint64(nil, epoch))
	field(m, dialerNonce)
	field(m, listenerNonce)
	return m.Sum(nil)
}

func field(h hash.Hash, b []byte) {
	h.Write(binary.BigEndian.AppendUint32(nil, uint32(len(b))))
	h.Write(b)
}

// Errors of Check.
var (
	// ErrNoProof: the peer sent no proof, but this end holds a credential.
	ErrNoProof = errors.New("the peer sent no proof of the cluster credential (is it configured without the cluster secret?)")
	// ErrUnexpectedProof: the peer sent a proof, but this end holds no
	// credential to check it with.
	ErrUnexpectedProof = errors.New("the peer authenticates with a cluster credential, but none is configured here")
	// ErrBadProof: the proof is wrong: another secret, another link or
	// epoch, or a forgery.
	ErrBadProof = errors.New("the peer's proof of the cluster credential is wrong (another cluster secret, link or epoch?)")
	// ErrBadNonce: a nonce is not NonceSize bytes.
	ErrBadNonce = fmt.Errorf("a challenge nonce is not %d bytes", NonceSize)
)

// Check verifies the proof a peer playing role sent; c may be nil (no
// credential configured here), and proof empty (none sent). Both empty
// passes: neither end authenticates. The comparison takes constant time.
func (c *Credential) Check(role Role, link string, epoch uint64, dialerNonce, listenerNonce, proof []byte) error {
	switch {
	case c == nil && len(proof) == 0:
		return nil
	case c == nil:
		return ErrUnexpectedProof
	case len(proof) == 0:
		return ErrNoProof
	case len(dialerNonce) != NonceSize || len(listenerNonce) != NonceSize:
		return ErrBadNonce
	}
	if !hmac.Equal(proof, c.Prove(role, link, epoch, dialerNonce, listenerNonce)) {
		return ErrBadProof
	}
	return nil
}

// ProveIf is Prove, or nil for a nil credential (no authentication).
func (c *Credential) ProveIf(role Role, link string, epoch uint64, dialerNonce, listenerNonce []byte) []byte {
	if c == nil {
		return nil
	}
	return c.Prove(role, link, epoch, dialerNonce, listenerNonce)
}

// signInfo separates Sign's MACs from Prove's: Prove's first field is
// credentialInfo, Sign's this, so neither can stand for the other.
const signInfo = "tandem signed message v1"

// Sign returns an HMAC-SHA256 of the credential over purpose and fields,
// each length-prefixed, for messages that are not a link handshake (for
// example an internal RPC: its method, caller, time, nonce and body).
// Purpose separates the uses of one credential.
func (c *Credential) Sign(purpose string, fields ...[]byte) []byte {
	m := hmac.New(sha256.New, c.key)
	field(m, []byte(signInfo))
	field(m, []byte(purpose))
	for _, f := range fields {
		field(m, f)
	}
	return m.Sum(nil)
}

// Verify reports whether sig is Sign(purpose, fields...), in constant
// time.
func (c *Credential) Verify(sig []byte, purpose string, fields ...[]byte) bool {
	return hmac.Equal(sig, c.Sign(purpose, fields...))
}

// DeriveKey derives a key of n bytes from secret for another use than
// link authentication, named by info (for example the gossip encryption
// key from the cluster secret), unrelated to the credential and to keys
// of other infos.
func DeriveKey(secret []byte, info string, n int) ([]byte, error) {
	if len(secret) < MinSecret {
		return nil, fmt.Errorf("derive %s: secret of %d bytes, want at least %d", info, len(secret), MinSecret)
	}
	return hkdf.Key(sha256.New, secret, nil, info, n)
}
