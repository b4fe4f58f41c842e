package sched_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/randinit"
	"github.com/tandem-llm/tandem/pipeline"
	"github.com/tandem-llm/tandem/sched"
	"github.com/tandem-llm/tandem/stage"
	"github.com/tandem-llm/tandem/stage/cpu"
)

// cpuPipeline starts an in-process pipeline of CPU stages over ckpt, split
// at the given layers, with KV caches of the given blocks (0: the stage's
// defaults) and on-device hand-off if asked. It returns the pipeline and
// the least capacity of its stages.
func cpuPipeline(t *testing.T, ckpt *model.Checkpoint, numBlocks, blockSize int, handoff bool, splits ...int) (*pipeline.Driver, int) {
	t.Helper()
	cfg := ckpt.Config()
	bounds := append(append([]int{0}, splits...), cfg.NumLayers)
	var stages []stage.Stage
	capacity := 0
	for i := 0; i+1 < len(bounds); i++ {
		st, err := cpu.New(cpu.Config{Model: cfg, Lo: bounds[i], Hi: bounds[i+1], Weights: ckpt, MaxTokens: 64, MaxSeqs: 8,
			NumBlocks: numBlocks, BlockSize: blockSize, Threads: 1})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		stages = append(stages, st)
		if info := st.Info(); capacity == 0 || info.KVBlocks < capacity {
			capacity = info.KVBlocks
		}
	}
	d, err := pipeline.LocalOptions{Handoff: handoff}.Start(context.Background(), stages)
	if err != nil {
		t.Fatal(err)
	}
	return d, capacity
}

// TestCPUCluster runs concurrent requests through the Loop over real CPU
// pipelines of two and three stages, with prompts chunked, several steps
// in flight (one more than the stages with on-device hand-off) and a KV
// capacity small enough to force preemption. Requests arrive at seeded
// random times, one stops on a stop token and some are cancelled after a
// few tokens. Every finished request's tokens equal the request run alone
// through pipeline.Generate on a single stage, a cancelled one's are a
// prefix of them, and afterwards no request and no KV block is held.
func TestCPUCluster(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "m")
	o := randinit.DefaultOptions()
	o.Seed = 11
	if err := randinit.Write(dir, o); err != nil {
		t.Fatal(err)
	}
	ckpt, err := model.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ckpt.Close()
	vocab := ckpt.Config().VocabSize

	var reqs []sched.Request
	const n = 24
	for i := range n {
		r := sched.Request{Prompt: make([]int32, 1+(i*7)%23), MaxTokens: 3 + i%6}
		for j := range r.Prompt {
			r.Prompt[j] = int32((i*131 + j*17 + 3) % vocab)
		}
		if i%2 == 1 {
			r.Sampling = stage.Sampling{Temperature: 0.8, TopK: 40, Seed: uint64(i)}
		}
		reqs = append(reqs, r)
	}
	alone, _ := cpuPipeline(t, ckpt, 0, 0, false)
	want := make([][]int32, len(reqs))
	for i, r := range reqs {
		err := pipeline.Generate(context.Background(), alone, []pipeline.Request{{ID: 1, Prompt: r.Prompt, MaxTokens: r.MaxTokens, Sampling: r.Sampling}},
			pipeline.GenerateOptions{}, func(ev pipeline.Event) error {
				want[i] = append(want[i], ev.Token.Token)
				return nil
			})
		if err != nil {
			t.Fatal(err)
		}
	}
	if err := alone.Close(); err != nil {
		t.Fatal(err)
	}
	// Request 0 stops on its second token.
	reqs[0].StopTokens = []int32{want[0][1]}
	want[0] = want[0][:slices.Index(want[0], want[0][1])+1]

	goroutines := runtime.NumGoroutine()
	for _, tc := range []struct {
		c      sched.Config
		splits []int
	}{
		// The 10-block pipelines admit whatever fits now (GrowthReserve
		// -1), so that requests preempt each other: what preemption must
		// preserve is part of the check.
		{sched.Config{MaxNumBatchedTokens: 16, MaxNumSeqs: 4, BlockSize: 4, NumBlocks: 10, MaxConcurrentBatches: 2, GrowthReserve: -1}, []int{2}},
		{sched.Config{MaxNumBatchedTokens: 7, MaxNumSeqs: 8, BlockSize: 2, NumBlocks: 16, MaxConcurrentBatches: 1}, []int{2}},
		{sched.Config{MaxNumBatchedTokens: 16, MaxNumSeqs: 4, BlockSize: 4, NumBlocks: 10, MaxConcurrentBatches: 3, OnDeviceHandoff: true, GrowthReserve: -1}, []int{2}},
		{sched.Config{MaxNumBatchedTokens: 9, MaxNumSeqs: 8, BlockSize: 2, NumBlocks: 20, MaxConcurrentBatches: 4, OnDeviceHandoff: true}, []int{1, 3}},
	} {
		c := tc.c
		t.Run(fmt.Sprintf("stages=%d,tokens=%d,block=%d,blocks=%d,inflight=%d,handoff=%v", len(tc.splits)+1, c.MaxNumBatchedTokens, c.BlockSize, c.NumBlocks, c.MaxConcurrentBatches, c.OnDeviceHandoff), func(t *testing.T) {
			// The stages' paged caches hold exactly the scheduler's blocks.
			d, capacity := cpuPipeline(t, ckpt, c.NumBlocks, c.BlockSize, c.OnDeviceHandoff, tc.splits...)
			defer d.Close()
			if capacity != c.NumBlocks {
				t.Fatalf("stages report %d KV blocks, want %d", capacity, c.NumBlocks)
			}
			l, err := sched.Start(c, d)
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			// Seeded arrivals within 20 ms; every fifth request (but the
			// first) is cancelled once it has its cut-th token.
			rng := rand.New(rand.NewPCG(uint64(len(tc.splits)), uint64(c.NumBlocks)))
			got := make([][]int32, len(reqs))
			cancelled := make([]bool, len(reqs))
			var wg sync.WaitGroup
			for i, r := range reqs {
				delay := time.Duration(rng.IntN(20)) * time.Millisecond
				cut := 0
				if i%5 == 4 {
					cut = 1 + rng.IntN(len(want[i])-1)
				}
				wg.Go(func() {
					time.Sleep(delay)
					rctx, rcancel := context.WithCancel(ctx)
					defer rcancel()
					s, err := l.Submit(rctx, r)
					if err != nil {
						t.Errorf("request %d: %v", i, err)
						return
					}
					for {
						o, err := s.Recv(ctx)
						if err == io.EOF {
							// Finished, also when the cancel came after its
							// last token.
							cancelled[i] = false
							return
						}
						if cancelled[i] && errors.Is(err, context.Canceled) {
							return
						}
						if err != nil {
							t.Errorf("request %d: %v", i, err)
							return
						}
						got[i] = append(got[i], o.Token.Token)
						if cut > 0 && len(got[i]) == cut {
							cancelled[i] = true
							rcancel()
						}
					}
				})
			}
			wg.Wait()
			nCancelled := 0
			for i := range reqs {
				switch {
				case cancelled[i]:
					nCancelled++
					if len(got[i]) > len(want[i]) || !slices.Equal(got[i], want[i][:len(got[i])]) {
						t.Errorf("cancelled request %d: %v, want a prefix of %v (alone)", i, got[i], want[i])
					}
				case !slices.Equal(got[i], want[i]):
					t.Errorf("request %d: %v, want %v (alone)", i, got[i], want[i])
				}
			}
			// The loop frees everything: no request held, no KV block used.
			var st sched.Stats
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
				st = l.Stats()
				if st.Running == 0 && st.Waiting == 0 && st.KVBlocksUsed == 0 && st.InFlight == 0 || time.Now().After(deadline) {
					break
				}
			}
			if st.Running != 0 || st.Waiting != 0 || st.KVBlocksUsed != 0 || st.InFlight != 0 ||
				st.Finished != uint64(n-nCancelled) || st.Cancelled+st.Finished != n {
				t.Errorf("after the run: %+v; want nothing running, waiting or held, %d finished and %d cancelled", st, n-nCancelled, nCancelled)
			}
			if nCancelled == 0 {
				t.Errorf("no request was cancelled")
			}
			t.Logf("%d requests (%d cancelled), %d steps, %d preemptions, %d discarded", n, nCancelled, st.Steps, st.Preemptions, st.Discarded)
			if c.NumBlocks <= 10 && st.Preemptions == 0 {
				t.Errorf("no preemption with a KV capacity of %d blocks", c.NumBlocks)
			}
		})
	}
	// Every goroutine of the loops and pipelines is gone.
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > goroutines && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := runtime.NumGoroutine(); n > goroutines {
		t.Errorf("%d goroutines after the runs, %d before", n, goroutines)
	}
}
