package placement

import (
	"errors"
	"fmt"
	"slices"
	"time"
)

// StageTime is a stage of a serving pipeline, in pipeline order, with the
// time it has spent running its steps (the device time a CUDA stage
// measures, the forward time otherwise): every stage runs every step, so
// the times compare the stages' step times.
type StageTime struct {
	Node   string
	Lo, Hi int
	Busy   time.Duration
}

// StageBusy is the time a stage's steps took, as ByTime reads it: its
// device's time where the stage measures one (a CUDA stage), else its
// forward passes' time.
func StageBusy(forward, device time.Duration) time.Duration {
	if device > 0 {
		return device
	}
	return forward
}

// TimeFit is ByTime's plan and what it read from the stages' times: the
// time one layer takes and the time the last stage's LM head and sampling
// take on top of its layers (over the same steps as the times given); each
// stage's time as measured (Times, for the layers Before) and as predicted
// for the plan (Predicted, for the layers After).
type TimeFit struct {
	Layer, Head      time.Duration
	Before, After    []Range
	Times, Predicted []time.Duration
}

// Unchanged reports whether the plan is the current placement.
func (f TimeFit) Unchanged() bool { return slices.Equal(f.Before, f.After) }

// Slowest is the largest of ts.
func Slowest(ts []time.Duration) time.Duration {
	var m time.Duration
	for _, t := range ts {
		m = max(m, t)
	}
	return m
}

// ByTime divides the layers of a serving pipeline anew, over the same
// nodes in the same order, so that its stages' step times come out as even
// as the stages' measured times predict. An even split of the layers is
// uneven in time: the last stage also runs the LM head, the logit
// statistics and the sampler (on one H200, at 64 sequences, 2.1 layers'
// time of the Llama-3.2-1B shape and 1.7 of the 8B; their weights count
// 4.3 and 2.4 layers, so no static weight of the head fits every shape and
// batch). The model: a stage's time is its layers' count times one
// layer's time, plus the head's on the last stage; a layer's time is the
// other stages' times over their layers (the embedding's lookup is small
// enough to leave out), the head's what the last stage took beyond its
// layers. The layers then go, one at a time, to the stage that would be
// done soonest with one more (the earlier on a tie), each stage keeping at
// least one. The plan is for Explicit to validate: a node may lack the
// memory for the layers it is given.
func ByTime(stages []StageTime) (TimeFit, error) {
	var fit TimeFit
	if len(stages) < 2 {
		return fit, errors.New("balance by time: a pipeline of two stages or more is needed")
	}
	layers := 0
	var others time.Duration
	otherLayers := 0
	for i, s := range stages {
		switch {
		case s.Lo != layers || s.Hi <= s.Lo:
			return fit, fmt.Errorf("balance by time: stage %d (%s) holds [%d,%d), want a non-empty range from %d", i, s.Node, s.Lo, s.Hi, layers)
		case s.Busy <= 0:
			return fit, fmt.Errorf("balance by time: stage %d (%s) has measured no time yet: serve some requests first", i, s.Node)
		}
		layers = s.Hi
		fit.Before = append(fit.Before, Range{Node: s.Node, Lo: s.Lo, Hi: s.Hi})
		fit.Times = append(fit.Times, s.Busy)
		if i < len(stages)-1 {
			others += s.Busy
			otherLayers += s.Hi - s.Lo
		}
	}
	if layers < len(stages) {
		return fit, fmt.Errorf("balance by time: %d layers over %d stages", layers, len(stages))
	}
	fit.Layer = others / time.Duration(otherLayers)
	last := stages[len(stages)-1]
	fit.Head = max(0, last.Busy-time.Duration(last.Hi-last.Lo)*fit.Layer)
	// Each stage starts with one layer; every other layer goes where the
	// stage would then take the least time.
	counts := make([]int, len(stages))
	cost := func(i int) time.Duration {
		c := time.Duration(counts[i]) * fit.Layer
		if i == len(stages)-1 {
			c += fit.Head
		}
		return c
	}
	for i := range counts {
		counts[i] = 1
	}
	for n := len(stages); n < layers; n++ {
		best := 0
		for i := range counts {
			if cost(i) < cost(best) {
				best = i
			}
		}
		counts[best]++
	}
	lo := 0
	for i, s := range stages {
		r := Range{Node: s.Node, Lo: lo, Hi: lo + counts[i]}
		fit.After = append(fit.After, r)
		fit.Predicted = append(fit.Predicted, cost(i))
		lo = r.Hi
	}
	return fit, nil
}
