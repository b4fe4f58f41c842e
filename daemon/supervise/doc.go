// Package supervise is the leader's supervision: it follows the
// membership, places the model over the stage nodes, builds pipelines,
// and keeps the requests alive across them.
//
// Core is a goroutine-free state machine, tested with golden scripts
// (testdata/*.txt, see TestScripts). Its inputs (Event) are membership
// snapshots, the ends of builds, failures of pipelines, admin commands
// (Drain, Undrain, Rebalance) and time passing; its outputs (Action) are
// what to do: build this plan at epoch N, switch the requests to it, close
// that pipeline, retire it, fail the requests with this reason. It decides:
//
//   - Leadership: the configured leader, else the eligible live member
//     with the smallest name (ChooseLeader). A node that stops leading
//     retires its pipeline: the requests accepted finish, none is
//     admitted.
//   - The first placement waits for CoreConfig.ExpectStages stage nodes
//     of the model (a start-up wait only).
//   - Placement may leave stage nodes out (placement.Balance: too small
//     to hold a layer where they would stand, or lowering the KV
//     capacity): the pipeline is placed over the others, the nodes left
//     out are logged when they or their reasons change, and
//     Status.LeftOut names them with why. A placement over the
//     candidates that keeps the serving stages (auto-rebalance's, once
//     the membership is stable) updates the reasons for nodes that
//     joined since.
//   - A lost pipeline (the engine reports a failed step or broken link,
//     blaming a stage; or the membership declares a stage node dead) is
//     closed and rebuilt at once, at a new epoch, over the stage nodes
//     left that can hold the model; the node blamed is left out until it
//     restarts or SuspectFor passes. Meanwhile the accepted requests wait
//     and new ones queue, for at most RecoveryTimeout: then they fail with
//     UNAVAILABLE naming why, and new requests fail at once until a
//     pipeline serves again.
//   - A stage node leaving (SIGTERM) or drained is a planned removal: a
//     pipeline without it is built and the requests switch to it. If none
//     is possible, a leaving node's pipeline retires (its requests finish
//     first); a drained one keeps serving.
//   - Every build while a pipeline serves is alongside it (Build.Alongside):
//     the stage nodes keep their stages of the serving pipeline where their
//     memory allows and reuse those whose layers do not change; if the
//     serving pipeline stops meanwhile (a node had to release its old
//     stage), its requests wait for the new one, and the change stays the
//     move's.
//   - A node that takes the leadership over from another member builds at
//     once over the stage nodes left: the ExpectStages wait is for a
//     cluster's start only.
//   - With AutoRebalance, once the candidates have been stable for
//     StableFor, the pipeline moves when the placement over them restores
//     a node lost or undrained, or raises the KV capacity by 10% or more;
//     a placement an operator asked for explicitly stays until the
//     membership changes. An operator's undrain needs no stable wait.
//   - With BalanceAfter, once the candidates have been stable for StableFor
//     and every stage of the serving pipeline has measured that much time
//     in its steps (StageTimes, which the Supervisor reads from the stages'
//     timing reports on every tick), the pipeline moves to the placement
//     those times call for (placement.ByTime) when it makes the slowest
//     stage 10% faster or more, after auto-rebalance has had its say; that
//     placement stays, like one asked for, until the membership changes.
//   - Events of an epoch no longer serving (a zombie stage's, a build
//     given up) are stale: ignored, or, for a built pipeline, closed.
//
// Supervisor is the thin loop that feeds the Core and performs its
// actions: Builder runs a build (Node.Load, Capture, Connect, Join, then
// the control links), Engine is the request path over the pipelines.
// Engine holds one sched.Loop for as long as the node leads: switching to
// a new pipeline abandons the steps in flight and re-prefills every
// running request from its prompt and the tokens already streamed (its
// stream goes on, no token repeated or skipped; seeded sampling depends
// on the request's seed and token index only, so it gives the tokens of an
// uninterrupted run). A failed step or a link broken while idle
// (pipeline.Driver.Broken) reaches the Core as StageFailed, naming the
// stage the driver blamed, or the first that does not answer a health
// probe when the driver could name none (a step past its deadline).
//
// # Usage
//
//	sup := supervise.New(supervise.Config{Core: ..., Builder: ..., Probe: ..., OnStatus: ...}, memb)
//	go sup.Run(ctx)                        // until ctx is done
//	stream, err := sup.Engine().Submit(reqCtx, req)
//	...
//	sup.Stop(drainTimeout, "node a is draining") // after Run returned
//
// # Concurrency
//
// A Core is used by one goroutine. A Supervisor's Run is its loop
// goroutine, the only user of the Core; it runs each build on a goroutine
// of its own, closes and releases pipelines on others, and hands every
// failure report to the loop through a channel; Admin commands go
// through the same channel, and Move.Wait waits for the build one started
// (answered once the step that switched to it, or gave it up, is in the
// Snapshot). The Engine's scheduler loop owns its
// goroutines (package sched); its failure callback only hands the report
// on. Snapshot, Engine and Admin are safe for concurrent use. Stop, once
// Run has returned, drains the requests, closes every pipeline and waits
// for every goroutine the supervisor started.
package supervise
