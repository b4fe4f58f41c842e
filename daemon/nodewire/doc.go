// Package nodewire holds the conventions of the internal Node service
// (tandem.v1.Node) shared by its client, the leader's supervisor, and its
// server, the stage host: the trailer in which a node names the epoch it
// has accepted, CUDA-graph keys on the wire, advertised addresses, and how
// model identities are shortened in messages.
//
// # Concurrency
//
// Every function is pure and safe for concurrent use.
package nodewire
