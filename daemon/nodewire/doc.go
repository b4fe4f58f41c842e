// Package nodewire holds the conventions of the internal Node service
// (tandem.v1.Node) shared by its client, the leader's supervisor, and its
// server, the stage host: the trailer in which a node names the epoch it
// has accepted, CUDA-graph keys on the wire, advertised addresses, how
// model identities are shortened in messages, the internal protocol
// versions a node speaks (Protocol) and the name of a stage's control link
// (ControlLink).
//
// # Concurrency
//
// Every function is pure and safe for concurrent use.
package nodewire
