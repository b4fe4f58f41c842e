package cuda

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/tandem-llm/tandem/collective/nccl"
	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/stage"
)

// TestTwoGPUSplit runs a model split over two GPUs, the activations handed
// from one to the other through NCCL, and checks that it computes exactly
// what the whole model computes on one GPU: the same logits at every
// position of a prefill and greedy decodes, and the same tokens.
func TestTwoGPUSplit(t *testing.T) {
	dev0 := device(t)
	if n, err := gpu.DeviceCount(); err != nil || n < 2 {
		t.Skipf("two GPUs needed, %d present (%v)", n, err)
	}
	dev1, err := gpu.Open(1)
	if err != nil {
		t.Fatal(err)
	}
	// Registered before the stages, so it runs after their Close.
	t.Cleanup(func() {
		if err := dev1.Close(); err != nil {
			t.Error(err)
		}
	})
	sh, w := fourLayers(t, 21)
	m := sh.Model
	cfg := func(lo, hi int, dev *gpu.Device) Config {
		return Config{Model: &m, Lo: lo, Hi: hi, Weights: w, MaxTokens: 64, MaxSeqs: 4, Device: dev, CacheDir: testDev.cache}
	}
	whole := newTestStage(t, cfg(0, 4, dev0))
	first := newTestStage(t, cfg(0, 2, dev0))
	second := newTestStage(t, cfg(2, 4, dev1))

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	id, err := nccl.NewUniqueID()
	if err != nil {
		t.Fatal(err)
	}
	comms := make([]*gpu.NCCLComm, 2)
	errs := make(chan error, 2)
	for rank, dev := range []*gpu.Device{dev0, dev1} {
		go func() {
			var err error
			comms[rank], err = nccl.Connect(ctx, dev, 2, id, rank)
			errs <- err
		}()
	}
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	defer dev0.Do(comms[0].Destroy)
	defer dev1.Do(comms[1].Destroy)
	send, err := nccl.NewSender(nccl.Config{Device: dev0, Comm: comms[0], Peer: 1, Stream: first.Stream()})
	if err != nil {
		t.Fatal(err)
	}
	defer send.Close()
	recv, err := nccl.NewReceiver(nccl.Config{Device: dev1, Comm: comms[1], Peer: 0, Stream: second.Stream()})
	if err != nil {
		t.Fatal(err)
	}
	defer recv.Close()

	split := func(b *stage.Batch) (*stage.Output, error) {
		out, err := first.Forward(ctx, b)
		if err != nil {
			return nil, err
		}
		sent := make(chan error, 1)
		go func() { sent <- send.Send(ctx, out.Header, out.Activations) }()
		rerr := recv.Recv(ctx, out.Header, second.Input())
		if serr := <-sent; serr != nil {
			return nil, serr
		}
		if rerr != nil {
			return nil, rerr
		}
		return second.Forward(ctx, b)
	}

	rng := rand.New(rand.NewPCG(21, 1))
	prompts := [][]int32{}
	for _, n := range []int{7, 19, 33} {
		p := make([]int32, n)
		for i := range p {
			p[i] = int32(rng.IntN(m.VocabSize))
		}
		prompts = append(prompts, p)
	}
	tables := tablesFor(whole)
	pos := make([]int, len(prompts))
	next := make([]int32, len(prompts))
	worst, positions := 0.0, 0
	for step := 0; step < 9; step++ {
		b := &stage.Batch{ID: uint64(step + 1)}
		for i, p := range prompts {
			toks := []int32{next[i]}
			if step == 0 {
				toks = p
			}
			b.Seqs = append(b.Seqs, stage.Seq{ID: uint64(i + 1), Pos: pos[i], Tokens: toks, Sample: true, Index: step, Logits: true,
				Sampling: stage.Sampling{Logprobs: 2}})
			pos[i] += len(toks)
		}
		one, err := whole.Forward(ctx, fill(t, tables, b))
		if err != nil {
			t.Fatal(err)
		}
		want := make([][][]float32, len(one.Logits))
		for i, sl := range one.Logits {
			for _, r := range sl.Rows {
				want[i] = append(want[i], append([]float32(nil), r...))
			}
		}
		wantTok := fmt.Sprint(one.Sampled)
		two, err := split(b)
		if err != nil {
			t.Fatalf("batch %d over two GPUs: %v", b.ID, err)
		}
		if got := fmt.Sprint(two.Sampled); got != wantTok {
			t.Fatalf("batch %d: two GPUs sampled %s, one GPU %s", b.ID, got, wantTok)
		}
		for i, sl := range two.Logits {
			for r, row := range sl.Rows {
				var st compareStats
				rel, _, _ := st.add(row, want[i][r])
				worst = max(worst, rel)
				positions++
				if rel > 1e-6 {
					t.Errorf("batch %d seq %d row %d: logits differ from one GPU by %.3g relative", b.ID, sl.Seq, r, rel)
				}
			}
		}
		for i, s := range two.Sampled {
			next[i] = s.Token
		}
	}
	t.Logf("model split over GPUs 0 and 1 through NCCL: %d positions, max relative logits difference from one GPU %.3g", positions, worst)
	writeResult(t, "two_gpu", map[string]any{"positions": positions, "max_rel_diff": worst})
}
