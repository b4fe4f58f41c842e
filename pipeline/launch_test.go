package pipeline_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/pipeline"
	"github.com/tandem-llm/tandem/sched"
	"github.com/tandem-llm/tandem/stage"
	"github.com/tandem-llm/tandem/stage/stagetest"
)

// TestLaunchedSingleStage drives a pipeline's only stage that is a
// stage.Launcher (a hash stage behind stagetest.Timed, 1ms a step)
// through sched.Loop with hand-off and two steps in flight: the worker
// launches each step while the one before it runs, and every request's
// tokens are those it produces alone.
func TestLaunchedSingleStage(t *testing.T) {
	const vocab = 50
	timed := stagetest.NewTimed(newHashStage(true, true, vocab, 0), time.Millisecond)
	d, err := pipeline.LocalOptions{Handoff: true}.Start(context.Background(), []stage.Stage{timed})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	l, err := sched.Start(sched.Config{MaxNumBatchedTokens: 24, MaxNumSeqs: hashMaxSeqs, BlockSize: 4, NumBlocks: 256,
		MaxConcurrentBatches: 2, OnDeviceHandoff: true}, d)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	checkAlone(t, l, 1, vocab, rand.New(rand.NewPCG(5, 7)), 16, 24)
	st := timed.Stats()
	t.Logf("%d steps, %d launched behind another, device idle %v", st.Steps, st.Ahead, st.Idle)
	if st.Ahead == 0 {
		t.Error("no step was launched while another ran")
	}
}

// TestWorkerLaunched runs a worker over a Launcher from a script of steps,
// all there at once: it keeps two launched, frees sequences between
// launches, launches a step asking for logits alone (the stage refuses it
// otherwise), reports every step in order and, at the link's end, finishes
// what it launched; a step of an older epoch is refused.
func TestWorkerLaunched(t *testing.T) {
	decode := func(id uint64, pos int, logits bool) *pipeline.Step {
		return &pipeline.Step{Epoch: 3, AwaitHandoff: int(id) - 1, Batch: stage.Batch{ID: id, Handoff: true,
			Seqs: []stage.Seq{{ID: 1, Pos: pos, Tokens: []int32{stage.Placeholder}, Sample: true, Index: int(id) - 1, Logits: logits}}}}
	}
	script := func() []*pipeline.Step {
		steps := []*pipeline.Step{{Epoch: 3, Batch: stage.Batch{ID: 1, Handoff: true, Seqs: []stage.Seq{{ID: 1, Tokens: []int32{4, 5}, Sample: true}}}}}
		for id := uint64(2); id <= 6; id++ {
			steps = append(steps, decode(id, int(id), id == 4))
		}
		// Seq 1 ends; seq 2 takes its slot.
		steps = append(steps, &pipeline.Step{Epoch: 3, Free: []uint64{1}, AwaitHandoff: 5,
			Batch: stage.Batch{ID: 7, Handoff: true, Seqs: []stage.Seq{{ID: 2, Tokens: []int32{7}, Sample: true}}}})
		return steps
	}
	t.Run("served", func(t *testing.T) {
		timed := stagetest.NewTimed(newHashStage(true, true, 50, 0), 200*time.Microsecond)
		ctl := &scriptedControl{steps: script()}
		w := &pipeline.Worker{Stage: timed, Ctl: ctl, Epoch: 3}
		if err := w.Serve(context.Background()); err != nil {
			t.Fatal(err)
		}
		var batches []uint64
		for _, r := range ctl.reports {
			if r.Err != "" {
				t.Fatalf("batch %d failed: %s", r.Batch, r.Err)
			}
			batches = append(batches, r.Batch)
		}
		if want := []uint64{1, 2, 3, 4, 5, 6, 7}; !slices.Equal(batches, want) {
			t.Errorf("reports of batches %v, want %v", batches, want)
		}
		if st := timed.Stats(); st.Steps != 7 || st.Ahead == 0 {
			t.Errorf("%d steps, %d launched behind another; want 7 steps and some behind another", st.Steps, st.Ahead)
		}
		// Seq 1's tokens follow each other through the placeholders: the
		// hash chain of a single stage fed its own samples.
		r := &sched.Request{Prompt: []int32{4, 5}, MaxTokens: 6}
		var got []int32
		for _, rep := range ctl.reports[:6] {
			got = append(got, rep.Sampled[0].Token)
		}
		if want := hashAlone(1, 50, r); !slices.Equal(got, want) {
			t.Errorf("seq 1 sampled %v, want %v", got, want)
		}
	})
	t.Run("stale epoch", func(t *testing.T) {
		steps := script()
		steps[3].Epoch = 2
		timed := stagetest.NewTimed(newHashStage(true, true, 50, 0), 200*time.Microsecond)
		ctl := &scriptedControl{steps: steps}
		w := &pipeline.Worker{Stage: timed, Ctl: ctl, Epoch: 3}
		err := w.Serve(context.Background())
		if err == nil || !strings.Contains(err.Error(), "epoch 2 refused") {
			t.Fatalf("Serve: %v, want the refusal of epoch 2", err)
		}
		last := ctl.reports[len(ctl.reports)-1]
		if last.Batch != 4 || last.Err == "" {
			t.Errorf("last report %+v, want the refusal of batch 4", last)
		}
		if st := timed.Stats(); st.Steps != 3 {
			t.Errorf("%d steps ran, want the 3 before the refusal", st.Steps)
		}
	})
}

// TestLinkedLaunched drives pipelines of two and three stages that are
// stage.LinkedLauncher (hash stages behind stagetest.Timed, 300µs a step)
// over stream-ordered in-memory links (orderedPipe) through sched.Loop, with hand-off
// (one more step in flight than stages) and without: every worker keeps
// steps launched behind the one running, ordering receives before and
// sends after each launch, and every request's tokens are those it
// produces alone. Over plain links the same stages run one Forward at a
// time.
func TestLinkedLaunched(t *testing.T) {
	const vocab = 50
	for _, p := range []int{2, 3} {
		for _, handoff := range []bool{true, false} {
			for _, ordered := range []bool{true, false} {
				t.Run(fmt.Sprintf("stages=%d/handoff=%v/ordered=%v", p, handoff, ordered), func(t *testing.T) {
					var timed []*stagetest.Timed
					var stages []stage.Stage
					for k := range p {
						timed = append(timed, stagetest.NewTimed(newHashStage(k == 0, k == p-1, vocab, 0), 300*time.Microsecond))
						stages = append(stages, timed[k])
					}
					opts := pipeline.LocalOptions{Handoff: handoff}
					if ordered {
						opts.Link = orderedPipe
					}
					d, err := opts.Start(context.Background(), stages)
					if err != nil {
						t.Fatal(err)
					}
					defer d.Close()
					cfg := sched.Config{MaxNumBatchedTokens: 24, MaxNumSeqs: hashMaxSeqs, BlockSize: 4, NumBlocks: 256, MaxConcurrentBatches: p}
					if handoff {
						cfg.MaxConcurrentBatches, cfg.OnDeviceHandoff = p+1, true
					}
					l, err := sched.Start(cfg, d)
					if err != nil {
						t.Fatal(err)
					}
					defer l.Close()
					checkAlone(t, l, p, vocab, rand.New(rand.NewPCG(uint64(p), 11)), 16, 16)
					for k, tm := range timed {
						st := tm.Stats()
						t.Logf("stage %d: %d steps, %d launched behind another", k, st.Steps, st.Ahead)
						if ordered && st.Ahead == 0 {
							t.Errorf("stage %d: no step was launched while another ran", k)
						}
						if !ordered && st.Ahead != 0 {
							t.Errorf("stage %d: %d steps launched behind another over plain links", k, st.Ahead)
						}
					}
				})
			}
		}
	}
}

// orderedPipe is an in-memory pipe marked stream-ordered
// (collective.StreamOrdered), as NCCL links between CUDA stages are: for
// stages whose outputs are complete when a batch is launched
// (stagetest.Timed computes at launch), since a pipe copies a message when
// it is sent.
func orderedPipe(_, _, depth int) (collective.Sender, collective.Receiver) {
	s, r := collective.Pipe(depth)
	return orderedSender{s}, orderedReceiver{r}
}

type (
	orderedSender   struct{ collective.Sender }
	orderedReceiver struct{ collective.Receiver }
)

func (orderedSender) StreamOrdered() bool   { return true }
func (orderedReceiver) StreamOrdered() bool { return true }

// TestLinkedFailureReported checks that a step a linked stage refuses at
// its launch (a position gap) fails with an error naming the stage, and
// that the pipeline's other stage, waiting on its links, ends too instead
// of hanging, with hand-off on and off.
func TestLinkedFailureReported(t *testing.T) {
	for _, handoff := range []bool{true, false} {
		t.Run(fmt.Sprintf("handoff=%v", handoff), func(t *testing.T) {
			var stages []stage.Stage
			for k := range 2 {
				stages = append(stages, stagetest.NewTimed(newHashStage(k == 0, k == 1, 50, 0), 100*time.Microsecond))
			}
			d, err := pipeline.LocalOptions{Handoff: handoff, Link: orderedPipe}.Start(context.Background(), stages)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			ok := stage.Batch{ID: 1, Handoff: handoff, Seqs: []stage.Seq{{ID: 1, Tokens: []int32{3, 4}, Sample: true}}}
			if _, err := d.Step(ctx, &pipeline.Step{Batch: ok}); err != nil {
				t.Fatal(err)
			}
			gap := stage.Batch{ID: 2, Seqs: []stage.Seq{{ID: 1, Pos: 5, Tokens: []int32{1}, Sample: true}}}
			_, err = d.Step(ctx, &pipeline.Step{Batch: gap})
			if err == nil || !strings.Contains(err.Error(), "stage 0") || !strings.Contains(err.Error(), "position 5") {
				t.Fatalf("error %v, want stage 0's refusal of position 5", err)
			}
			done := make(chan error, 1)
			go func() { done <- d.Close() }()
			select {
			case <-done:
			case <-ctx.Done():
				t.Fatal("the pipeline did not close after the failure")
			}
		})
	}
}
