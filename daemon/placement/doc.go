// Package placement decides which node runs which layers: pure functions
// over the members' usable memory and the model's cost, no I/O.
//
// A plan splits the model's layers into contiguous ranges, one per stage,
// in pipeline order. The first stage also holds the embedding and the last
// the final norm and LM head, and every stage a workspace; what remains of
// a node's memory holds the KV cache of its layers. The pipeline's KV
// capacity is the minimum over its stages, so Balance maximises that
// minimum (a binary search on the capacity, each step an O(nodes²) check
// over the choices of first and last stage), not the evenness of layer
// counts: a node with more memory gets more layers, and the first and
// last stages fewer. Stages follow the nodes' names. Balance also chooses
// which nodes take part: one that cannot hold a layer where it would
// stand, or would hold so little KV cache with one that it lowers the
// pipeline's capacity, is left out, and the plan says which and why
// (Plan.LeftOut), as it does for the nodes an explicit plan does not
// name. Explicit validates an operator's plan instead.
//
// # Usage
//
//	cost := placement.CostOf(cfg, 2) // bfloat16 weights and KV cache
//	cost.WorkspaceBytes = placement.Workspace(cfg, 512, 64)
//	plan, err := placement.Balance([]placement.Node{
//		{Name: "gpu0", UsableBytes: 70 << 30, Backend: "cuda"},
//		{Name: "gpu1", UsableBytes: 70 << 30, Backend: "cuda"},
//	}, cost)
//	for _, s := range plan.Stages { ... s.Node, s.Lo, s.Hi, s.KVTokens ... }
//	for _, l := range plan.LeftOut { ... l.Node, l.Why ... }
//
// # Concurrency
//
// Every function is pure: safe for concurrent use, and deterministic (the
// same nodes, in any order, and cost give the same plan).
package placement
