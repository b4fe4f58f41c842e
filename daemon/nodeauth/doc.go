// Package nodeauth authenticates the calls of the internal Node service
// (tandem.v1.Node), through which the leader assigns stages: without it,
// anyone who reaches a node's gRPC port could load a stage at an epoch of
// 2^64-1 and so make it refuse every real leader.
//
// Every call carries, as gRPC metadata, the calling node's name, its
// internal protocol versions (nodewire.Protocol), the time and a fresh
// nonce, and a proof: an HMAC of the cluster credential (package
// linkauth) over all of these, the method and the request's bytes. The
// server refuses a caller of other protocol versions (naming both), a
// call without a proof or with a wrong one, one made more than MaxSkew
// from its own clock, and a replay of a call it accepted; then it asks
// Authorize whether the caller may make the call (the daemon: is it the
// leader membership names?). Without a credential, calls still name
// their caller and protocol, unproven, and the server checks those.
//
// # Usage
//
//	// client (the leader)
//	conn, err := grpc.NewClient(addr, grpc.WithUnaryInterceptor(nodeauth.Signer{Node: "leader", Protocol: nodewire.Protocol, Credential: cred}.Unary))
//	// server (every node)
//	v := nodeauth.NewVerifier(nodeauth.VerifierConfig{Protocol: nodewire.Protocol, Credential: cred, Authorize: isLeader})
//	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(v.Unary))
//
// # Concurrency
//
// A Signer is immutable. A Verifier is safe for concurrent use: its replay
// cache is guarded by a mutex; Authorize runs on the calling goroutine
// without it.
package nodeauth
