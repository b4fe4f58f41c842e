package cuda

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/graphs"
)

// graphState is the stage's CUDA graphs: a wrapper for each runtime mode
// that replays graphs, the keys captured, and what capturing them took.
type graphState struct {
	full      wrapper // the whole step (mode Full)
	piecewise wrapper // each dense segment (mode Piecewise)
	keys      graphs.KeySet
	capturing bool
	debug     bool    // check the graphs' buffers on every replay
	reserve   gpu.Mem // held back for the graphs until Capture
	budget    int64   // the size of reserve
	report    GraphReport
	// Counts of the graphs captured so far and their nodes.
	graphCount, nodeCount int
	// gemm is the cuBLAS products' shapes Capture warmed.
	gemm gemmShapes
}

// wrapper is bound to one runtime mode: for a step of that mode it replays
// the graph captured for (step, segment), capturing it when Capture runs
// it for the first time; for any other mode it calls its body straight
// through.
type wrapper struct {
	mode   graphs.Mode
	graphs map[segKey]graphExec
}

type segKey struct {
	step graphs.Step
	seg  int
}

type graphExec struct {
	exec   gpu.GraphExec
	inputs graphInputs // the buffers at capture
}

// graphInputs are the device addresses baked into a step's graphs that
// the host side may be tempted to move: the packed batch description
// (block tables included), the received activations, the residual stream,
// the KV cache, the logits, the sampler's output and the hand-off buffers
// (the rows reported, the slot tokens placeholders read, the status).
type graphInputs [10]gpu.DevicePtr

var graphInputNames = [len(graphInputs{})]string{"batch description", "input activations", "residual stream", "K cache", "V cache",
	"logits", "sampler output", "hand-off rows", "hand-off tokens", "hand-off status"}

func (s *Stage) graphInputs() graphInputs {
	return graphInputs{s.b.batch, s.b.in, s.b.resid, s.kcache, s.vcache, s.b.logits, s.b.sampleOut,
		s.ho.out.Ptr(), s.ho.tokens, s.ho.status}
}

// check fails naming the first buffer whose address differs from the one
// recorded at capture.
func (at graphInputs) check(now graphInputs) error {
	for i := range at {
		if at[i] != now[i] {
			return fmt.Errorf("%s moved from %#x at capture to %#x: the graph would use stale memory", graphInputNames[i], at[i], now[i])
		}
	}
	return nil
}

// call runs body for step, replaying or capturing its graph when the
// step's mode is the wrapper's. Device goroutine only.
func (w *wrapper) call(s *Stage, step graphs.Step, seg int, body func() error) error {
	if step.Mode != w.mode {
		return body()
	}
	k := segKey{step, seg}
	if g, ok := w.graphs[k]; ok {
		if s.g.debug {
			if err := g.inputs.check(s.graphInputs()); err != nil {
				return fmt.Errorf("replay graph of key %s, segment %d: %w", step, seg, err)
			}
		}
		if err := g.exec.Launch(s.stream); err != nil {
			return fmt.Errorf("replay graph of key %s, segment %d: %w", step, seg, err)
		}
		return nil
	}
	if !s.g.capturing {
		return fmt.Errorf("no graph captured for key %s, segment %d", step, seg)
	}
	return w.capture(s, k, body)
}

// capture records body into a graph on the stage's stream, instantiates it
// and uploads it. Device goroutine only.
func (w *wrapper) capture(s *Stage, k segKey, body func() error) error {
	exec, nodes, err := s.captureExec(body)
	if err != nil {
		return fmt.Errorf("graph of key %s, segment %d: %w", k.step, k.seg, err)
	}
	w.graphs[k] = graphExec{exec: exec, inputs: s.graphInputs()}
	s.g.graphCount++
	s.g.nodeCount += nodes
	if err := exec.Upload(s.stream); err != nil {
		return fmt.Errorf("upload graph of key %s, segment %d: %w", k.step, k.seg, err)
	}
	return nil
}

// captureExec records body into a graph on the stage's stream and
// instantiates it; nodes is the graph's node count (0 where the driver
// cannot say). Device goroutine only.
func (s *Stage) captureExec(body func() error) (exec gpu.GraphExec, nodes int, err error) {
	if err := s.stream.BeginCapture(gpu.CaptureThreadLocal); err != nil {
		return 0, 0, fmt.Errorf("capture: %w", err)
	}
	berr := body()
	g, err := s.stream.EndCapture()
	if berr != nil || err != nil {
		if g != 0 {
			err = errors.Join(err, g.Destroy())
		}
		return 0, 0, fmt.Errorf("capture: %w", errors.Join(berr, err))
	}
	nodes, err = g.NodeCount()
	if err != nil {
		nodes = 0 // cuGraphGetNodes is optional: the report counts no nodes
	}
	exec, err = g.Instantiate()
	if derr := g.Destroy(); err == nil && derr != nil {
		err = errors.Join(derr, exec.Destroy())
	}
	if err != nil {
		return 0, 0, fmt.Errorf("instantiate graph: %w", err)
	}
	return exec, nodes, nil
}

// release destroys the graphs and frees the memory held back for them.
// Device goroutine only.
func (g *graphState) release() error {
	var errs []error
	for _, w := range []*wrapper{&g.full, &g.piecewise} {
		for k, e := range w.graphs {
			errs = append(errs, e.exec.Destroy())
			delete(w.graphs, k)
		}
	}
	if g.reserve.Ptr() != 0 {
		errs = append(errs, g.reserve.Free())
		g.reserve = gpu.Mem{}
	}
	return errors.Join(errs...)
}

// GraphReport describes the CUDA graphs Capture made.
type GraphReport struct {
	Keys   int // keys captured
	Graphs int // executable graphs: one per Full key, one per dense segment (layers + 1) per Piecewise key
	Nodes  int // nodes of all graphs (0 where the driver cannot count them)
	// Bytes is the device memory Capture took, measured with cuMemGetInfo
	// before and after (2 MiB granularity): the graphs, and whatever the
	// eager warm-ups loaded (kernel modules).
	Bytes       int64
	CaptureTime time.Duration // warm-ups included
	PerKey      []KeyReport   // in capture order
}

// KeyReport is what one key's graphs took; Bytes is measured around its
// capture alone.
type KeyReport struct {
	Step   graphs.Step
	Graphs int
	Nodes  int
	Bytes  int64
}

// Graphs reports the CUDA graphs captured (the zero GraphReport before
// Capture).
func (s *Stage) Graphs() GraphReport { return s.g.report }

// keyShape is what the graphs of key k are captured for: the key's padded
// token count and, on the last stage, as many logits rows and sampled
// sequences as a batch of that key can ask for.
func (pl *planner) keyShape(k graphs.Step) shape {
	T := k.Desc.NumTokens
	sh := shape{tokens: T, decode: k.Desc.UniformDecode && k.Desc.QueryLen == 1}
	if pl.last {
		sh.rows = min(T, pl.lay.maxLogitRows)
		sh.sampled = min(T, pl.lay.maxSeqs)
		if k.Desc.UniformDecode {
			sh.sampled = min(k.Desc.NumReqs, pl.lay.maxSeqs)
		}
	}
	return sh
}

// checkKey reports whether the stage can capture graphs for k.
func (pl *planner) checkKey(k graphs.Step) error {
	d, lay := k.Desc, pl.lay
	switch {
	case k.Mode != graphs.Piecewise && k.Mode != graphs.Full:
		return fmt.Errorf("key %s: mode %s captures no graphs (want %s or %s)", k, k.Mode, graphs.Piecewise, graphs.Full)
	case d.NumTokens < 1 || d.NumTokens > lay.maxTokens:
		return fmt.Errorf("key %s: %d tokens; the stage takes 1 to %d", k, d.NumTokens, lay.maxTokens)
	case !d.UniformDecode && (d.NumReqs != 0 || d.QueryLen != 0):
		return fmt.Errorf("key %s: a key of mixed batches carries only its token count", k)
	case d.UniformDecode && k.Mode == graphs.Piecewise:
		return fmt.Errorf("key %s: piecewise graphs are keyed by token count alone", k)
	case d.UniformDecode && (d.QueryLen < 1 || d.NumReqs < 1 || d.NumReqs*d.QueryLen != d.NumTokens):
		return fmt.Errorf("key %s: %d requests of %d tokens are not %d tokens", k, d.NumReqs, d.QueryLen, d.NumTokens)
	case d.UniformDecode && d.NumReqs > lay.maxSeqs:
		return fmt.Errorf("key %s: %d requests; the stage takes at most %d", k, d.NumReqs, lay.maxSeqs)
	}
	return nil
}

// captureOrder checks keys and returns them in capture order: largest
// token count first, keeping the given order among equals.
func (pl *planner) captureOrder(keys []graphs.Step) ([]graphs.Step, error) {
	seen := make(map[graphs.Step]bool, len(keys))
	for _, k := range keys {
		if err := pl.checkKey(k); err != nil {
			return nil, err
		}
		if seen[k] {
			return nil, fmt.Errorf("key %s listed twice", k)
		}
		seen[k] = true
	}
	order := slices.Clone(keys)
	slices.SortStableFunc(order, func(a, b graphs.Step) int { return cmp.Compare(b.Desc.NumTokens, a.Desc.NumTokens) })
	return order, nil
}

// Capture captures the CUDA graphs of keys (the leader dispatcher's
// graphs.Dispatcher.Keys), largest first, each after an eager warm-up run
// of its shape, on the stage's own (non-default) stream: one graph per
// Full key, and one per dense segment for a Piecewise key. Then it warms
// up cuBLAS's products at the shapes eager steps past the largest key
// are padded to (gemmwarm.go). Every buffer already exists, so capture
// allocates nothing but the graphs themselves; the memory held back by
// Config.GraphMemory is released first, and Capture fails when the graphs
// took more. Capture may be called once; afterwards Forward replays the
// graphs of steps whose key was captured and fails steps whose key was
// not (all of them when Capture failed).
func (s *Stage) Capture(keys []graphs.Step) error {
	if s.closed {
		return fmt.Errorf("cuda stage [%d,%d): capture after close", s.lo, s.hi)
	}
	if s.g.keys != nil {
		return fmt.Errorf("cuda stage [%d,%d): CUDA graphs were already captured", s.lo, s.hi)
	}
	if s.launched > 0 {
		return fmt.Errorf("cuda stage [%d,%d): capture while %d batches are launched", s.lo, s.hi, s.launched)
	}
	order, err := s.pl.captureOrder(keys)
	if err != nil {
		return fmt.Errorf("cuda stage [%d,%d): capture CUDA graphs: %w", s.lo, s.hi, err)
	}
	if err := s.dev.Do(func() error { return s.captureAll(order) }); err != nil {
		return fmt.Errorf("cuda stage [%d,%d): capture CUDA graphs: %w", s.lo, s.hi, err)
	}
	return nil
}

// captureAll does Capture's device work. Device goroutine only.
func (s *Stage) captureAll(order []graphs.Step) error {
	start := time.Now()
	if s.g.reserve.Ptr() != 0 {
		if err := s.g.reserve.Free(); err != nil {
			return fmt.Errorf("release the memory held back: %w", err)
		}
		s.g.reserve = gpu.Mem{}
	}
	free0, _, err := gpu.MemInfo()
	if err != nil {
		return err
	}
	s.g.capturing = true
	defer func() { s.g.capturing = false }()
	f := &s.fl[s.oldest]
	words := f.hostBatch[:4*s.pl.lay.words()]
	rep := GraphReport{Keys: len(order)}
	captured := s.reportStep("capture graphs")
	captured(0, len(order))
	for i, k := range order {
		sh := s.pl.keyShape(k)
		s.pl.padding(&f.p, sh)
		if err := gpu.CopyHtoDAsync(s.b.batch, words, s.stream); err != nil {
			return fmt.Errorf("upload warm-up description: %w", err)
		}
		if err := s.forwardPass(graphs.Step{}, sh); err != nil {
			return fmt.Errorf("eager warm-up for key %s: %w", k, err)
		}
		if err := s.stream.Synchronize(); err != nil {
			return fmt.Errorf("eager warm-up for key %s: %w", k, err)
		}
		before, _, err := gpu.MemInfo()
		if err != nil {
			return err
		}
		g0, n0 := s.g.graphCount, s.g.nodeCount
		if err := s.forwardPass(k, sh); err != nil {
			return err
		}
		if err := s.stream.Synchronize(); err != nil {
			return fmt.Errorf("upload graphs of key %s: %w", k, err)
		}
		after, _, err := gpu.MemInfo()
		if err != nil {
			return err
		}
		rep.PerKey = append(rep.PerKey, KeyReport{Step: k, Graphs: s.g.graphCount - g0, Nodes: s.g.nodeCount - n0, Bytes: int64(before - after)})
		captured(i+1, len(order))
	}
	if len(order) > 0 {
		if err := s.warmEager(order[0].Desc.NumTokens); err != nil {
			return err
		}
		if err := s.stream.Synchronize(); err != nil {
			return fmt.Errorf("warm up eager shapes: %w", err)
		}
	}
	free1, _, err := gpu.MemInfo()
	if err != nil {
		return err
	}
	rep.Graphs, rep.Nodes = s.g.graphCount, s.g.nodeCount
	rep.Bytes = int64(free0 - free1)
	rep.CaptureTime = time.Since(start)
	s.g.report = rep
	s.mem.GraphBytes = rep.Bytes
	if s.g.budget > 0 && rep.Bytes > s.g.budget {
		return fmt.Errorf("the graphs took %d bytes, more than the %d held back for them (Config.GraphMemory)", rep.Bytes, s.g.budget)
	}
	s.g.keys = graphs.NewKeySet(order)
	return nil
}
