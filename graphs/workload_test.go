package graphs

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// simRequest is one request of the simulated workload.
type simRequest struct {
	prompt, output   int
	cached, produced int
}

// simBatch is one step's composition.
type simBatch struct {
	tokens, reqs int
	uniform      bool // every request of the step has exactly q tokens
}

// simulate runs n requests of random prompt and output lengths through a
// continuous-batching loop shaped like the leader's: requests arrive a few
// per step, at most maxSeqs run at once, each step carries at most
// maxTokens tokens, decodes (q tokens each, of which 1 to q are accepted)
// go first and prefill chunks fill the rest. It calls step for each step's
// composition and returns the requests, finished.
func simulate(r *rand.Rand, n, q, maxSeqs, maxTokens int, step func(simBatch)) []*simRequest {
	reqs := make([]*simRequest, n)
	for i := range reqs {
		var prompt int
		switch x := r.IntN(20); {
		case x < 10:
			prompt = 1 + r.IntN(64)
		case x < 17:
			prompt = 65 + r.IntN(448)
		default:
			prompt = 513 + r.IntN(2500)
		}
		reqs[i] = &simRequest{prompt: prompt, output: 1 + r.IntN(200)}
	}
	var waiting, running []*simRequest
	arrived := 0
	for arrived < n || len(waiting) > 0 || len(running) > 0 {
		for k := r.IntN(4); k > 0 && arrived < n; k-- {
			waiting = append(waiting, reqs[arrived])
			arrived++
		}
		for len(running) < maxSeqs && len(waiting) > 0 {
			running = append(running, waiting[0])
			waiting = waiting[1:]
		}
		if len(running) == 0 {
			continue
		}
		budget := maxTokens
		type chunk struct {
			req    *simRequest
			tokens int
		}
		var chunks []chunk
		for _, s := range running {
			if s.cached >= s.prompt && budget >= q {
				chunks = append(chunks, chunk{s, q})
				budget -= q
			}
		}
		for _, s := range running {
			if s.cached < s.prompt && budget > 0 {
				c := min(s.prompt-s.cached, budget)
				chunks = append(chunks, chunk{s, c})
				budget -= c
			}
		}
		b := simBatch{reqs: len(chunks), uniform: true}
		for _, c := range chunks {
			b.tokens += c.tokens
			b.uniform = b.uniform && c.tokens == q
		}
		step(b)
		for _, c := range chunks {
			s := c.req
			decode := s.cached >= s.prompt
			s.cached += c.tokens
			switch {
			case decode:
				s.produced += 1 + r.IntN(q)
			case s.cached == s.prompt:
				s.produced++
			}
			s.produced = min(s.produced, s.output)
		}
		running = slices.DeleteFunc(running, func(s *simRequest) bool { return s.produced == s.output })
	}
	return reqs
}

// TestWorkload drives the dispatcher with the long test's workload shape,
// 2,000 requests of random prompt and output lengths, for pipelines of
// several stage mixes, and checks the statistics against an independent
// dispatch of every step and the per-mode invariants.
func TestWorkload(t *testing.T) {
	tests := []struct {
		name       string
		configured Mode
		q          int
		stages     []StageSupport
		want       Mode
	}{
		{"cuda default", DefaultMode, 1, []StageSupport{{"0", Always}, {"1", UniformBatch}}, FullAndPiecewise},
		{"cuda FULL", Full, 1, []StageSupport{{"0", Always}, {"1", Always}}, Full},
		{"spec decode FULL_DECODE_ONLY", FullDecodeOnly, 2, []StageSupport{{"0", UniformBatch}}, FullDecodeOnly},
		{"spec decode, single-token stage", DefaultMode, 3, []StageSupport{{"0", UniformSingleTokenDecode}, {"1", Always}}, Piecewise},
		{"cpu stage", DefaultMode, 1, []StageSupport{{"0 (cpu)", Never}, {"1 (cuda)", Always}}, None},
	}
	const (
		numRequests = 2000
		maxSeqs     = 64
		maxCapture  = 256
	)
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			mode, _, err := Resolve(tc.configured, tc.q, tc.stages)
			if err != nil || mode != tc.want {
				t.Fatalf("Resolve = %s, %v; want %s", mode, err, tc.want)
			}
			d := mustDispatcher(t, Config{Mode: mode, MaxCaptureSize: maxCapture, UniformDecodeQueryLen: tc.q, MaxNumSeqs: maxSeqs})
			keys := d.Keys()
			captured := NewKeySet(keys)
			var piecewiseKeys []Step
			for _, k := range keys {
				if k.Mode == Piecewise {
					piecewiseKeys = append(piecewiseKeys, k)
				}
			}
			partial := NewKeySet(piecewiseKeys) // a stage that captured no full graphs
			sizes := d.CaptureSizes()

			var stats Stats
			want := map[statKey]uint64{}
			var steps, uniformSteps, refused, fullSteps int
			r := rand.New(rand.NewPCG(uint64(i), 42))
			reqs := simulate(r, numRequests, tc.q, maxSeqs, 512, func(b simBatch) {
				steps++
				if b.uniform {
					uniformSteps++
				}
				m, desc := d.Dispatch(b.tokens, b.uniform, b.reqs)
				stats.Record(b.tokens, desc.NumTokens, m)
				ref := refDispatch(captured, sizes, tc.q, b.tokens, b.uniform, b.reqs)
				if (Step{m, desc}) != ref {
					t.Fatalf("step %d (%+v): dispatched %s, want %s", steps, b, Step{m, desc}, ref)
				}
				want[statKey{b.tokens, ref.Desc.NumTokens, ref.Mode}]++
				step := Step{m, desc}
				for _, stage := range []string{"0", "1"} {
					if err := step.Validate(stage, b.tokens, b.reqs, captured); err != nil {
						t.Fatalf("step %d (%+v): %v", steps, b, err)
					}
				}
				if m == Full {
					fullSteps++
				}
				if step.Validate("partial", b.tokens, b.reqs, partial) != nil {
					refused++
				}
			})
			for _, s := range reqs {
				if s.cached < s.prompt || s.produced != s.output {
					t.Fatalf("simulation left a request unfinished: %+v", s)
				}
			}
			if refused != fullSteps {
				t.Errorf("a stage without full graphs refused %d steps, want the %d FULL ones", refused, fullSteps)
			}

			rows := stats.Snapshot()
			var total uint64
			perMode := map[Mode]uint64{}
			for _, row := range rows {
				total += row.Count
				perMode[row.Mode] += row.Count
				if n := want[statKey{row.Unpadded, row.Padded, row.Mode}]; n != row.Count {
					t.Errorf("row %+v: want count %d", row, n)
				}
				switch {
				case row.Mode == None && row.Padded != row.Unpadded:
					t.Errorf("eager row %+v is padded", row)
				case row.Mode == None && row.Unpadded <= d.MaxCaptureSize() && mode.MixedMode() != None:
					t.Errorf("row %+v ran eagerly within the capture sizes", row)
				case row.Mode != None && (row.Padded < row.Unpadded || !slices.Contains(sizes, row.Padded)):
					t.Errorf("row %+v: padded to no capture size", row)
				case row.Mode != None && !mode.HasFull() && !mode.HasPiecewise():
					t.Errorf("row %+v under mode %s", row, mode)
				}
			}
			if len(rows) != len(want) {
				t.Errorf("%d rows, want %d", len(rows), len(want))
			}
			if total != uint64(steps) {
				t.Errorf("statistics count %d steps, the simulation ran %d", total, steps)
			}
			if mode.MixedMode() != Full && perMode[Full] > uint64(uniformSteps) {
				t.Errorf("%d FULL steps, but only %d uniform decode steps", perMode[Full], uniformSteps)
			}
			// The workload reaches every runtime mode the dispatcher has.
			for _, m := range []Mode{mode.DecodeMode(), mode.MixedMode(), None} {
				if perMode[m] == 0 {
					t.Errorf("no %s steps in %d", m, steps)
				}
			}
			t.Logf("%d requests, %d steps (%d uniform decode): FULL %d, PIECEWISE %d, NONE %d; %d rows",
				numRequests, steps, uniformSteps, perMode[Full], perMode[Piecewise], perMode[None], len(rows))
		})
	}
}
