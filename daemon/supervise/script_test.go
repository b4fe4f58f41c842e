package supervise

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/daemon/membership"
	"github.com/tandem-llm/tandem/daemon/nodewire"
	"github.com/tandem-llm/tandem/daemon/placement"
	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/internal/golden"
	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/pipeline"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

const gib = 1 << 30

// scriptCost is the model of the scripts: 8 layers of 1 GiB, an embedding
// and a head of 1 GiB each, 1 MiB of KV cache per token and layer, so a
// node of N GiB holding k layers (and the embedding or head) leaves
// (N-k-1) GiB of KV cache: 1024/k tokens per GiB.
var scriptCost = placement.Cost{Layers: 8, LayerBytes: gib, EmbedBytes: gib, HeadBytes: gib, KVBytesPerToken: 1 << 20}

func scriptPlace(nodes []placement.Node, ranges []placement.Range) (placement.Plan, error) {
	if ranges != nil {
		return placement.Explicit(nodes, ranges, scriptCost)
	}
	return placement.Balance(nodes, scriptCost)
}

// TestScripts runs the golden scripts in testdata against the Core, whose
// builds run the real Builder over fake stage nodes (Node clients that
// answer as the nodes the script describes) and a fake membership. A
// script is a list of commands, one a line; the lines indented by two
// spaces after a command are what it printed: the core's actions and
// errors. # starts a comment.
//
//	config me=NAME [leader=NAME] [expect=N] [auto=0|1] [plan=NODE=LO-HI,...]
//	member NAME [state=alive|dead|left] [stage=0|1] [mem=GiB] [eligible=0|1] [model=ID]
//	                   change a member (a state change restarts its Since)
//	                   and give the core the membership
//	tick DURATION      let time pass
//	node NAME down|up|epoch=N|loadfail=MSG
//	                   how the fake stage node answers: not at all, again,
//	                   refusing epochs below N as stale, failing Load
//	build              run the builds the core asked for, over the fake
//	                   nodes as they are now, and report their ends
//	failed EPOCH NODE|- MSG
//	                   the engine reports a failure of a pipeline
//	drain NODE | undrain NODE | rebalance [NODE=LO-HI,...]
//	status
//
// go test -run TestScripts -update rewrites the expected lines.
func TestScripts(t *testing.T) {
	golden.Run(t, runScript)
}

// script is the state of a running script.
type script struct {
	t       *testing.T
	now     time.Time
	core    *Core
	members map[string]*membership.Member
	nodes   *fakeNodes
	builder *Builder
	pending []Build
	plans   map[uint64]placement.Plan // of every build asked for
	out     strings.Builder
}

func runScript(t *testing.T, text string) string {
	s := &script{t: t, now: time.Unix(1000, 0).UTC(), members: map[string]*membership.Member{}, nodes: &fakeNodes{nodes: map[string]*fakeNode{}}, plans: map[uint64]placement.Plan{}}
	for n, line := range strings.Split(strings.TrimSuffix(text, "\n"), "\n") {
		if strings.HasPrefix(line, "  ") {
			continue // expected output, replaced below
		}
		s.out.WriteString(line + "\n")
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if err := s.run(strings.Fields(line)); err != nil {
			t.Fatalf("line %d: %v", n+1, err)
		}
	}
	return s.out.String()
}

func (s *script) print(format string, a ...any) { fmt.Fprintf(&s.out, "  "+format+"\n", a...) }

// step gives the core an event and prints its actions.
func (s *script) step(ev Event) {
	acts, err := s.core.Step(s.now, ev)
	if err != nil {
		s.print("error: %v", err)
	}
	for _, a := range acts {
		s.print("%s", a)
		switch a := a.(type) {
		case Build:
			s.pending = append(s.pending, a)
			s.plans[a.Epoch] = a.Plan
		case Close:
			// The supervisor releases the pipeline's stages.
			s.release(a.Epoch)
		case Retire:
			s.release(a.Epoch)
		}
	}
}

// release has the fake nodes drop their stage of a pipeline given up.
func (s *script) release(epoch uint64) {
	for _, st := range s.plans[epoch].Stages {
		s.nodes.get(st.Node).release(epoch)
	}
}

func (s *script) snapshot() []membership.Member {
	var out []membership.Member
	for _, m := range s.members {
		out = append(out, *m)
	}
	slices.SortFunc(out, func(a, b membership.Member) int { return strings.Compare(a.Name, b.Name) })
	return out
}

func (s *script) run(f []string) error {
	args := map[string]string{}
	for _, kv := range f[1:] {
		k, v, _ := strings.Cut(kv, "=")
		args[k] = v
	}
	num := func(k string, def int) int {
		if args[k] == "" {
			return def
		}
		v, err := strconv.Atoi(args[k])
		if err != nil {
			s.t.Fatalf("%s: %v", k, err)
		}
		return v
	}
	dur := func(v string) time.Duration {
		if v == "" {
			return 0
		}
		d, err := time.ParseDuration(v)
		if err != nil {
			s.t.Fatalf("%q: %v", v, err)
		}
		return d
	}
	if f[0] != "config" && s.core == nil {
		return fmt.Errorf("%s before config", f[0])
	}
	switch f[0] {
	case "config":
		ranges, err := parseRanges(args["plan"])
		if err != nil {
			return err
		}
		s.core = NewCore(CoreConfig{
			Name: args["me"], Leader: args["leader"], ModelID: "m", ExpectStages: num("expect", 1), Plan: ranges,
			Place: scriptPlace, AutoRebalance: args["auto"] != "0", BalanceAfter: dur(args["balance"]),
			EpochBase: func(time.Time) uint64 { return 0 },
		})
		s.builder = NewBuilder(BuilderConfig{
			Leader: args["me"], Model: &model.Config{NumLayers: 8, MaxPositions: 4096}, ModelID: "m",
			MaxBatchTokens: 64, MaxSeqs: 4, BlockSize: 16, Handoff: true, GraphMode: graphs.None,
			NewDispatcher: func(m graphs.Mode) (*graphs.Dispatcher, error) {
				return graphs.NewDispatcher(graphs.Config{Mode: m, MaxCaptureSize: 64, MaxNumSeqs: 4})
			},
			Nodes: s.nodes, DialLink: fakeDialLink, Log: slog.New(slog.DiscardHandler),
		})
	case "member":
		name := f[1]
		m := s.members[name]
		if m == nil {
			m = &membership.Member{Name: name, State: membership.Alive, Since: s.now,
				Meta: membership.Meta{Name: name, Backend: membership.BackendCPU, GRPCAddr: name, ModelID: "m", LeaderEligible: true}}
			s.members[name] = m
			s.nodes.add(name)
		}
		if st, ok := args["state"]; ok {
			states := map[string]membership.State{"alive": membership.Alive, "dead": membership.Dead, "left": membership.Left}
			if states[st] != m.State {
				m.State, m.Since = states[st], s.now
			}
		}
		if v, ok := args["stage"]; ok {
			m.Meta.DataAddr = ""
			if v == "1" {
				m.Meta.DataAddr = "data-" + name
			}
		}
		if _, ok := args["mem"]; ok {
			m.Meta.MemFree = uint64(num("mem", 0)) * gib
			m.Meta.MemTotal = m.Meta.MemFree
		}
		if _, ok := args["eligible"]; ok {
			m.Meta.LeaderEligible = args["eligible"] == "1"
		}
		if v, ok := args["model"]; ok {
			m.Meta.ModelID = v
		}
		s.step(Members{List: s.snapshot()})
	case "tick":
		d, err := time.ParseDuration(f[1])
		if err != nil {
			return err
		}
		s.now = s.now.Add(d)
		s.step(Tick{})
	case "node":
		n := s.nodes.get(f[1])
		if n == nil {
			return fmt.Errorf("no node %s", f[1])
		}
		n.mu.Lock()
		for _, a := range f[2:] {
			k, v, _ := strings.Cut(a, "=")
			switch k {
			case "down":
				n.down = true
			case "up":
				n.down, n.loadFail = false, ""
			case "epoch":
				n.epoch, _ = strconv.ParseUint(v, 10, 64)
			case "loadfail":
				n.loadFail = strings.Join(append([]string{v}, f[3:]...), " ")
			}
		}
		n.mu.Unlock()
	case "build":
		pending := s.pending
		s.pending = nil
		if len(pending) == 0 {
			s.print("no build")
		}
		for _, b := range pending {
			p, err := s.builder.Build(context.Background(), b)
			done := BuildDone{Epoch: b.Epoch, Err: err}
			var be *BuildError
			if errors.As(err, &be) {
				done.Nodes, done.RefusedEpoch = be.Nodes, be.RefusedEpoch
			}
			if p != nil {
				p.drv.Close()
				var reused []string
				for _, st := range p.Stages {
					if st.Reused {
						reused = append(reused, st.Node)
					}
				}
				line := fmt.Sprintf("built epoch %d: kv %d tokens, %d in flight, hand-off %t", p.Epoch, p.KVTokens, p.MaxInFlight, p.Handoff)
				if len(reused) > 0 {
					line += fmt.Sprintf(", stages reused on %v", reused)
				}
				s.print("%s", line)
			} else {
				s.print("build of epoch %d failed: nodes %v refused %d", b.Epoch, done.Nodes, done.RefusedEpoch)
			}
			s.step(done)
		}
	case "failed":
		epoch, err := strconv.ParseUint(f[1], 10, 64)
		if err != nil {
			return err
		}
		node := f[2]
		if node == "-" {
			node = ""
		}
		s.step(StageFailed{Epoch: epoch, Node: node, Err: errors.New(strings.Join(f[3:], " "))})
	case "times":
		// times EPOCH D,D,...: the stages' times in their steps.
		epoch, err := strconv.ParseUint(f[1], 10, 64)
		if err != nil {
			return err
		}
		ev := StageTimes{Epoch: epoch}
		for _, v := range strings.Split(f[2], ",") {
			ev.Busy = append(ev.Busy, dur(v))
		}
		s.step(ev)
	case "drain":
		s.step(Drain{Node: f[1]})
	case "undrain":
		s.step(Undrain{Node: f[1]})
	case "rebalance":
		var ranges []placement.Range
		if len(f) > 1 {
			var err error
			if ranges, err = parseRanges(f[1]); err != nil {
				return err
			}
		}
		s.step(Rebalance{Ranges: ranges})
	case "status":
		st := s.core.Status()
		s.print("leader %q leading %t epoch %d [%s] building %d accepting %t", st.Leader.Name, st.Leading, st.Epoch, PlanString(st.Plan), st.Building, st.Accepting)
		if st.Reason != "" {
			s.print("reason: %s", st.Reason)
		}
		if len(st.Drained) > 0 {
			s.print("drained %v", st.Drained)
		}
		for _, l := range st.LeftOut {
			s.print("left out: %s", l)
		}
		if l := st.Last; l.Kind != "" {
			end := "under way"
			switch {
			case l.Err != "":
				end = fmt.Sprintf("failed after %v: %s", l.End.Sub(l.Start), l.Err)
			case !l.End.IsZero():
				end = fmt.Sprintf("took %v, epoch %d", l.End.Sub(l.Start), l.Epoch)
			}
			s.print("last %s (%s): %s", l.Kind, l.Why, end)
		}
		if c := st.Counts; c != (Counts{}) {
			s.print("done: %d recoveries, %d moves, %d rebalances", c.Recoveries, c.Moves, c.Rebalances)
		}
	default:
		return fmt.Errorf("unknown command %q", f[0])
	}
	return nil
}

// parseRanges reads NODE=LO-HI,...
func parseRanges(s string) ([]placement.Range, error) {
	if s == "" {
		return nil, nil
	}
	var out []placement.Range
	for _, part := range strings.Split(s, ",") {
		node, r, ok := strings.Cut(part, "=")
		lo, hi, ok2 := strings.Cut(r, "-")
		l, err1 := strconv.Atoi(lo)
		h, err2 := strconv.Atoi(hi)
		if !ok || !ok2 || err1 != nil || err2 != nil {
			return nil, fmt.Errorf("range %q: want NODE=LO-HI", part)
		}
		out = append(out, placement.Range{Node: node, Lo: l, Hi: h})
	}
	return out, nil
}

// fakeNodes are the scripts' stage nodes, reached by name as address.
type fakeNodes struct {
	mu    sync.Mutex
	nodes map[string]*fakeNode
}

func (f *fakeNodes) add(name string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.nodes[name] == nil {
		f.nodes[name] = &fakeNode{name: name}
	}
}

func (f *fakeNodes) get(name string) *fakeNode {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.nodes[name]
}

func (f *fakeNodes) DialNode(addr string) (tandemv1.NodeClient, io.Closer, error) {
	n := f.get(addr)
	if n == nil {
		return nil, nil, fmt.Errorf("no node at %s", addr)
	}
	return n, io.NopCloser(nil), nil
}

// fakeNode answers the Node service as a CPU stage node would, or not
// at all (down), or refusing stale epochs, or failing Load.
type fakeNode struct {
	name     string
	mu       sync.Mutex
	down     bool
	epoch    uint64 // the newest accepted
	loadFail string
	// The layers of the stage it holds and its epoch, until released: a
	// Load of the same layers reuses it.
	lo, hi uint32
	held   uint64
}

// release drops the stage of epoch, if it is the one held.
func (n *fakeNode) release(epoch uint64) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.held == epoch {
		n.lo, n.hi, n.held = 0, 0, 0
	}
}

// check refuses a call while down, or of an epoch older than the newest
// accepted (setting the trailer as the stage host does).
func (n *fakeNode) check(epoch uint64, opts []grpc.CallOption) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.down {
		return status.Errorf(codes.Unavailable, "connection error: dial tcp %s: connect: connection refused", n.name)
	}
	if epoch < n.epoch {
		for _, o := range opts {
			if t, ok := o.(grpc.TrailerCallOption); ok {
				*t.TrailerAddr = metadata.Pairs(nodewire.EpochTrailer, strconv.FormatUint(n.epoch, 10))
			}
		}
		return status.Errorf(codes.FailedPrecondition, "stale leader epoch %d: node %s has accepted epoch %d", epoch, n.name, n.epoch)
	}
	n.epoch = epoch
	return nil
}

func (n *fakeNode) Load(_ context.Context, in *tandemv1.LoadRequest, opts ...grpc.CallOption) (*tandemv1.LoadResponse, error) {
	if err := n.check(in.GetEpoch(), opts); err != nil {
		return nil, err
	}
	n.mu.Lock()
	fail := n.loadFail
	reused := n.held != 0 && n.lo == in.GetLayerLo() && n.hi == in.GetLayerHi()
	n.lo, n.hi, n.held = in.GetLayerLo(), in.GetLayerHi(), in.GetEpoch()
	n.mu.Unlock()
	if fail != "" {
		return nil, status.Error(codes.Internal, fail)
	}
	return &tandemv1.LoadResponse{
		ControlAddr: "ctl-" + n.name, DataAddr: "data-" + n.name, HandoffAddr: "handoff-" + n.name, Backend: "cpu", ModelId: in.GetModelId(),
		KvBlocks: uint64(64 * (in.GetLayerHi() - in.GetLayerLo())), MaxSeqLen: 4096, GraphSupport: "NEVER",
		ActDtype: uint32(collective.F32), HandoffReceiver: in.GetIndex() == 0, Reused: reused, Alongside: in.GetAlongside(),
	}, nil
}

func (n *fakeNode) Capture(_ context.Context, in *tandemv1.CaptureRequest, opts ...grpc.CallOption) (*tandemv1.CaptureResponse, error) {
	return nil, status.Error(codes.FailedPrecondition, "a CPU stage captures no CUDA graphs")
}

func (n *fakeNode) Connect(_ context.Context, in *tandemv1.ConnectRequest, opts ...grpc.CallOption) (*tandemv1.ConnectResponse, error) {
	return &tandemv1.ConnectResponse{}, n.check(in.GetEpoch(), opts)
}

func (n *fakeNode) Join(_ context.Context, in *tandemv1.JoinRequest, opts ...grpc.CallOption) (*tandemv1.JoinResponse, error) {
	return &tandemv1.JoinResponse{}, n.check(in.GetEpoch(), opts)
}

func (n *fakeNode) Release(_ context.Context, in *tandemv1.ReleaseRequest, opts ...grpc.CallOption) (*tandemv1.ReleaseResponse, error) {
	n.release(in.GetEpoch())
	return &tandemv1.ReleaseResponse{}, nil
}

// fakeLink is a control link to a fake stage: it takes steps and reports
// nothing until closed.
type fakeLink struct {
	results chan *pipeline.Result
	once    sync.Once
}

func fakeDialLink(context.Context, pipeline.ControlConfig, string) (pipeline.Link, error) {
	return &fakeLink{results: make(chan *pipeline.Result)}, nil
}

func (l *fakeLink) Send(context.Context, *pipeline.Step) error { return nil }
func (l *fakeLink) Results() <-chan *pipeline.Result           { return l.results }
func (l *fakeLink) Err() error                                 { return nil }
func (l *fakeLink) Close() error {
	l.once.Do(func() { close(l.results) })
	return nil
}
