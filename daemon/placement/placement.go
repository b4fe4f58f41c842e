package placement

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"slices"
)

// Node is a daemon that can run a stage.
type Node struct {
	Name string
	// UsableBytes is the memory the stage may use: weights, workspace and
	// KV cache.
	UsableBytes uint64
	// Backend is the node's stage backend ("cpu" or "cuda"); placement
	// copies it into the plan.
	Backend string
}

// Range assigns the layers [Lo, Hi) to a node in an explicit plan.
type Range struct {
	Node   string
	Lo, Hi int
}

// Stage is one stage of a plan: a node and its layers [Lo, Hi).
type Stage struct {
	Node    string
	Backend string
	Lo, Hi  int
	// WeightBytes is what the stage holds besides its KV cache: its layers,
	// the embedding (first stage), the LM head (last stage) and the
	// workspace.
	WeightBytes uint64
	// KVTokens is how many tokens of KV cache the stage's remaining memory
	// holds for its layers.
	KVTokens int
}

// Plan assigns every layer to exactly one stage, in pipeline order.
type Plan struct {
	Stages []Stage
	// KVTokens is the pipeline's KV capacity: the minimum over its stages.
	KVTokens int
	// LeftOut are the nodes placement was given that hold no stage, in
	// name order, each with why.
	LeftOut []LeftOut
}

// LeftOut is a node a plan does not use, and why.
type LeftOut struct {
	Node string
	// Why follows the node's name, as in String: "(middle stage) cannot
	// hold one layer: ...", "would lower the KV capacity: ...", "is not
	// needed: ...", "is not in the explicit plan".
	Why string
}

func (l LeftOut) String() string { return l.Node + " " + l.Why }

// Balance chooses which nodes take part in the pipeline and assigns them
// contiguous layer ranges, in name order, so that the pipeline's KV
// capacity (the minimum over stages of the tokens each stage's free memory
// holds) is as large as possible. Among the plans that reach it, it takes
// one where the most loaded stage has the fewest layers (compute balance),
// and puts the leftover layers on the stages with the most room.
//
// A node takes part when it holds at least one layer without lowering the
// capacity: a node too small to hold one layer in the position it would
// take (the first stage also holds the embedding, the last the LM head) is
// left out, and so is one whose KV cache for a single layer would be the
// pipeline's smallest, for the capacity is the minimum over the stages: a
// small node would cap every request's KV cache at its own. Capacity
// beyond Cost.MaxKVTokens, which the scheduler cannot fill, counts for
// nothing in this choice. Among the choices that reach the capacity it
// takes the most nodes (at most one per layer), then the nodes with the
// most memory, then the earliest names. Plan.LeftOut says which nodes were
// left out and why; an operator who wants a node used anyway gives an
// explicit plan (Explicit).
//
// When no choice of nodes holds the model with at least one token of KV
// cache, the error names the nodes short of memory and by how much.
func Balance(nodes []Node, c Cost) (Plan, error) {
	if err := c.validate(); err != nil {
		return Plan{}, fmt.Errorf("balance: %w", err)
	}
	if err := checkNodes(nodes); err != nil {
		return Plan{}, fmt.Errorf("balance: %w", err)
	}
	ns := slices.Clone(nodes)
	slices.SortFunc(ns, func(a, b Node) int { return cmp.Compare(a.Name, b.Name) })

	if !c.roles(ns, 1).fits(c.Layers) {
		return Plan{}, fmt.Errorf("balance %d layers over %d nodes: %w", c.Layers, len(ns), c.shortfall(ns))
	}
	// Binary search the largest capacity some choice of nodes reaches,
	// up to MaxKVTokens: lo is reached, hi is not (no node holds even one
	// layer with hi tokens of KV) or is past the bound.
	lo, hi := uint64(1), mostUsable(ns)/c.KVBytesPerToken+1
	if c.MaxKVTokens > 0 {
		hi = min(hi, uint64(c.MaxKVTokens)+1)
	}
	for hi-lo > 1 {
		mid := lo + (hi-lo)/2
		if c.roles(ns, mid).fits(c.Layers) {
			lo = mid
		} else {
			hi = mid
		}
	}
	r := c.roles(ns, lo)
	line := c.choose(ns, r)
	chosen := make([]Node, len(line))
	for i, j := range line {
		chosen[i] = ns[j]
	}
	// The chosen nodes' own best capacity, past MaxKVTokens too: the
	// layers go where the memory is.
	caps := make([]int, len(chosen))
	hi = mostUsable(chosen)/c.KVBytesPerToken + 1
	for hi-lo > 1 {
		mid := lo + (hi-lo)/2
		if c.feasible(chosen, mid, caps) {
			lo = mid
		} else {
			hi = mid
		}
	}
	c.feasible(chosen, lo, caps)
	p, err := c.plan(chosen, spread(caps, c.Layers))
	if err != nil {
		return Plan{}, err
	}
	p.LeftOut = c.leftOut(ns, line, r, p.KVTokens)
	return p, nil
}

func mostUsable(ns []Node) uint64 {
	var most uint64
	for _, n := range ns {
		most = max(most, n.UsableBytes)
	}
	return most
}

// spread picks layer counts n[i] in [1, caps[i]] summing to layers (the
// caller ensures it is possible), keeping the largest count as small as
// possible; the counts that must exceed the others go to the stages with
// the largest caps, earlier stages first among equals.
func spread(caps []int, layers int) []int {
	// The smallest ceiling such that the capped counts reach layers.
	ceil := 1
	for total(caps, ceil) < layers {
		ceil++
	}
	counts := make([]int, len(caps))
	for i, c := range caps {
		counts[i] = min(c, ceil)
	}
	// Take one layer back from stages at the ceiling until the sum is
	// exact, the tightest (smallest cap) first, later stages first among
	// equals; ceil-1 ≥ 1 whenever there is an excess.
	excess := total(caps, ceil) - layers
	order := make([]int, len(caps))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int {
		return cmp.Or(cmp.Compare(caps[a], caps[b]), cmp.Compare(b, a))
	})
	for _, i := range order {
		if excess == 0 {
			break
		}
		if counts[i] == ceil {
			counts[i]--
			excess--
		}
	}
	return counts
}

// total is the sum of caps capped at ceil.
func total(caps []int, ceil int) int {
	s := 0
	for _, c := range caps {
		s += min(c, ceil)
	}
	return s
}

// Explicit validates an operator's plan: ranges in pipeline order, each
// on a distinct known node, contiguous and covering [0, Layers), each
// stage fitting its node with room for at least one token of KV cache.
func Explicit(nodes []Node, ranges []Range, c Cost) (Plan, error) {
	if err := c.validate(); err != nil {
		return Plan{}, fmt.Errorf("explicit plan: %w", err)
	}
	if err := checkNodes(nodes); err != nil {
		return Plan{}, fmt.Errorf("explicit plan: %w", err)
	}
	if len(ranges) == 0 {
		return Plan{}, errors.New("explicit plan: no ranges")
	}
	byName := make(map[string]Node, len(nodes))
	for _, n := range nodes {
		byName[n.Name] = n
	}
	used := make(map[string]bool, len(ranges))
	ns := make([]Node, len(ranges))
	counts := make([]int, len(ranges))
	next := 0
	for i, r := range ranges {
		n, ok := byName[r.Node]
		switch {
		case !ok:
			return Plan{}, fmt.Errorf("explicit plan range %d: node %q is not a member", i, r.Node)
		case used[r.Node]:
			return Plan{}, fmt.Errorf("explicit plan range %d: node %q has two ranges", i, r.Node)
		case r.Lo != next:
			return Plan{}, fmt.Errorf("explicit plan range %d (%s): starts at layer %d, want %d", i, r.Node, r.Lo, next)
		case r.Hi <= r.Lo:
			return Plan{}, fmt.Errorf("explicit plan range %d (%s): empty layer range [%d, %d)", i, r.Node, r.Lo, r.Hi)
		case r.Hi > c.Layers:
			return Plan{}, fmt.Errorf("explicit plan range %d (%s): ends at layer %d, model has %d", i, r.Node, r.Hi, c.Layers)
		}
		used[r.Node] = true
		ns[i], counts[i], next = n, r.Hi-r.Lo, r.Hi
	}
	if next != c.Layers {
		return Plan{}, fmt.Errorf("explicit plan: covers layers [0, %d), model has %d", next, c.Layers)
	}
	p, err := c.plan(ns, counts)
	if err != nil {
		return Plan{}, fmt.Errorf("explicit plan: %w", err)
	}
	for _, n := range nodes {
		if !used[n.Name] {
			p.LeftOut = append(p.LeftOut, LeftOut{Node: n.Name, Why: "is not in the explicit plan"})
		}
	}
	slices.SortFunc(p.LeftOut, func(a, b LeftOut) int { return cmp.Compare(a.Node, b.Node) })
	return p, nil
}

func checkNodes(nodes []Node) error {
	if len(nodes) == 0 {
		return errors.New("no nodes")
	}
	seen := make(map[string]bool, len(nodes))
	for _, n := range nodes {
		if n.Name == "" {
			return errors.New("node with an empty name")
		}
		if seen[n.Name] {
			return fmt.Errorf("node %q listed twice", n.Name)
		}
		seen[n.Name] = true
	}
	return nil
}

func (c Cost) validate() error {
	if c.Layers <= 0 {
		return fmt.Errorf("cost: %d layers", c.Layers)
	}
	if c.KVBytesPerToken == 0 {
		return errors.New("cost: zero KV bytes per token")
	}
	return nil
}

// fixed is what a stage holds besides its layers and KV cache.
func (c Cost) fixed(first, last bool) uint64 {
	f := c.WorkspaceBytes
	switch {
	case first && last && c.Tied:
		// One matrix, serving as embedding and head, and the final norm.
		f = add(f, max(c.EmbedBytes, c.HeadBytes))
	default:
		if first {
			f = add(f, c.EmbedBytes)
		}
		if last {
			f = add(f, c.HeadBytes)
		}
	}
	return f
}

// maxLayers is how many layers a node at position (first, last) holds
// with tokens tokens of KV cache for each.
func (c Cost) maxLayers(n Node, first, last bool, tokens uint64) int {
	f := c.fixed(first, last)
	if n.UsableBytes < f {
		return 0
	}
	per := add(c.LayerBytes, mul(tokens, c.KVBytesPerToken))
	if per == 0 {
		return math.MaxInt
	}
	return int(min((n.UsableBytes-f)/per, math.MaxInt))
}

// feasible reports whether every node, in order, can hold at least one
// layer and all of them together every layer, each with tokens tokens of
// KV cache. It fills caps with each node's most layers.
func (c Cost) feasible(ns []Node, tokens uint64, caps []int) bool {
	sum, ok := 0, true
	for i, n := range ns {
		caps[i] = c.maxLayers(n, i == 0, i == len(ns)-1, tokens)
		if caps[i] < 1 {
			ok = false
		}
		sum += min(caps[i], c.Layers)
	}
	return ok && sum >= c.Layers
}

// plan builds the plan giving counts[i] layers to ns[i], in order, and
// checks each stage fits with at least one token of KV cache.
func (c Cost) plan(ns []Node, counts []int) (Plan, error) {
	p := Plan{Stages: make([]Stage, len(ns)), KVTokens: math.MaxInt}
	lo := 0
	for i, n := range ns {
		hi := lo + counts[i]
		weights, kvTokens := c.stage(n.UsableBytes, lo, hi)
		if kvTokens < 1 {
			need := add(weights, mul(uint64(counts[i]), c.KVBytesPerToken))
			return Plan{}, fmt.Errorf("node %q %s with layers [%d, %d) has %d bytes usable, needs %d: short by %d",
				n.Name, role(i == 0, i == len(ns)-1), lo, hi, n.UsableBytes, need, need-n.UsableBytes)
		}
		p.Stages[i] = Stage{Node: n.Name, Backend: n.Backend, Lo: lo, Hi: hi, WeightBytes: weights, KVTokens: kvTokens}
		p.KVTokens = min(p.KVTokens, kvTokens)
		lo = hi
	}
	return p, nil
}

// stage is what a stage holding layers [lo, hi) in usable bytes stores
// besides its KV cache, and how many tokens of KV cache fit beside it.
func (c Cost) stage(usable uint64, lo, hi int) (weights uint64, kvTokens int) {
	k := uint64(hi - lo)
	weights = add(c.fixed(lo == 0, hi == c.Layers), mul(k, c.LayerBytes))
	if usable > weights {
		kvTokens = int(min((usable-weights)/mul(k, c.KVBytesPerToken), math.MaxInt))
	}
	return weights, kvTokens
}

// StageKVTokens is the KV capacity, in tokens, of a stage holding layers
// [lo, hi) in usable bytes, counted as Balance and Explicit count it. It is
// an error when not even one token fits.
func (c Cost) StageKVTokens(usable uint64, lo, hi int) (int, error) {
	if err := c.validate(); err != nil {
		return 0, err
	}
	if lo < 0 || hi > c.Layers || lo >= hi {
		return 0, fmt.Errorf("layers [%d, %d) of a model of %d", lo, hi, c.Layers)
	}
	weights, kvTokens := c.stage(usable, lo, hi)
	if kvTokens < 1 {
		need := add(weights, mul(uint64(hi-lo), c.KVBytesPerToken))
		return 0, fmt.Errorf("layers [%d, %d) need %d bytes with one token of KV cache, more than the %d the stage may use: short by %d", lo, hi, need, usable, need-usable)
	}
	return kvTokens, nil
}

// StageBytes is the memory a stage holding layers [lo, hi) with kvTokens
// tokens of KV cache uses, counted as Balance and Explicit count it: its
// weights, workspace and KV cache.
func (c Cost) StageBytes(lo, hi, kvTokens int) uint64 {
	weights, _ := c.stage(0, lo, hi)
	return add(weights, mul(uint64(max(kvTokens, 0)), mul(uint64(hi-lo), c.KVBytesPerToken)))
}

// add and mul saturate at the largest uint64 instead of wrapping: a
// saturated size never fits any node.
func add(a, b uint64) uint64 {
	s, carry := bits.Add64(a, b, 0)
	if carry != 0 {
		return math.MaxUint64
	}
	return s
}

func mul(a, b uint64) uint64 {
	hi, lo := bits.Mul64(a, b)
	if hi != 0 {
		return math.MaxUint64
	}
	return lo
}
