package cuda

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/collective/nccl"
	"github.com/tandem-llm/tandem/gpu"
	"github.com/tandem-llm/tandem/pipeline"
	"github.com/tandem-llm/tandem/sched"
	"github.com/tandem-llm/tandem/stage"
)

// TestLinkedPipeline runs a model split into two CUDA stages under the
// scheduler, with on-device hand-off (three steps in flight) and without,
// over stream-ordered links between the stages' streams: on one GPU a
// device link (devicePipe), on two NCCL as daemon/stagehost wires it (the
// subtest skips with one GPU). Every worker keeps steps launched ahead
// (stage.LinkedLauncher), ordering the receives before and the sends after
// each launch. Every request's greedy tokens must be those of the whole
// model in one stage, which a split computes exactly.
func TestLinkedPipeline(t *testing.T) {
	dev := device(t)
	sh, w := fourLayers(t, 23)
	m := sh.Model
	const seqs, slots = 4, 8
	cfg := func(lo, hi int) Config {
		return Config{Model: &m, Lo: lo, Hi: hi, Weights: w, MaxTokens: 64, MaxSeqs: slots, MaxSeqLen: 256}
	}
	rng := rand.New(rand.NewPCG(23, 5))
	var reqs []sched.Request
	for range 10 {
		r := sched.Request{Prompt: make([]int32, 1+rng.IntN(40)), MaxTokens: 1 + rng.IntN(24)}
		for j := range r.Prompt {
			r.Prompt[j] = rng.Int32N(int32(m.VocabSize))
		}
		reqs = append(reqs, r)
	}
	run := func(t *testing.T, stages []stage.Stage, opts pipeline.LocalOptions) [][]int32 {
		d, err := opts.Start(context.Background(), stages)
		if err != nil {
			t.Fatal(err)
		}
		defer d.Close()
		p := len(stages)
		sc := sched.Config{MaxNumBatchedTokens: 64, MaxNumSeqs: seqs, NumBlocks: slots * 256 / stage.DefaultBlockSize, MaxConcurrentBatches: max(2, p)}
		if opts.Handoff {
			sc.OnDeviceHandoff, sc.HandoffSlots = true, slots
			if p > 1 {
				sc.MaxConcurrentBatches = p + 1
			}
		}
		l, err := sched.Start(sc, d)
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		out := make([][]int32, len(reqs))
		var wg sync.WaitGroup
		for i, r := range reqs {
			s, err := l.Submit(ctx, r)
			if err != nil {
				t.Fatal(err)
			}
			wg.Go(func() {
				for {
					o, err := s.Recv(ctx)
					if err == io.EOF {
						return
					}
					if err != nil {
						t.Errorf("request %d: %v", i, err)
						return
					}
					out[i] = append(out[i], o.Token.Token)
				}
			})
		}
		wg.Wait()
		return out
	}
	whole := newTestStage(t, cfg(0, 4))
	first := &countedStage{Stage: newTestStage(t, cfg(0, 2))}
	// check runs the requests on whole and on first and second linked by
	// links, hand-off on and off.
	check := func(t *testing.T, second *countedStage, links func(from, to, depth int) (collective.Sender, collective.Receiver)) {
		for _, handoff := range []bool{true, false} {
			t.Run(fmt.Sprintf("handoff=%v", handoff), func(t *testing.T) {
				for _, st := range []*Stage{whole, first.Stage, second.Stage} {
					if err := st.Reset(); err != nil {
						t.Fatal(err)
					}
				}
				want := run(t, []stage.Stage{whole}, pipeline.LocalOptions{Handoff: handoff})
				first.launches.Store(0)
				second.launches.Store(0)
				got := run(t, []stage.Stage{first, second}, pipeline.LocalOptions{Handoff: handoff, Link: links})
				for i := range reqs {
					if !slices.Equal(got[i], want[i]) {
						t.Errorf("request %d: two linked stages %v, one stage %v", i, got[i], want[i])
					}
				}
				if first.launches.Load() == 0 || second.launches.Load() == 0 {
					t.Errorf("launches: %d and %d, want both stages launched ahead", first.launches.Load(), second.launches.Load())
				}
				t.Logf("%d requests, %d and %d steps launched", len(reqs), first.launches.Load(), second.launches.Load())
			})
		}
	}
	t.Run("one GPU", func(t *testing.T) {
		second := &countedStage{Stage: newTestStage(t, cfg(2, 4))}
		check(t, second, func(from, to, depth int) (collective.Sender, collective.Receiver) {
			streams := []gpu.Stream{first.Stream(), second.Stream()}
			return newDevicePipe(t, dev, streams[from], streams[to], depth)
		})
	})
	t.Run("two GPUs, NCCL", func(t *testing.T) {
		if n, err := gpu.DeviceCount(); err != nil || n < 2 {
			t.Skipf("two GPUs needed, %d present (%v)", n, err)
		}
		dev1, err := gpu.Open(1)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { dev1.Close() })
		c := cfg(2, 4)
		c.Device = dev1
		second := &countedStage{Stage: newTestStage(t, c)}
		stages := []*Stage{first.Stage, second.Stage}
		check(t, second, func(from, to, depth int) (collective.Sender, collective.Receiver) {
			return orderedNCCL(t, stages[from], stages[to])
		})
	})
}

// orderedNCCL is an NCCL link from stage a to stage b (on two devices),
// connected with one transfer waited for on streams of its own, then
// ordered on the stages' streams as daemon/stagehost wires it; the test's
// end aborts its communicator.
func orderedNCCL(t *testing.T, a, b *Stage) (collective.Sender, collective.Receiver) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	id, err := nccl.NewUniqueID()
	if err != nil {
		t.Fatal(err)
	}
	ends := []*Stage{a, b}
	comms := make([]*gpu.NCCLComm, 2)
	errs := make(chan error, 2)
	for rank, st := range ends {
		go func() {
			var err error
			if comms[rank], err = nccl.Connect(ctx, st.Device(), 2, id, rank); err != nil {
				errs <- err
				return
			}
			// The warm-up: one message, waited for, on a stream of its own.
			var s gpu.Stream
			var m gpu.Mem
			if err := st.Device().Do(func() (err error) {
				if s, err = gpu.NewStream(); err != nil {
					return err
				}
				m, err = gpu.Alloc(4)
				return err
			}); err != nil {
				errs <- err
				return
			}
			defer st.Device().Do(func() error { m.Free(); return s.Destroy() })
			h := collective.Header{Rows: 1, Cols: 1, DType: collective.I32}
			cfg := nccl.Config{Device: st.Device(), Comm: comms[rank], Peer: 1 - rank, Stream: s}
			if rank == 0 {
				snd, err := nccl.NewSender(cfg)
				if err == nil {
					err = errors.Join(snd.Send(ctx, h, m), snd.Close())
				}
				errs <- err
				return
			}
			rcv, err := nccl.NewReceiver(cfg)
			if err == nil {
				err = errors.Join(rcv.Recv(ctx, h, m), rcv.Close())
			}
			errs <- err
		}()
	}
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, c := range comms {
			c.Abort()
		}
	})
	snd, err := nccl.NewSender(nccl.Config{Device: a.Device(), Comm: comms[0], Peer: 1, Stream: a.Stream(), Ordered: true})
	if err != nil {
		t.Fatal(err)
	}
	rcv, err := nccl.NewReceiver(nccl.Config{Device: b.Device(), Comm: comms[1], Peer: 0, Stream: b.Stream(), Ordered: true})
	if err != nil {
		t.Fatal(err)
	}
	return snd, rcv
}

// countedStage counts a stage's launches.
type countedStage struct {
	*Stage
	launches atomic.Int64
}

func (c *countedStage) Launch(ctx context.Context, b *stage.Batch) (<-chan struct{}, error) {
	c.launches.Add(1)
	return c.Stage.Launch(ctx, b)
}

// devicePipe is a stream-ordered link between two streams of one device,
// standing in for NCCL between GPUs: Send orders on the sender's stream a
// copy of the message into a slot of a ring of device buffers and an event
// after it; Recv makes the receiver's stream wait for that event, orders
// the copy out of the slot and an event after it, which the sender's
// stream waits for before it writes the slot again. Neither waits on the
// host but for a free slot (Send) or a message sent (Recv).
type devicePipe struct {
	dev              *gpu.Device
	sender, receiver gpu.Stream
	slots            []gpu.Mem
	sent, copied     []gpu.Event
	msgs             chan pipeMsg // sent, not received
	free             chan int     // slots whose message was received
	maxBytes         int
}

type pipeMsg struct {
	h    collective.Header
	slot int
}

func newDevicePipe(t *testing.T, dev *gpu.Device, sender, receiver gpu.Stream, depth int) (devicePipeSender, devicePipeReceiver) {
	t.Helper()
	p := &devicePipe{dev: dev, sender: sender, receiver: receiver, msgs: make(chan pipeMsg, depth), free: make(chan int, depth), maxBytes: 1 << 20}
	err := dev.Do(func() error {
		for k := range depth {
			m, err := gpu.Alloc(p.maxBytes)
			if err != nil {
				return err
			}
			p.slots = append(p.slots, m)
			for _, evs := range []*[]gpu.Event{&p.sent, &p.copied} {
				e, err := gpu.NewEvent()
				if err != nil {
					return err
				}
				*evs = append(*evs, e)
			}
			p.free <- k
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		dev.Do(func() error {
			for k := range p.slots {
				p.slots[k].Free()
				p.sent[k].Destroy()
				p.copied[k].Destroy()
			}
			return nil
		})
	})
	return devicePipeSender{p}, devicePipeReceiver{p}
}

type (
	devicePipeSender   struct{ p *devicePipe }
	devicePipeReceiver struct{ p *devicePipe }
)

func (devicePipeSender) StreamOrdered() bool   { return true }
func (devicePipeReceiver) StreamOrdered() bool { return true }
func (devicePipeSender) Close() error          { return nil }
func (devicePipeReceiver) Close() error        { return nil }

func (s devicePipeSender) Send(ctx context.Context, h collective.Header, b collective.Buffer) error {
	p := s.p
	if h.Bytes() > p.maxBytes {
		return fmt.Errorf("device pipe: %v larger than its %d-byte slots", h, p.maxBytes)
	}
	var k int
	select {
	case k = <-p.free:
	case <-ctx.Done():
		return ctx.Err()
	}
	err := p.dev.Do(func() error {
		if err := p.sender.WaitEvent(p.copied[k]); err != nil {
			return err
		}
		if err := gpu.CopyDtoDAsync(p.slots[k].Ptr(), b.(gpu.Mem).Ptr(), h.Bytes(), p.sender); err != nil {
			return err
		}
		return p.sent[k].Record(p.sender)
	})
	if err != nil {
		return err
	}
	p.msgs <- pipeMsg{h, k}
	return nil
}

func (r devicePipeReceiver) Recv(ctx context.Context, h collective.Header, b collective.Buffer) error {
	p := r.p
	var m pipeMsg
	select {
	case m = <-p.msgs:
	case <-ctx.Done():
		return ctx.Err()
	}
	if m.h != h {
		return fmt.Errorf("device pipe: got %v, want %v", m.h, h)
	}
	err := p.dev.Do(func() error {
		if err := p.receiver.WaitEvent(p.sent[m.slot]); err != nil {
			return err
		}
		if err := gpu.CopyDtoDAsync(b.(gpu.Mem).Ptr(), p.slots[m.slot].Ptr(), h.Bytes(), p.receiver); err != nil {
			return err
		}
		return p.copied[m.slot].Record(p.receiver)
	})
	if err != nil {
		return err
	}
	p.free <- m.slot
	return nil
}
