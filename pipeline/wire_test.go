package pipeline

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"math"
	"net"
	"reflect"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/linkauth"
	"github.com/tandem-llm/tandem/pipeline/controlpb"
	"github.com/tandem-llm/tandem/stage"
)

func testStep() *Step {
	return &Step{Epoch: 9, Free: []uint64{4, 5}, AwaitHandoff: 3, Report: true, Batch: stage.Batch{
		ID: 77, Handoff: true,
		Graph: graphs.Step{Mode: graphs.Full, Desc: graphs.BatchDescriptor{NumTokens: 8, NumReqs: 8, UniformDecode: true, QueryLen: 1}},
		Seqs: []stage.Seq{
			{ID: 1, Pos: 12, Tokens: []int32{3, 1, 4}, Blocks: []int32{0, 7}, Sample: true, Index: 2, Slot: 5,
				Sampling: stage.Sampling{Temperature: 0.8, TopK: 40, TopP: 0.9, Seed: 1 << 60, Logprobs: 3}},
			{ID: 2, Tokens: []int32{stage.Placeholder}, Blocks: []int32{9}, Logits: true, Sampling: stage.Sampling{TopK: -1}},
		},
	}}
}

func testResult() *Result {
	return &Result{Batch: 77, Stage: 2, Err: "", Sampled: []stage.Sampled{
		{Seq: 1, Token: 42, Logprob: -0.25, Top: []stage.TokenLogprob{{Token: 42, Logprob: -0.25}, {Token: 7, Logprob: -2}}},
		{Seq: 2, Err: "cpu stage [2,4): sequence 2: non-finite logits"},
	}, Logits: []stage.SeqLogits{{Seq: 2, Rows: [][]float32{{1, float32(math.Inf(-1)), 3}}}},
		Timing: &StageTiming{Waited: 1, Got: 2, HandoffStart: 3, HandoffEnd: 4, RecvStart: 5, RecvEnd: 6, ForwardStart: 7, ForwardEnd: 8,
			SendStart: 9, SendEnd: 10, Device: 11, Busy: 12, DeviceBusy: 13}}
}

// TestWireRoundTrip: a Step and a Result come back from their encoding
// exactly as they were.
func TestWireRoundTrip(t *testing.T) {
	b, err := proto.Marshal(stepMsg(testStep()))
	if err != nil {
		t.Fatal(err)
	}
	s, err := decodeStep(b)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(s, testStep()) {
		t.Errorf("step round trip:\n got %+v\nwant %+v", s, testStep())
	}
	b, err = proto.Marshal(resultMsg(testResult()))
	if err != nil {
		t.Fatal(err)
	}
	r, err := decodeResult(b)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(r, testResult()) {
		t.Errorf("result round trip:\n got %+v\nwant %+v", r, testResult())
	}
}

// TestFrameBound: a message announced longer than the bound is refused
// before anything is allocated for it; a truncated one is an error.
func TestFrameBound(t *testing.T) {
	var hdr [4]byte
	binary.BigEndian.PutUint32(hdr[:], MaxStepBytes+1)
	if _, err := readFrame(bytes.NewReader(hdr[:]), MaxStepBytes, nil); err == nil || !strings.Contains(err.Error(), "more than the") {
		t.Errorf("oversized message: %v", err)
	}
	binary.BigEndian.PutUint32(hdr[:], 1<<30)
	if _, err := readFrame(bytes.NewReader(append(hdr[:], 1, 2, 3)), MaxResultBytes, nil); err == nil || !strings.Contains(err.Error(), "got 3 of") {
		t.Errorf("truncated message: %v", err)
	}
	if _, err := readFrame(bytes.NewReader(nil), MaxStepBytes, nil); err != io.EOF {
		t.Errorf("clean end: %v, want io.EOF", err)
	}
}

// FuzzDecodeStep feeds the stage's decoder arbitrary frames: it must never
// panic, and what it accepts must encode and decode to itself.
func FuzzDecodeStep(f *testing.F) {
	good, _ := proto.Marshal(stepMsg(testStep()))
	f.Add(good)
	f.Add([]byte{})
	f.Add([]byte{0x12, 0x02, 0x12, 0xff})
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := decodeStep(b)
		if err != nil {
			return
		}
		again, err := proto.Marshal(stepMsg(s))
		if err != nil {
			t.Fatal(err)
		}
		s2, err := decodeStep(again)
		if err != nil || !reflect.DeepEqual(s, s2) {
			t.Fatalf("re-encoded step differs: %+v / %+v (%v)", s, s2, err)
		}
	})
}

// FuzzReadControl feeds the leader's and the stage's readers arbitrary
// streams: frames with any length prefix, handshake messages, results.
// They must never panic nor allocate past their bounds.
func FuzzReadControl(f *testing.F) {
	var buf bytes.Buffer
	w := bufio.NewWriter(&buf)
	writeMsg(w, resultMsg(testResult()))
	f.Add(buf.Bytes())
	buf.Reset()
	writeHello(w, "control->stage1", 3, make([]byte, linkauth.NonceSize))
	f.Add(buf.Bytes())
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, 1})
	f.Fuzz(func(t *testing.T, b []byte) {
		r := bytes.NewReader(b)
		for {
			fr, err := readFrame(r, 1<<16, nil)
			if err != nil {
				break
			}
			decodeResult(fr)
			decodeStep(fr)
		}
		readHello(bytes.NewReader(b))
		readChallenge(bytes.NewReader(b))
		readProof(bytes.NewReader(b))
		readAccept(bytes.NewReader(b))
	})
}

func cred(t *testing.T, secret string) *linkauth.Credential {
	t.Helper()
	c, err := linkauth.NewCredential([]byte(secret))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestControlHandshake dials a stage's control listener with matching and
// mismatching leaders: only a leader of the same protocol version, link,
// epoch and cluster credential gets the link; every other is refused with
// an error naming what differs, on both ends, and the stage's Accept goes
// on to take the right leader after them.
func TestControlHandshake(t *testing.T) {
	secret := "0123456789abcdef0123456789abcdef"
	stageCfg := ControlConfig{Link: "control->stage1", Epoch: 5, Credential: cred(t, secret), HandshakeTimeout: 5 * time.Second, Logger: slog.New(slog.DiscardHandler)}
	ln, err := stageCfg.Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	accepted := make(chan *NetControl, 1)
	go func() {
		nc, err := ln.Accept(ctx)
		if err != nil {
			t.Error(err)
		}
		accepted <- nc
	}()
	good := stageCfg
	for _, c := range []struct {
		name string
		cfg  func(*ControlConfig)
		want string
	}{
		{"another link", func(c *ControlConfig) { c.Link = "activations->layer3" }, `the stage refused the control link: the leader asks for control link "activations->layer3", this stage serves "control->stage1"`},
		{"another epoch", func(c *ControlConfig) { c.Epoch = math.MaxUint64 }, "the leader is of epoch 18446744073709551615, this stage was assigned in epoch 5"},
		{"no credential", func(c *ControlConfig) { c.Credential = nil }, "stage authentication: " + linkauth.ErrUnexpectedProof.Error()},
		{"another secret", func(c *ControlConfig) { c.Credential = cred(t, "fedcba9876543210fedcba9876543210") }, "stage authentication: " + linkauth.ErrBadProof.Error()},
	} {
		cfg := good
		c.cfg(&cfg)
		if _, err := cfg.Dial(ctx, ln.Addr()); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error containing %q", c.name, err, c.want)
		}
	}
	// A forged leader that sends garbage, and one of another protocol
	// version, do not keep the real one out.
	garbage, err := net.Dial("tcp", ln.Addr())
	if err != nil {
		t.Fatal(err)
	}
	garbage.Write([]byte("GET / HTTP/1.1\r\n\r\n"))
	if got := futureLeader(t, ln.Addr()); !strings.Contains(got, "the leader speaks control protocol version 2, this stage version 1") {
		t.Errorf("a leader of version 2 was told %q", got)
	}
	link, err := good.Dial(ctx, ln.Addr())
	if err != nil {
		t.Fatalf("the right leader: %v", err)
	}
	defer link.Close()
	nc := <-accepted
	if nc == nil {
		t.FailNow()
	}
	defer nc.Close()
	if err := link.Send(ctx, testStep()); err != nil {
		t.Fatal(err)
	}
	s, err := nc.Next(ctx)
	if err != nil || !reflect.DeepEqual(s, testStep()) {
		t.Errorf("step over the link: %+v, %v", s, err)
	}
	if err := nc.Report(ctx, testResult()); err != nil {
		t.Fatal(err)
	}
	if r := <-link.Results(); !reflect.DeepEqual(r, testResult()) {
		t.Errorf("result over the link: %+v", r)
	}
}

// futureLeader opens a control connection speaking protocol version 2 and
// returns the stage's refusal.
func futureLeader(t *testing.T, addr string) string {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	w := bufio.NewWriter(c)
	w.Write(controlMagic[:])
	if err := writeMsg(w, &controlpb.Hello{Version: 2, Link: "control->stage1", Epoch: 5, Nonce: linkauth.NewNonce()}); err != nil {
		t.Fatal(err)
	}
	ch, err := readChallenge(c)
	if err != nil {
		t.Fatal(err)
	}
	return ch.refused
}

// TestControlVersionFromStage: a stage answering with another protocol
// version is refused by the leader, naming both versions.
func TestControlVersionFromStage(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		if _, err := readHello(c); err != nil {
			return
		}
		w := bufio.NewWriter(c)
		writeMsg(w, &controlpb.Challenge{Version: 3, Nonce: linkauth.NewNonce()})
		io.Copy(io.Discard, c)
	}()
	_, err = DialLink(context.Background(), ln.Addr().String())
	if err == nil || !strings.Contains(err.Error(), "the stage speaks control protocol version 3, this leader version 1") {
		t.Errorf("a stage of version 3: %v", err)
	}
}

// TestControlHandshakeTimeout: a connection that sends nothing is dropped
// after the handshake timeout, and Accept takes the next.
func TestControlHandshakeTimeout(t *testing.T) {
	ln, err := ControlConfig{HandshakeTimeout: 200 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)}.Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	silent, err := net.Dial("tcp", ln.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	done := acceptAndClose(ctx, ln)
	link, err := DialLink(ctx, ln.Addr())
	if err != nil {
		t.Fatal(err)
	}
	link.Close()
	if err := <-done; err != nil && !errors.Is(err, io.EOF) {
		t.Errorf("accept after a silent connection: %v", err)
	}
}

// TestControlSilentConnectionsDoNotHoldTheLeader: connections that say
// nothing, more than a stage serves at once and made before the leader's,
// do not keep the leader out: its link is up while theirs still wait out a
// minute's handshake timeout (served one at a time, the leader's waited
// for each in turn and failed its own 10 s timeout). Whoever reaches a
// stage's control port could otherwise keep a pipeline from forming.
func TestControlSilentConnectionsDoNotHoldTheLeader(t *testing.T) {
	ln, err := ControlConfig{HandshakeTimeout: time.Minute, Logger: slog.New(slog.DiscardHandler)}.Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var silent []net.Conn
	for range 20 {
		c, err := net.Dial("tcp", ln.Addr())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		silent = append(silent, c)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	done := acceptAndClose(ctx, ln)
	dctx, dcancel := context.WithTimeout(ctx, 10*time.Second)
	defer dcancel()
	link, err := DialLink(dctx, ln.Addr())
	if err != nil {
		t.Fatalf("the leader behind 20 silent connections: %v", err)
	}
	link.Close()
	if err := <-done; err != nil {
		t.Errorf("accept: %v", err)
	}
	for i, c := range silent {
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.ReadAll(c); err != nil {
			t.Errorf("silent connection %d not closed once the leader was accepted: %v", i, err)
		}
	}
}

// acceptAndClose runs ln.Accept in the background, closes the link it
// gets, and sends Accept's error.
func acceptAndClose(ctx context.Context, ln *ControlListener) <-chan error {
	done := make(chan error, 1)
	go func() {
		nc, err := ln.Accept(ctx)
		if err == nil {
			nc.Close()
		}
		done <- err
	}()
	return done
}
