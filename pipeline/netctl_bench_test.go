package pipeline_test

import (
	"context"
	"testing"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/pipeline"
	"github.com/tandem-llm/tandem/stage"
)

// noopStage is a single-stage pipeline that computes nothing: it samples
// token 0 for every sequence asking for a token.
type noopStage struct{ out stage.Output }

func (s *noopStage) Info() stage.Info {
	return stage.Info{Backend: "noop", Hi: 1, First: true, Last: true, Hidden: 1, Vocab: 1, MaxTokens: 1 << 16, MaxSeqs: 1 << 10, ActDType: collective.F32}
}
func (s *noopStage) Input() collective.Buffer { return nil }
func (s *noopStage) Free(uint64)              {}
func (s *noopStage) Close() error             { return nil }

func (s *noopStage) Forward(_ context.Context, b *stage.Batch) (*stage.Output, error) {
	s.out.Sampled = s.out.Sampled[:0]
	for _, q := range b.Seqs {
		if q.Sample {
			s.out.Sampled = append(s.out.Sampled, stage.Sampled{Seq: q.ID, Logprob: -0.5})
		}
	}
	return &s.out, nil
}

// BenchmarkControlPlaneStep measures the control plane's cost per step: a
// decode step of 32 sequences sent to a stage over the TCP control link
// (ListenControl/DialLink, length-prefixed protobuf) on loopback, and its 32 sampled tokens back,
// with a stage that computes nothing.
func BenchmarkControlPlaneStep(b *testing.B) {
	ctx := context.Background()
	ln, err := pipeline.ListenControl("127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	served := make(chan error, 1)
	go func() {
		ctl, err := ln.Accept(ctx)
		if err != nil {
			served <- err
			return
		}
		defer ctl.Close()
		served <- (&pipeline.Worker{Stage: &noopStage{}, Ctl: ctl, Epoch: 1}).Serve(ctx)
	}()
	link, err := pipeline.DialLink(ctx, ln.Addr())
	if err != nil {
		b.Fatal(err)
	}
	d, err := pipeline.NewDriver([]pipeline.Link{link})
	if err != nil {
		b.Fatal(err)
	}
	const seqs = 32
	st := &pipeline.Step{Epoch: 1, Batch: stage.Batch{Seqs: make([]stage.Seq, seqs)}}
	for i := range st.Batch.Seqs {
		st.Batch.Seqs[i] = stage.Seq{ID: uint64(i + 1), Pos: 100 + i, Tokens: []int32{int32(i)}, Sample: true, Sampling: stage.Sampling{Temperature: 0.7, TopP: 0.9, Seed: uint64(i)}}
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		st.Batch.ID = uint64(i + 1)
		res, err := d.Step(ctx, st)
		if err != nil {
			b.Fatal(err)
		}
		if len(res.Sampled) != seqs {
			b.Fatalf("%d tokens back, want %d", len(res.Sampled), seqs)
		}
	}
	b.StopTimer()
	if err := d.Close(); err != nil {
		b.Fatal(err)
	}
	if err := <-served; err != nil {
		b.Fatal(err)
	}
}
