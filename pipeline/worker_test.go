package pipeline_test

import (
	"context"
	"io"
	"strings"
	"testing"

	"github.com/tandem-llm/tandem/pipeline"
	"github.com/tandem-llm/tandem/stage"
	"github.com/tandem-llm/tandem/stage/cpu"
)

// scriptedControl hands a worker fixed steps, then io.EOF, and records its
// reports.
type scriptedControl struct {
	steps   []*pipeline.Step
	reports []*pipeline.Result
}

func (c *scriptedControl) Next(context.Context) (*pipeline.Step, error) {
	if len(c.steps) == 0 {
		return nil, io.EOF
	}
	s := c.steps[0]
	c.steps = c.steps[1:]
	return s, nil
}

func (c *scriptedControl) Report(_ context.Context, r *pipeline.Result) error {
	c.reports = append(c.reports, r)
	return nil
}

// TestWorkerRefusesStaleEpoch checks that a worker assigned in one leader
// epoch runs steps of that epoch and newer ones, and refuses, without
// running it, a step of an older epoch, naming both epochs.
func TestWorkerRefusesStaleEpoch(t *testing.T) {
	ckpt := openModel(t)
	cfg := ckpt.Config()
	st, err := cpu.New(cpu.Config{Model: cfg, Lo: 0, Hi: cfg.NumLayers, Weights: ckpt, MaxTokens: 16, MaxSeqs: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	step := func(epoch, batch uint64, pos int) *pipeline.Step {
		return &pipeline.Step{Epoch: epoch, Batch: stage.Batch{ID: batch, Seqs: []stage.Seq{{ID: 1, Pos: pos, Tokens: []int32{5, 6}, Blocks: []int32{0}, Sample: true}}}}
	}
	ctl := &scriptedControl{steps: []*pipeline.Step{step(7, 1, 0), step(8, 2, 2), step(6, 3, 4), step(8, 4, 4)}}
	w := &pipeline.Worker{Stage: st, Ctl: ctl, Epoch: 7}
	err = w.Serve(context.Background())
	if err == nil || !strings.Contains(err.Error(), "epoch 6 refused") || !strings.Contains(err.Error(), "epoch 7") {
		t.Fatalf("Serve: %v, want a refusal of epoch 6 naming epoch 7", err)
	}
	if len(ctl.reports) != 3 {
		t.Fatalf("%d reports, want 3 (two results and the refusal)", len(ctl.reports))
	}
	for i, r := range ctl.reports[:2] {
		if r.Err != "" || len(r.Sampled) != 1 {
			t.Errorf("report %d: %+v, want one sampled token", i, r)
		}
	}
	if r := ctl.reports[2]; r.Batch != 3 || r.Err == "" {
		t.Errorf("last report %+v, want the refusal of batch 3", r)
	}
	// The worker reads one step ahead (it decodes the next step while it
	// runs one), but runs nothing after the refusal: no fourth report.
	if len(ctl.steps) > 1 {
		t.Errorf("worker read on after the refusal: %d steps left, want at most 1", len(ctl.steps))
	}
}
