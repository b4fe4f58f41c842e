// Package daemon is tandemd's core: one node of a cluster that serves a
// model by pipeline parallelism.
//
// Every daemon joins the cluster by gossip (package membership),
// announcing its backend, memory, addresses and model identity, and
// offers a stage slot through the internal gRPC service tandem.v1.Node.
// One member is the leader: the one named in the configuration, or the
// leader-eligible live member with the smallest name. The leader places
// the model's layers over the stage nodes (package placement), has each
// load its range and connect to the next (Node.Load, then Node.Connect),
// dials every stage's control link (package pipeline) and runs the request
// loop (package sched: continuous batching over the stages' paged KV
// caches). Every step of the pipeline goes to every stage with the leader's
// epoch; stages refuse older epochs, so a stale leader cannot drive them.
// The leader alone knows every request's tokens; stages hold only caches,
// so a pipeline can always be rebuilt from the leader's state.
//
// Clients call the leader's tandem.v1.Inference (Generate) and
// tandem.v1.Admin (Status) services, with gRPC health (NOT_SERVING until a
// pipeline is ready and while draining) and server reflection. Domain
// errors become gRPC codes in one place (errors.go): INVALID_ARGUMENT for
// bad requests, UNAVAILABLE when no pipeline can serve. When an admin
// token is configured, Admin and Node calls must carry it; TLS is served
// when a certificate is configured.
//
// When a stage node dies the leader stops the pipeline at once (its
// requests fail with UNAVAILABLE) and health turns NOT_SERVING; when one
// leaves gracefully the leader first lets the requests in flight finish.
// A new pipeline is built once enough stage nodes are up again.
//
// # Usage
//
//	cfg, err := daemon.LoadConfig("/etc/tandem/tandemd.toml")
//	...
//	d, err := daemon.New(cfg, slog.Default())
//	...
//	err = d.Run(ctx) // until ctx is cancelled; then drains and returns
//
// testdata/tandemd.toml is a commented example configuration.
//
// # Concurrency
//
// New starts nothing. Run owns the daemon: it starts the gRPC server, the
// membership, the supervisor loop (which alone decides leadership and
// builds and stops pipelines), per running pipeline a sched.Loop (the only
// user of its pipeline.Driver; Generate calls submit requests to it and
// read their token streams, so it never waits on a client) and the
// goroutine that stops it, and one goroutine per assigned stage. Daemon.mu
// guards the state shared with RPC handlers. When Run returns, every
// goroutine it started has ended.
package daemon
