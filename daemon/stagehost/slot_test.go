package stagehost

import (
	"context"
	"io"
	"log/slog"
	"path/filepath"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/tandem-llm/tandem/daemon/nodewire"
	"github.com/tandem-llm/tandem/daemon/placement"
	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/randinit"
	"github.com/tandem-llm/tandem/pipeline"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
	"github.com/tandem-llm/tandem/stage"
)

// TestMain checks that no test leaves a goroutine behind: every
// assignment's goroutines end with it.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// testSlot is a CPU stage slot over a small random checkpoint of 4 layers,
// whose stages may use usable bytes.
func testSlot(t *testing.T, usable uint64) (*Slot, *model.Checkpoint) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "model")
	o := randinit.DefaultOptions()
	o.Layers, o.Seed = 4, 3
	if err := randinit.Write(dir, o); err != nil {
		t.Fatal(err)
	}
	ckpt, err := model.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ckpt.Close() })
	s := New(Config{
		Name: "n", Checkpoint: ckpt, Device: CPUDevice(), Usable: usable,
		ControlAddr: "127.0.0.1:0", DataAddr: "127.0.0.1:0",
		Cost: func(_ string, maxTokens, maxSeqs int) placement.Cost {
			c := placement.CostOf(ckpt.Config(), 4)
			c.WorkspaceBytes = placement.Workspace(ckpt.Config(), maxTokens, maxSeqs)
			return c
		},
		Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	t.Cleanup(s.Stop)
	return s, ckpt
}

// load assigns the whole model to the slot at epoch, as the only stage.
func load(t *testing.T, s *Slot, epoch uint64, maxSeqs int, alongside bool) *tandemv1.LoadResponse {
	t.Helper()
	r, err := s.Load(context.Background(), &tandemv1.LoadRequest{Epoch: epoch, Leader: "l", ModelId: s.cfg.Checkpoint.Identity(),
		LayerLo: 0, LayerHi: 4, MaxBatchTokens: 32, MaxSeqs: uint32(maxSeqs), BlockSize: 16, Alongside: alongside})
	if err != nil {
		t.Fatalf("load epoch %d: %v", epoch, err)
	}
	return r
}

// wire connects the only stage of epoch and dials its control link.
func wire(t *testing.T, s *Slot, epoch uint64, r *tandemv1.LoadResponse) *pipeline.Driver {
	t.Helper()
	ctx := context.Background()
	if _, err := s.Connect(ctx, &tandemv1.ConnectRequest{Epoch: epoch}); err != nil {
		t.Fatalf("connect epoch %d: %v", epoch, err)
	}
	link, err := pipeline.ControlConfig{Link: nodewire.ControlLink(s.cfg.Name), Epoch: epoch}.Dial(ctx, r.GetControlAddr())
	if err != nil {
		t.Fatal(err)
	}
	d, err := pipeline.NewDriver([]pipeline.Link{link})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

// prefill runs sequence 1's prompt from position 0 on the pipeline of
// epoch and returns the token it samples.
func prefill(d *pipeline.Driver, epoch, batch uint64) (int32, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := d.Step(ctx, &pipeline.Step{Epoch: epoch, Batch: stage.Batch{ID: batch, Seqs: []stage.Seq{
		{ID: 1, Tokens: []int32{5, 17, 99, 3}, Blocks: []int32{0}, Sample: true},
	}}})
	if err != nil {
		return 0, err
	}
	return res.Sampled[0].Token, nil
}

// awaitEnd waits until the driver's stage has gone (its link ended).
func awaitEnd(t *testing.T, d *pipeline.Driver, what string) {
	t.Helper()
	select {
	case <-d.Broken():
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: its stage still serves", what)
	}
}

// TestSlotReuse moves the slot's stage to a new epoch of the same layers
// and bounds: the stage is reused (not reloaded) and loaded alongside, the
// old pipeline serves until the new one's first step takes the stage
// over, and there the stage has forgotten the old pipeline's sequences
// (sequence 1 prefills again from position 0 with the same token). Loaded
// without alongside (a recovery), the old assignment goes at once and the
// stage is reused still.
func TestSlotReuse(t *testing.T) {
	s, _ := testSlot(t, 1<<30)
	r1 := load(t, s, 1, 4, false)
	if r1.GetReused() || r1.GetAlongside() {
		t.Errorf("first load: reused %t alongside %t, want neither", r1.GetReused(), r1.GetAlongside())
	}
	d1 := wire(t, s, 1, r1)
	want, err := prefill(d1, 1, 1)
	if err != nil {
		t.Fatal(err)
	}

	r2 := load(t, s, 2, 4, true)
	if !r2.GetReused() || !r2.GetAlongside() {
		t.Errorf("same layers, alongside: reused %t alongside %t, want both", r2.GetReused(), r2.GetAlongside())
	}
	// The old pipeline still serves (a new sequence: 1 is cached there).
	if _, err := d1.Step(context.Background(), &pipeline.Step{Epoch: 1, Batch: stage.Batch{ID: 2, Seqs: []stage.Seq{
		{ID: 2, Tokens: []int32{7}, Blocks: []int32{1}, Sample: true},
	}}}); err != nil {
		t.Fatalf("the old pipeline, while the new one is wired: %v", err)
	}
	d2 := wire(t, s, 2, r2)
	got, err := prefill(d2, 2, 1)
	if err != nil || got != want {
		t.Fatalf("sequence 1 prefilled again on the reused stage: token %d, %v; want %d", got, err, want)
	}
	awaitEnd(t, d1, "the old pipeline after the takeover")
	if _, err := s.Release(context.Background(), &tandemv1.ReleaseRequest{Epoch: 1}); err != nil {
		t.Errorf("release of the taken-over epoch: %v", err)
	}

	r3 := load(t, s, 3, 4, false)
	awaitEnd(t, d2, "the pipeline of epoch 2 after a load without alongside")
	if s.Busy() {
		t.Error("busy with a stage loaded and not yet wired: a draining node would wait for a pipeline that may never come")
	}
	if !r3.GetReused() || r3.GetAlongside() {
		t.Errorf("same layers, not alongside: reused %t alongside %t, want reused only", r3.GetReused(), r3.GetAlongside())
	}
	d3 := wire(t, s, 3, r3)
	if got, err := prefill(d3, 3, 1); err != nil || got != want {
		t.Errorf("after a recovery's load: token %d, %v; want %d", got, err, want)
	}
	if !s.Busy() {
		t.Error("not busy while its stage serves a pipeline")
	}
	if _, err := s.Release(context.Background(), &tandemv1.ReleaseRequest{Epoch: 3}); err != nil {
		t.Fatal(err)
	}
	if s.Busy() {
		t.Error("busy after its last assignment was released")
	}
}

// TestSlotAlongsideMemory loads a stage that cannot be reused (other batch
// bounds) beside the serving one: with memory for both, the old one keeps
// serving until released; without, it is released first.
func TestSlotAlongsideMemory(t *testing.T) {
	for _, tt := range []struct {
		name      string
		usable    uint64
		alongside bool
	}{{"memory for both", 1 << 30, true}, {"memory for one", 0, false}} {
		t.Run(tt.name, func(t *testing.T) {
			s, _ := testSlot(t, 1<<30)
			r1 := load(t, s, 1, 4, false)
			d1 := wire(t, s, 1, r1)
			if _, err := prefill(d1, 1, 1); err != nil {
				t.Fatal(err)
			}
			if tt.usable == 0 {
				// Room for the stage serving and a little more, not for two.
				c := s.cfg.Cost("cpu", 32, 4)
				s.cfg.Usable = c.StageBytes(0, 4, int(r1.GetKvBlocks())*16) + c.StageBytes(0, 4, 16)
			}
			r2 := load(t, s, 2, 2, true)
			if r2.GetReused() || r2.GetAlongside() != tt.alongside {
				t.Fatalf("other bounds: reused %t alongside %t, want alongside %t only", r2.GetReused(), r2.GetAlongside(), tt.alongside)
			}
			if tt.alongside {
				if _, err := d1.Step(context.Background(), &pipeline.Step{Epoch: 1, Batch: stage.Batch{ID: 2, Seqs: []stage.Seq{
					{ID: 2, Tokens: []int32{7}, Blocks: []int32{1}, Sample: true},
				}}}); err != nil {
					t.Fatalf("the old pipeline beside the new stage: %v", err)
				}
				if _, err := s.Release(context.Background(), &tandemv1.ReleaseRequest{Epoch: 1}); err != nil {
					t.Fatal(err)
				}
			}
			awaitEnd(t, d1, "the old pipeline")
			d2 := wire(t, s, 2, r2)
			if _, err := prefill(d2, 2, 1); err != nil {
				t.Errorf("the new stage: %v", err)
			}
		})
	}
}
