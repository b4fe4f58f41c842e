// Package membership keeps a daemon's view of the cluster by gossip
// (github.com/hashicorp/memberlist): which daemons are alive, and the
// metadata each announces about itself (backend, device memory, addresses,
// version, model identity, leader eligibility).
//
// Each daemon joins through configured seed addresses; a daemon without
// seeds starts a cluster. It retries its seeds until one answers, then
// keeps exchanging state with them every few seconds, so that members find
// each other again after any restart, in any order: a restarted seed (the
// leader, in the usual layout) knows nobody until its joiners call it. Gossip is encrypted with AES when a secret key is
// configured, and a daemon with another key (or none) cannot join.
// memberlist's log lines reach log/slog at their levels; its warnings and
// errors about what a peer sent (one per garbage datagram any local
// process can send) pass at 1 a second in bursts of 10, with a count of
// those dropped. Joins, metadata
// updates, graceful leaves and failures arrive as Events.
//
// Metadata travels in memberlist's node metadata (at most 512 bytes) in a
// versioned binary encoding (meta.go); peers' metadata is untrusted and
// checked when decoded. A graceful Leave first gossips a leaving flag and
// hands it to every live peer in a push/pull exchange, so peers report
// Leave rather than Fail, then gossips the departure and hands that over
// the same way: gossip alone may spend its few sends on dead members.
//
// # Usage
//
//	m, err := membership.New(membership.Config{
//		NodeName: "gpu0", BindPort: 7946, Seeds: []string{"10.0.0.1:7946"},
//		Meta: membership.Meta{Backend: "cuda", GRPCAddr: "10.0.0.2:7070"},
//	})
//	if err := m.Start(ctx); err != nil { ... }
//	defer m.Shutdown()
//	go func() { for ev := range m.Events() { ... } }()
//	...
//	m.Leave(5 * time.Second) // on drain, before Shutdown
//
// # Concurrency
//
// All methods are safe for concurrent use. memberlist calls the delegates
// (delegate.go, events.go) from its own goroutines with its locks held;
// they never block: the member table is updated under a short lock and
// events go to a buffered channel that drops its oldest entry when the
// consumer falls behind (Dropped counts them). No memberlist method is
// called with that lock held. Start leaves one goroutine retrying the
// join, then exchanging state with the seeds, until Leave or Shutdown;
// and Leave goroutines still exchanging state with unresponsive
// peers (each ends within memberlist's TCP timeout); Shutdown stops or
// waits for them, shuts memberlist down and closes Events.
// memberlist's per-connection handlers may outlive Shutdown by the length
// of an in-flight exchange.
package membership
