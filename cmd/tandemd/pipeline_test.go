package main

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/randinit"
	"github.com/tandem-llm/tandem/pipeline"
	"github.com/tandem-llm/tandem/stage"
	"github.com/tandem-llm/tandem/stage/cpu"
)

// The test binary doubles as tandemd: the multi-process tests start it with
// this variable set, and it runs main instead of the tests.
const asDaemonEnv = "TANDEMD_TEST_AS_DAEMON"

func TestMain(m *testing.M) {
	if os.Getenv(asDaemonEnv) == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// testModel writes a small random checkpoint with 4 layers.
func testModel(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "model")
	o := randinit.DefaultOptions()
	o.Layers = 4
	o.Seed = 7
	if err := randinit.Write(dir, o); err != nil {
		t.Fatal(err)
	}
	return dir
}

// run is what one pipeline produced for the test workload: per sequence,
// the logits of every position it ran, and its greedy tokens.
type run struct {
	logits map[uint64][][]float32
	tokens map[uint64][]int32
}

// workload prefills three prompts of different lengths in one batch, then
// decodes greedily for a few steps, asking for logits everywhere.
func workload(t *testing.T, ctx context.Context, d *pipeline.Driver, vocab int) run {
	t.Helper()
	prompts := map[uint64][]int32{}
	lens := []int{5, 11, 2}
	for i, n := range lens {
		p := make([]int32, n)
		for j := range p {
			p[j] = int32((i*31 + j*17 + 3) % vocab)
		}
		prompts[uint64(i+1)] = p
	}
	r := run{logits: map[uint64][][]float32{}, tokens: map[uint64][]int32{}}
	pos := map[uint64]int{}
	next := map[uint64][]int32{}
	for id, p := range prompts {
		next[id] = p
	}
	for step := 0; step < 5; step++ {
		b := stage.Batch{ID: uint64(step + 1)}
		for id := uint64(1); id <= uint64(len(lens)); id++ {
			b.Seqs = append(b.Seqs, stage.Seq{ID: id, Pos: pos[id], Tokens: next[id], Sample: true, Logits: true, Index: len(r.tokens[id])})
		}
		res, err := d.Step(ctx, &pipeline.Step{Batch: b})
		if err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		for _, l := range res.Logits {
			r.logits[l.Seq] = append(r.logits[l.Seq], l.Rows...)
		}
		for _, s := range res.Sampled {
			r.tokens[s.Seq] = append(r.tokens[s.Seq], s.Token)
			pos[s.Seq] += len(next[s.Seq])
			next[s.Seq] = []int32{s.Token}
		}
	}
	return r
}

func compareRuns(t *testing.T, name string, got, want run) {
	t.Helper()
	worst := 0.0
	for id, rows := range want.logits {
		g := got.logits[id]
		if len(g) != len(rows) {
			t.Fatalf("%s: sequence %d: %d logit rows, want %d", name, id, len(g), len(rows))
		}
		for i := range rows {
			worst = max(worst, relErr(g[i], rows[i]))
		}
		if fmt.Sprint(got.tokens[id]) != fmt.Sprint(want.tokens[id]) {
			t.Errorf("%s: sequence %d: greedy tokens %v, want %v", name, id, got.tokens[id], want.tokens[id])
		}
	}
	t.Logf("%s: worst relative logit error %.2e", name, worst)
	if worst > 1e-6 {
		t.Errorf("%s: relative logit error %.2e > 1e-6", name, worst)
	}
}

func relErr(a, b []float32) float64 {
	var num, den float64
	for i := range b {
		d := float64(a[i]) - float64(b[i])
		num += d * d
		den += float64(b[i]) * float64(b[i])
	}
	return math.Sqrt(num / den)
}

func localPipeline(t *testing.T, ctx context.Context, dir string, ranges [][2]int) *pipeline.Driver {
	t.Helper()
	ckpt, err := model.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ckpt.Close() })
	var stages []stage.Stage
	for _, r := range ranges {
		st, err := cpu.New(cpu.Config{Model: ckpt.Config(), Lo: r[0], Hi: r[1], Weights: ckpt, MaxTokens: 64, MaxSeqs: 8})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		stages = append(stages, st)
	}
	d, err := pipeline.StartLocal(ctx, stages)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// TestStageSplits checks that the same checkpoint split into 1, 2, 3 and 4
// stages, in one process and as separate processes over TCP, gives the
// logits and greedy tokens of the single-stage run.
func TestStageSplits(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := testModel(t)
	ckpt, err := model.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	cfg := ckpt.Config()
	ckpt.Close()

	ref := localPipeline(t, ctx, dir, [][2]int{{0, cfg.NumLayers}})
	want := workload(t, ctx, ref, cfg.VocabSize)
	if err := ref.Close(); err != nil {
		t.Fatal(err)
	}
	for n := 1; n <= 4; n++ {
		ranges, err := splitLayers(cfg.NumLayers, n)
		if err != nil {
			t.Fatal(err)
		}
		t.Run(fmt.Sprintf("in-process/%d", n), func(t *testing.T) {
			d := localPipeline(t, ctx, dir, ranges)
			got := workload(t, ctx, d, cfg.VocabSize)
			if err := d.Close(); err != nil {
				t.Fatal(err)
			}
			compareRuns(t, fmt.Sprintf("%d stages in one process", n), got, want)
		})
		t.Run(fmt.Sprintf("processes/%d", n), func(t *testing.T) {
			var logs bytes.Buffer
			c, err := startLocalCluster(ctx, os.Args[0], []string{asDaemonEnv + "=1"}, dir, ranges, &logs)
			if err != nil {
				t.Fatalf("%v\nstage logs:\n%s", err, logs.String())
			}
			got := workload(t, ctx, c.Driver, cfg.VocabSize)
			if err := c.Close(); err != nil {
				t.Fatalf("%v\nstage logs:\n%s", err, logs.String())
			}
			compareRuns(t, fmt.Sprintf("%d stage processes over TCP", n), got, want)
		})
	}
}

// TestStageProcessKilled checks that losing a stage process mid-run is an
// error naming the stage, not a hang.
func TestStageProcessKilled(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := testModel(t)
	var logs bytes.Buffer
	c, err := startLocalCluster(ctx, os.Args[0], []string{asDaemonEnv + "=1"}, dir, [][2]int{{0, 2}, {2, 3}, {3, 4}}, &logs)
	if err != nil {
		t.Fatalf("%v\n%s", err, logs.String())
	}
	defer c.Close()
	// c.procs is in start order: last stage first, so procs[1] is stage 1.
	c.procs[1].cmd.Process.Kill()
	b := stage.Batch{ID: 1, Seqs: []stage.Seq{{ID: 1, Tokens: []int32{1, 2, 3}, Sample: true}}}
	start := time.Now()
	_, err = c.Driver.Step(ctx, &pipeline.Step{Batch: b})
	if err == nil {
		t.Fatal("step through a pipeline with a killed stage succeeded")
	}
	if !strings.Contains(err.Error(), "stage") {
		t.Errorf("error %q does not name the stage", err)
	}
	if time.Since(start) > 30*time.Second {
		t.Errorf("took %v to notice the lost stage", time.Since(start))
	}
	t.Logf("after killing stage 1: %v (in %v)", err, time.Since(start).Round(time.Millisecond))
}

// TestDemo runs the README's main job end to end.
func TestDemo(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out, logs bytes.Buffer
	o := demoOptions{stages: 2, prompt: "Hello there", maxTokens: 8, seed: 1, exe: os.Args[0], env: []string{asDaemonEnv + "=1"}}
	err := runDemo(ctx, o, &out, &logs)
	if err != nil {
		t.Fatalf("%v\nlogs:\n%s", err, logs.String())
	}
	t.Logf("demo output:\n%s", out.String())
	if !strings.Contains(out.String(), "Hello there") || !strings.Contains(out.String(), "tokens in") {
		t.Errorf("demo output lacks the prompt or the summary:\n%s", out.String())
	}
}
