package placement

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
)

// A lineup is a choice of nodes for a pipeline: indices into the nodes in
// name order, ascending. The first carries the embedding, the last the LM
// head (one node alone carries both), the others are middle stages. A
// lineup is given by its ends f ≤ l: between them it takes every node
// that holds a layer as a middle stage, the most memory first (then the
// earliest names) when there are more than the Layers-2 a pipeline of
// Layers layers has room for. A node that could join a lineup only ever
// adds layers to it (the end it displaces becomes a middle stage, which
// holds more), so no other choice of nodes between the ends holds more.

// roles holds each node's most layers in each position of a pipeline,
// capped at the model's, with some tokens of KV cache for each layer.
type roles struct {
	first, middle, last, only []int
}

func (c Cost) roles(ns []Node, tokens uint64) roles {
	r := roles{make([]int, len(ns)), make([]int, len(ns)), make([]int, len(ns)), make([]int, len(ns))}
	for i, n := range ns {
		r.first[i] = min(c.maxLayers(n, true, false, tokens), c.Layers)
		r.middle[i] = min(c.maxLayers(n, false, false, tokens), c.Layers)
		r.last[i] = min(c.maxLayers(n, false, true, tokens), c.Layers)
		r.only[i] = min(c.maxLayers(n, true, true, tokens), c.Layers)
	}
	return r
}

// middles are, for the lineups' middle stages, the number of nodes before
// index i that hold a layer as a middle stage and the layers they hold.
func (r roles) middles() (count, held []int) {
	count, held = make([]int, len(r.middle)+1), make([]int, len(r.middle)+1)
	for i, m := range r.middle {
		count[i+1], held[i+1] = count[i], held[i]
		if m >= 1 {
			count[i+1]++
			held[i+1] += m
		}
	}
	return count, held
}

// each calls fn with the ends of every lineup (f == l: one node alone),
// the number of nodes it takes and the layers they hold together (capped
// at layers), until fn returns false.
func (r roles) each(layers int, fn func(f, l, nodes, held int) bool) {
	for i, o := range r.only {
		if o >= 1 && !fn(i, i, 1, o) {
			return
		}
	}
	if layers < 2 {
		return
	}
	count, held := r.middles()
	for f, cf := range r.first {
		if cf < 1 {
			continue
		}
		for l := f + 1; l < len(r.last); l++ {
			if r.last[l] < 1 {
				continue
			}
			k, h := count[l]-count[f+1], held[l]-held[f+1]
			nodes, all := 2+k, min(cf+r.last[l]+h, layers)
			if k >= layers-2 {
				// As many middle stages as layers left: each holds one.
				nodes, all = layers, layers
			}
			if !fn(f, l, nodes, all) {
				return
			}
		}
	}
}

// fits reports whether some lineup holds every layer.
func (r roles) fits(layers int) bool {
	ok := false
	r.each(layers, func(_, _, _, held int) bool {
		ok = held >= layers
		return !ok
	})
	return ok
}

// members is the lineup of ends f and l.
func (c Cost) members(ns []Node, r roles, f, l int) []int {
	if f == l {
		return []int{f}
	}
	var mid []int
	for i := f + 1; i < l; i++ {
		if r.middle[i] >= 1 {
			mid = append(mid, i)
		}
	}
	if len(mid) > c.Layers-2 {
		slices.SortStableFunc(mid, func(a, b int) int { return cmp.Compare(ns[b].UsableBytes, ns[a].UsableBytes) })
		mid = mid[:c.Layers-2]
		slices.Sort(mid)
	}
	return append(append([]int{f}, mid...), l)
}

// better reports whether lineup a is preferred to b of as many nodes: its
// memories, largest first, are larger, then its names earlier.
func better(ns []Node, a, b []int) bool {
	mem := func(line []int) []uint64 {
		m := make([]uint64, len(line))
		for i, j := range line {
			m[i] = ns[j].UsableBytes
		}
		slices.SortFunc(m, func(x, y uint64) int { return cmp.Compare(y, x) })
		return m
	}
	if d := slices.Compare(mem(a), mem(b)); d != 0 {
		return d > 0
	}
	return slices.Compare(a, b) < 0
}

// pick is the preferred lineup of those accept takes, given the layers
// they hold: the most held, then the most nodes, then better (nil: none).
func (c Cost) pick(ns []Node, r roles, accept func(held int) bool) []int {
	var best []int
	bestHeld := 0
	r.each(c.Layers, func(f, l, nodes, held int) bool {
		switch {
		case !accept(held):
		case best == nil || held > bestHeld || (held == bestHeld && nodes > len(best)):
			best, bestHeld = c.members(ns, r, f, l), held
		case held == bestHeld && nodes == len(best):
			if line := c.members(ns, r, f, l); better(ns, line, best) {
				best = line
			}
		}
		return true
	})
	return best
}

// choose is the preferred lineup holding every layer at r (some does).
func (c Cost) choose(ns []Node, r roles) []int {
	return c.pick(ns, r, func(held int) bool { return held >= c.Layers })
}

// leftOut says why each node outside line holds no stage; r are the roles
// at the capacity line reaches (up to MaxKVTokens), kv the plan's.
func (c Cost) leftOut(ns []Node, line []int, r roles, kv int) []LeftOut {
	var out []LeftOut
	in := make(map[int]bool, len(line))
	for _, i := range line {
		in[i] = true
	}
	for i, n := range ns {
		if in[i] {
			continue
		}
		// The position it would take: the lineup is in name order.
		first, last := i < line[0], i > line[len(line)-1]
		var why string
		switch one := c.oneLayerKV(n, first, last); {
		case one < 1:
			why = c.tooSmall(n, first, last)
		case (first && r.first[i] < 1) || (last && r.last[i] < 1) || (!first && !last && r.middle[i] < 1):
			why = fmt.Sprintf("would lower the KV capacity: with one layer %s it holds %d tokens, the pipeline %d without it", role(first, last), one, kv)
		default:
			why = fmt.Sprintf("is not needed: the model's %d layers have a stage each", c.Layers)
		}
		out = append(out, LeftOut{Node: n.Name, Why: why})
	}
	return out
}

// oneLayerKV is the tokens of KV cache a node holds with one layer in a
// position (0: not one).
func (c Cost) oneLayerKV(n Node, first, last bool) int {
	w := add(c.fixed(first, last), c.LayerBytes)
	if n.UsableBytes <= w {
		return 0
	}
	return int(min((n.UsableBytes-w)/c.KVBytesPerToken, math.MaxInt))
}

// tooSmall says how far a node is from holding one layer, with one token
// of KV cache, in a position.
func (c Cost) tooSmall(n Node, first, last bool) string {
	need := add(add(c.fixed(first, last), c.LayerBytes), c.KVBytesPerToken)
	return fmt.Sprintf("%s cannot hold one layer: has %d bytes usable, needs %d: short by %d", role(first, last), n.UsableBytes, need, need-n.UsableBytes)
}

// shortfall explains why no lineup of ns holds the model with one token
// of KV cache: what the lineup holding the most layers lacks, and the
// nodes too small to join it; or, when no lineup holds a layer, the nodes
// too small for their place in name order.
func (c Cost) shortfall(ns []Node) error {
	r := c.roles(ns, 1)
	line := c.pick(ns, r, func(int) bool { return true })
	if line == nil {
		var short []string
		for i, n := range ns {
			first, last := i == 0 || c.Layers == 1, i == len(ns)-1 || c.Layers == 1
			if c.oneLayerKV(n, first, last) < 1 {
				short = append(short, fmt.Sprintf("node %q %s", n.Name, c.tooSmall(n, first, last)))
			}
		}
		return fmt.Errorf("no pipeline of the nodes holds a layer: %s", strings.Join(short, "; "))
	}
	held, parts := 0, make([]string, len(line))
	for k, i := range line {
		var n int
		switch first, last := k == 0, k == len(line)-1; {
		case first && last:
			n = r.only[i]
		case first:
			n = r.first[i]
		case last:
			n = r.last[i]
		default:
			n = r.middle[i]
		}
		held += n
		parts[k] = fmt.Sprintf("%s %d", ns[i].Name, n)
	}
	missing := c.Layers - held
	msg := fmt.Sprintf("the nodes hold at most %d of %d layers (%s): short by %d bytes for %d more layers",
		held, c.Layers, strings.Join(parts, ", "), mul(uint64(missing), add(c.LayerBytes, c.KVBytesPerToken)), missing)
	for _, l := range c.leftOut(ns, line, r, 0) {
		msg += fmt.Sprintf("; node %q %s", l.Node, l.Why)
	}
	return errors.New(msg)
}

// role names a stage's position and what it holds besides its layers.
func role(first, last bool) string {
	switch {
	case first && last:
		return "(only stage: embedding and head)"
	case first:
		return "(first stage: embedding)"
	case last:
		return "(last stage: head)"
	}
	return "(middle stage)"
}
