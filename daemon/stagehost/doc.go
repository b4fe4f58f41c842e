// Package stagehost is a node's stage slot: its side of the internal Node
// service (tandem.v1.Node), through which the leader assigns it a layer
// range of the model and wires it into a pipeline, and the pipeline
// worker that serves that stage.
//
// The leader calls, for one epoch: Load (build the stage on this node's
// device, CPU or one GPU, with a KV cache sized from the memory it may
// use; listen for the control link and the TCP link coming in), Capture
// (CUDA graphs of the leader's dispatcher keys, before wiring), Connect
// (dial the next stage's TCP link and the hand-off ring, or make the NCCL
// ids of the links this stage sends on), Join (join the NCCL links it
// receives on), then dials the control link; the slot then runs a
// pipeline.Worker until the leader closes that link, a newer epoch
// replaces the assignment, Release ends it, or the slot stops. A call of
// an epoch older than the newest accepted is refused with
// FAILED_PRECONDITION, the node's epoch in the nodewire.EpochTrailer
// trailer, so a stale leader cannot drive the stage (Release of an
// assignment the slot still holds is always done).
//
// While the pipeline moves, a slot holds two assignments: the serving
// pipeline's and the new one's. A Load with alongside set keeps the
// serving assignment running where the node's memory holds both stages
// (placement.Cost counts them; a CUDA stage sizes its KV cache from the
// device's free memory, so one is never loaded beside another), else
// releases it first. A stage of the same layers, batch bounds and block
// size is reused, weights and all (LoadResponse.reused): both
// assignments hold it, the old one runs its steps until the new one's
// first step takes it over (the old worker ends, the stage forgets its
// sequences: Reset), and it closes with the last assignment. A move shows
// through the progress seam as "move layers [a,b) -> [c,d)" (or "keep
// layers [a,b)") in three steps: load, wire, switch.
//
// The control link and the TCP links are authenticated with the cluster
// credential (Config.Credential; auth.go); the Node calls themselves are
// checked before they reach the slot (package nodeauth, in the daemon).
//
// Links between stages: NCCL between two CUDA stages (a two-rank
// communicator per link, on a stream of its own), TCP otherwise, a CUDA end
// staging through host memory. Device opens what the stage runs on.
//
// Loading a stage's weights, compiling a CUDA stage's kernels and
// capturing its graphs show their progress through Config.Progress (bars
// or log lines, as the daemon chose): the weights through a
// model.Counted, the CUDA steps through cuda.Config.Progress.
//
// # Usage
//
//	dev, err := stagehost.OpenDevice(stagehost.BackendAuto, 0, log)
//	...
//	usable, err := dev.Usable(0) // 90% of the free memory
//	slot := stagehost.New(stagehost.Config{Name: "gpu0", Checkpoint: ckpt, Device: dev, Usable: usable, Cost: cost, ...})
//	defer slot.Stop()
//	tandemv1.RegisterNodeServer(grpcServer, slot)
//
// # Concurrency
//
// The Node calls are serialized by the slot's mutex. Each assignment runs
// on one goroutine (wiring, then the worker), with, while it is wired, one
// that accepts its TCP link in and one per NCCL link it joins; Release, a
// newer Load or Stop ends it and waits for it, and so does the first step
// of a newer assignment that takes its stage over (on that assignment's
// goroutine, under the stage's own mutex, not the slot's). A GPU stage is driven
// through its gpu.Device goroutine. Stop ends every goroutine the slot
// started.
package stagehost
