// Package linkauth is the authentication primitive of tandem's internal
// links (the leader's control links to its stages, the data links between
// stages): a mutual HMAC challenge-response bound to the link's name, the
// leader epoch and both ends' fresh nonces, keyed by a cluster credential
// derived (HKDF-SHA256) from a configured secret, the gossip key or a
// cluster key file. Each link's handshake carries the nonces and proofs in
// its own framing (pipeline's control protocol, collective's TCP
// handshake); this package makes and checks them.
//
// A handshake: the dialer sends its nonce; the listener answers with its
// nonce and its proof (Prove(Listener, ...)); the dialer checks it and
// sends its own proof (Prove(Dialer, ...)); the listener checks that. The
// roles make the two proofs differ, the nonces make every handshake's
// proofs new, and the link name and epoch make a proof for one link or
// epoch useless on another. Without a credential on either end no proof
// is sent and Check passes; a credential on one end only fails the
// handshake with an error saying so.
//
// # Usage
//
//	cred, err := linkauth.NewCredential(secret) // on every node
//	// dialer:   dn := linkauth.NewNonce(); send dn; receive ln, lproof
//	err = cred.Check(linkauth.Listener, link, epoch, dn, ln, lproof)
//	send(cred.ProveIf(linkauth.Dialer, link, epoch, dn, ln))
//	// listener: receive dn; ln := linkauth.NewNonce()
//	send(ln, cred.ProveIf(linkauth.Listener, link, epoch, dn, ln))
//	err = cred.Check(linkauth.Dialer, link, epoch, dn, ln, dproof)
//
// Messages that are not a link handshake (the Node service's calls, see
// package nodeauth) are signed with Sign and checked with Verify: an HMAC
// of the same credential over a purpose and length-prefixed fields,
// separated from the handshake's proofs. DeriveKey derives keys for other
// uses of the cluster secret (the gossip encryption key).
//
// # Concurrency
//
// A Credential is immutable and safe for concurrent use.
package linkauth
