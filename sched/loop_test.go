package sched_test

import (
	"context"
	"errors"
	"io"
	"slices"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/tandem-llm/tandem/pipeline"
	"github.com/tandem-llm/tandem/sched"
	"github.com/tandem-llm/tandem/stage"
)

// fixedLatency is a stage time of d for every stage and step.
func fixedLatency(d time.Duration) func(int, *stage.Batch) time.Duration {
	return func(int, *stage.Batch) time.Duration { return d }
}

// recvAll reads a stream to its end.
func recvAll(s *sched.Stream) ([]int32, string, error) {
	var toks []int32
	var finish string
	for {
		o, err := s.Recv(context.Background())
		if err != nil {
			return toks, finish, err
		}
		toks = append(toks, o.Token.Token)
		finish = o.Finish
	}
}

func TestLoopServesAndCloses(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		model := fakeModel{stages: 2, vocab: 50}
		fp := newFakePipe(fakePipeConfig{model: model, numBlocks: 16, blockSize: 4, maxSeqs: 4, maxConcurrent: 2, latency: fixedLatency(10 * time.Millisecond)})
		defer fp.Close()
		l, err := sched.Start(sched.Config{MaxNumBatchedTokens: 16, MaxNumSeqs: 4, BlockSize: 4, NumBlocks: 16, MaxConcurrentBatches: 2}, fp)
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		if _, err := l.Submit(ctx, sched.Request{MaxTokens: 3}); err == nil || !strings.Contains(err.Error(), "empty prompt") {
			t.Errorf("empty prompt: error %v", err)
		}
		short := sched.Request{Prompt: []int32{1, 2, 3}, MaxTokens: 5}
		// 11 blocks for the long one and 2 for the short: both run at once.
		long := sched.Request{Prompt: []int32{4, 5}, MaxTokens: 40}
		s1, err := l.Submit(ctx, short)
		if err != nil {
			t.Fatal(err)
		}
		s2, err := l.Submit(ctx, long)
		if err != nil {
			t.Fatal(err)
		}
		if s1.ID() == s2.ID() {
			t.Errorf("two requests got id %d", s1.ID())
		}
		toks, finish, err := recvAll(s1)
		want, wantFinish := model.alone(&short)
		if err != io.EOF || !slices.Equal(toks, want) || finish != wantFinish {
			t.Errorf("short request: %v %q %v; want %v %q io.EOF", toks, finish, err, want, wantFinish)
		}
		// The long one is still running: its stats show, then Close cuts it.
		if st := l.Stats(); st.Running != 1 || st.KVBlocksUsed == 0 || st.Steps == 0 || st.LastStepTime < 20*time.Millisecond {
			t.Errorf("stats while running: %+v; want 1 running, blocks used, steps of at least 2 stages × 10ms", st)
		}
		if err := l.Close(); err != nil {
			t.Fatal(err)
		}
		got, _, err := recvAll(s2)
		wantLong, _ := model.alone(&long)
		if !errors.Is(err, sched.ErrClosed) || len(got) == 0 || !slices.Equal(got, wantLong[:len(got)]) {
			t.Errorf("long request after Close: %v %v; want a prefix of %v and ErrClosed", got, err, wantLong)
		}
		if _, err := l.Submit(ctx, short); !errors.Is(err, sched.ErrClosed) {
			t.Errorf("submit after Close: %v, want ErrClosed", err)
		}
		<-l.Done()
	})
}

func TestLoopCancel(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		model := fakeModel{stages: 3, vocab: 50}
		fp := newFakePipe(fakePipeConfig{model: model, numBlocks: 16, blockSize: 4, maxSeqs: 4, maxConcurrent: 4, latency: fixedLatency(10 * time.Millisecond)})
		l, err := sched.Start(sched.Config{MaxNumBatchedTokens: 16, MaxNumSeqs: 4, BlockSize: 4, NumBlocks: 16, MaxConcurrentBatches: 4, OnDeviceHandoff: true}, fp)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		r := sched.Request{Prompt: []int32{7, 8, 9}, MaxTokens: 40}
		s, err := l.Submit(ctx, r)
		if err != nil {
			t.Fatal(err)
		}
		for range 3 {
			if _, err := s.Recv(ctx); err != nil {
				t.Fatal(err)
			}
		}
		cancel()
		if o, err := s.Recv(context.Background()); !errors.Is(err, context.Canceled) {
			t.Errorf("after cancel: %+v %v, want context.Canceled", o, err)
		}
		time.Sleep(time.Second) // the placeholders in flight come back
		synctest.Wait()
		if st := l.Stats(); st.Cancelled != 1 || st.Running != 0 || st.KVBlocksUsed != 0 || st.InFlight != 0 || st.Discarded == 0 {
			t.Errorf("stats after cancel: %+v; want 1 cancelled, nothing held or in flight, tokens discarded", st)
		}
		l.Close()
		fp.Close()
		for _, err := range fp.Errs() {
			t.Error(err)
		}
	})
}

// failingExecutor fails every Wait.
type failingExecutor struct{}

func (failingExecutor) Submit(context.Context, *pipeline.Step) error { return nil }
func (failingExecutor) Wait(context.Context) (*pipeline.Result, error) {
	return nil, errors.New("stage 1: link lost")
}

func TestLoopExecutorFailure(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		l, err := sched.Start(sched.Config{MaxNumBatchedTokens: 16, MaxNumSeqs: 4, NumBlocks: 4}, failingExecutor{})
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		s, err := l.Submit(context.Background(), sched.Request{Prompt: []int32{1}, MaxTokens: 2})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.Recv(context.Background()); err == nil || !strings.Contains(err.Error(), "link lost") {
			t.Errorf("stream: %v, want the pipeline's failure", err)
		}
		<-l.Done()
		if err := l.Err(); err == nil || !strings.Contains(err.Error(), "link lost") {
			t.Errorf("loop: %v, want the pipeline's failure", err)
		}
		if _, err := l.Submit(context.Background(), sched.Request{Prompt: []int32{1}, MaxTokens: 2}); err == nil || !strings.Contains(err.Error(), "link lost") {
			t.Errorf("submit after failure: %v", err)
		}
	})
}

// TestLoopHandoffBacklog runs requests of one token each with hand-off:
// every step samples and none has a placeholder, so only the rule that a
// step also awaits every hand-off seen back keeps the messages waiting on
// the ring link (of max concurrent batches) from filling it and stalling
// the last stage.
func TestLoopHandoffBacklog(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		model := fakeModel{stages: 3, vocab: 50}
		fp := newFakePipe(fakePipeConfig{model: model, numBlocks: 64, blockSize: 4, maxSeqs: 2, maxConcurrent: 4, latency: fixedLatency(time.Millisecond)})
		l, err := sched.Start(sched.Config{MaxNumBatchedTokens: 8, MaxNumSeqs: 2, BlockSize: 4, NumBlocks: 64, MaxConcurrentBatches: 4, OnDeviceHandoff: true}, fp)
		if err != nil {
			t.Fatal(err)
		}
		var streams []*sched.Stream
		var reqs []sched.Request
		for i := range 40 {
			r := sched.Request{Prompt: []int32{int32(i % 50), 3}, MaxTokens: 1}
			s, err := l.Submit(context.Background(), r)
			if err != nil {
				t.Fatal(err)
			}
			streams, reqs = append(streams, s), append(reqs, r)
		}
		for i, s := range streams {
			toks, finish, err := recvAll(s)
			want, wantFinish := model.alone(&reqs[i])
			if err != io.EOF || !slices.Equal(toks, want) || finish != wantFinish {
				t.Errorf("request %d: %v %q %v; want %v %q io.EOF", i, toks, finish, err, want, wantFinish)
			}
		}
		l.Close()
		fp.Close()
		for _, err := range fp.Errs() {
			t.Error(err)
		}
	})
}
