package pipeline

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/pipeline/controlpb"
	"github.com/tandem-llm/tandem/stage"
)

// ControlVersion is the version of the control protocol. Both ends of a
// control link must speak the same one; the handshake refuses another,
// naming both.
const ControlVersion = 1

// Bounds of the control protocol's messages, in encoded bytes: a longer
// one is refused before it is read. A step carries a batch's token ids and
// block tables; a result may carry logits rows (tests and verification).
const (
	MaxStepBytes   = 64 << 20
	MaxResultBytes = 1 << 30
	// maxHandshakeBytes bounds each handshake message.
	maxHandshakeBytes = 4 << 10
	// maxLinkName bounds a control link's name.
	maxLinkName = 256
)

// controlMagic opens a control connection (leader → stage), so that a
// stage can tell a peer that is not a tandem leader at once.
var controlMagic = [4]byte{'T', 'N', 'D', 'C'}

// readChunk is how much readFrame reads at a time past what buf holds, so
// a peer announcing a large message must send it before it is allocated.
const readChunk = 1 << 20

// readFrame reads one length-prefixed message of at most limit bytes into
// buf's storage (grown as needed) and returns it.
func readFrame(r io.Reader, limit int, buf []byte) ([]byte, error) {
	var hdr [4]byte
	if n, err := io.ReadFull(r, hdr[:]); err != nil {
		if n == 0 && errors.Is(err, io.EOF) {
			return nil, io.EOF
		}
		return nil, fmt.Errorf("read message length: %w", err)
	}
	n := int(binary.BigEndian.Uint32(hdr[:]))
	if n > limit {
		return nil, fmt.Errorf("message of %d bytes, more than the %d allowed", n, limit)
	}
	b := buf[:0]
	for len(b) < n {
		k := n - len(b)
		if cap(b) < n {
			k = min(k, readChunk) // grow only as the bytes arrive
		}
		b = slices.Grow(b, k)[:len(b)+k]
		if m, err := io.ReadFull(r, b[len(b)-k:]); err != nil {
			return nil, fmt.Errorf("read message: got %d of %d bytes: %w", len(b)-k+m, n, err)
		}
	}
	return b, nil
}

// writeMsg writes m length-prefixed and flushes w.
func writeMsg(w *bufio.Writer, m proto.Message) error {
	b, err := proto.Marshal(m)
	if err != nil {
		return err
	}
	var hdr [4]byte
	binary.BigEndian.PutUint32(hdr[:], uint32(len(b)))
	w.Write(hdr[:])
	w.Write(b)
	return w.Flush()
}

// readMsg reads one length-prefixed message of at most max bytes into m.
func readMsg(r io.Reader, limit int, m proto.Message, what string) error {
	b, err := readFrame(r, limit, nil)
	if err == nil {
		err = proto.Unmarshal(b, m)
	}
	if err != nil {
		return fmt.Errorf("read %s: %w", what, err)
	}
	return nil
}

// hello is a decoded Hello.
type hello struct {
	version uint32
	link    string
	epoch   uint64
	nonce   []byte
}

func writeHello(w *bufio.Writer, link string, epoch uint64, nonce []byte) error {
	w.Write(controlMagic[:])
	return writeMsg(w, &controlpb.Hello{Version: ControlVersion, Link: link, Epoch: epoch, Nonce: nonce})
}

// readHello reads the magic and the leader's Hello.
func readHello(r io.Reader) (hello, error) {
	var magic [4]byte
	if _, err := io.ReadFull(r, magic[:]); err != nil {
		return hello{}, fmt.Errorf("read control hello: %w", err)
	}
	if magic != controlMagic {
		return hello{}, fmt.Errorf("control hello starts with %q, not %q: not a tandem leader", magic[:], controlMagic[:])
	}
	var m controlpb.Hello
	if err := readMsg(r, maxHandshakeBytes, &m, "control hello"); err != nil {
		return hello{}, err
	}
	return hello{version: m.GetVersion(), link: m.GetLink(), epoch: m.GetEpoch(), nonce: m.GetNonce()}, nil
}

// challenge is a decoded Challenge.
type challenge struct {
	version      uint32
	nonce, proof []byte
	refused      string
}

func challengeMsg(nonce, proof []byte, refused string) *controlpb.Challenge {
	return &controlpb.Challenge{Version: ControlVersion, Nonce: nonce, Proof: proof, Refused: refused}
}

func readChallenge(r io.Reader) (challenge, error) {
	var m controlpb.Challenge
	if err := readMsg(r, maxHandshakeBytes, &m, "control challenge"); err != nil {
		return challenge{}, err
	}
	return challenge{version: m.GetVersion(), nonce: m.GetNonce(), proof: m.GetProof(), refused: m.GetRefused()}, nil
}

func proofMsg(proof []byte, refused string) *controlpb.Proof {
	return &controlpb.Proof{Proof: proof, Refused: refused}
}

// readProof reads the leader's Proof; a leader that gives up is an error.
func readProof(r io.Reader) ([]byte, error) {
	var m controlpb.Proof
	if err := readMsg(r, maxHandshakeBytes, &m, "control proof"); err != nil {
		return nil, err
	}
	if m.GetRefused() != "" {
		return nil, fmt.Errorf("the leader gave up the control link: %s", m.GetRefused())
	}
	return m.GetProof(), nil
}

func acceptMsg(refused string) *controlpb.Accept { return &controlpb.Accept{Refused: refused} }

func readAccept(r io.Reader) (string, error) {
	var m controlpb.Accept
	if err := readMsg(r, maxHandshakeBytes, &m, "control accept"); err != nil {
		return "", err
	}
	return m.GetRefused(), nil
}

// stepMsg encodes a Step.
func stepMsg(s *Step) *controlpb.Step {
	b := &s.Batch
	g := b.Graph
	m := &controlpb.Step{
		Epoch:        s.Epoch,
		Free:         s.Free,
		AwaitHandoff: int64(s.AwaitHandoff),
		Report:       s.Report,
		Batch: &controlpb.Batch{
			Id:      b.ID,
			Handoff: b.Handoff,
			Graph: &controlpb.GraphStep{Mode: uint32(g.Mode), NumTokens: int64(g.Desc.NumTokens), NumReqs: int64(g.Desc.NumReqs),
				UniformDecode: g.Desc.UniformDecode, QueryLen: int64(g.Desc.QueryLen)},
			Seqs: make([]*controlpb.Seq, len(b.Seqs)),
		},
	}
	for i := range b.Seqs {
		q := &b.Seqs[i]
		sp := &q.Sampling
		m.Batch.Seqs[i] = &controlpb.Seq{
			Id: q.ID, Pos: int64(q.Pos), Tokens: q.Tokens, Blocks: q.Blocks, Sample: q.Sample,
			Sampling: &controlpb.Sampling{Temperature: sp.Temperature, TopK: int64(sp.TopK), TopP: sp.TopP, Seed: sp.Seed, Logprobs: int64(sp.Logprobs)},
			Index:    int64(q.Index), Logits: q.Logits, Slot: int64(q.Slot),
		}
	}
	return m
}

// decodeStep decodes a Step. What a stage checks anyway (positions, token
// ids, block ids, sampling parameters) is left to it; the decoder refuses
// what cannot be represented.
func decodeStep(b []byte) (*Step, error) {
	var m controlpb.Step
	if err := proto.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("decode step: %w", err)
	}
	mb, g := m.GetBatch(), m.GetBatch().GetGraph()
	if g.GetMode() > 255 {
		return nil, fmt.Errorf("decode step: graph mode %d", g.GetMode())
	}
	s := &Step{
		Epoch:        m.GetEpoch(),
		Free:         m.GetFree(),
		AwaitHandoff: int(m.GetAwaitHandoff()),
		Report:       m.GetReport(),
		Batch: stage.Batch{
			ID:      mb.GetId(),
			Handoff: mb.GetHandoff(),
			Graph: graphs.Step{Mode: graphs.Mode(g.GetMode()), Desc: graphs.BatchDescriptor{NumTokens: int(g.GetNumTokens()),
				NumReqs: int(g.GetNumReqs()), UniformDecode: g.GetUniformDecode(), QueryLen: int(g.GetQueryLen())}},
		},
	}
	if n := len(mb.GetSeqs()); n > 0 {
		s.Batch.Seqs = make([]stage.Seq, n)
	}
	for i, q := range mb.GetSeqs() {
		sp := q.GetSampling()
		if t, p := float64(sp.GetTemperature()), float64(sp.GetTopP()); math.IsNaN(t) || math.IsInf(t, 0) || math.IsNaN(p) || math.IsInf(p, 0) {
			return nil, fmt.Errorf("decode step: seq %d: sampling temperature %v, top-p %v: want finite numbers", q.GetId(), sp.GetTemperature(), sp.GetTopP())
		}
		s.Batch.Seqs[i] = stage.Seq{
			ID: q.GetId(), Pos: int(q.GetPos()), Tokens: q.GetTokens(), Blocks: q.GetBlocks(), Sample: q.GetSample(),
			Sampling: stage.Sampling{Temperature: sp.GetTemperature(), TopK: int(sp.GetTopK()), TopP: sp.GetTopP(), Seed: sp.GetSeed(), Logprobs: int(sp.GetLogprobs())},
			Index:    int(q.GetIndex()), Logits: q.GetLogits(), Slot: int(q.GetSlot()),
		}
	}
	return s, nil
}

// resultMsg encodes a Result.
func resultMsg(r *Result) *controlpb.Result {
	m := &controlpb.Result{Batch: r.Batch, Stage: int64(r.Stage), Err: r.Err}
	if t := r.Timing; t != nil {
		m.Timing = &controlpb.StageTiming{
			Waited: int64(t.Waited), Got: int64(t.Got), HandoffStart: int64(t.HandoffStart), HandoffEnd: int64(t.HandoffEnd),
			RecvStart: int64(t.RecvStart), RecvEnd: int64(t.RecvEnd), ForwardStart: int64(t.ForwardStart), ForwardEnd: int64(t.ForwardEnd),
			SendStart: int64(t.SendStart), SendEnd: int64(t.SendEnd), Device: int64(t.Device), Busy: int64(t.Busy), DeviceBusy: int64(t.DeviceBusy),
		}
	}
	if len(r.Sampled) > 0 {
		m.Sampled = make([]*controlpb.Sampled, len(r.Sampled))
	}
	for i, s := range r.Sampled {
		ms := &controlpb.Sampled{Seq: s.Seq, Token: s.Token, Logprob: s.Logprob, Err: s.Err}
		for _, t := range s.Top {
			ms.Top = append(ms.Top, &controlpb.TokenLogprob{Token: t.Token, Logprob: t.Logprob})
		}
		m.Sampled[i] = ms
	}
	for _, l := range r.Logits {
		ml := &controlpb.SeqLogits{Seq: l.Seq, Rows: make([]*controlpb.LogitsRow, len(l.Rows))}
		for j, row := range l.Rows {
			ml.Rows[j] = &controlpb.LogitsRow{Values: row}
		}
		m.Logits = append(m.Logits, ml)
	}
	return m
}

// decodeResult decodes a Result.
func decodeResult(b []byte) (*Result, error) {
	var m controlpb.Result
	if err := proto.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("decode: %w", err)
	}
	if m.GetStage() < 0 || m.GetStage() > 1<<20 {
		return nil, fmt.Errorf("decode: stage index %d", m.GetStage())
	}
	r := &Result{Batch: m.GetBatch(), Stage: int(m.GetStage()), Err: m.GetErr()}
	if t := m.GetTiming(); t != nil {
		r.Timing = &StageTiming{
			Waited: time.Duration(t.GetWaited()), Got: time.Duration(t.GetGot()),
			HandoffStart: time.Duration(t.GetHandoffStart()), HandoffEnd: time.Duration(t.GetHandoffEnd()),
			RecvStart: time.Duration(t.GetRecvStart()), RecvEnd: time.Duration(t.GetRecvEnd()),
			ForwardStart: time.Duration(t.GetForwardStart()), ForwardEnd: time.Duration(t.GetForwardEnd()),
			SendStart: time.Duration(t.GetSendStart()), SendEnd: time.Duration(t.GetSendEnd()),
			Device: time.Duration(t.GetDevice()), Busy: time.Duration(t.GetBusy()), DeviceBusy: time.Duration(t.GetDeviceBusy()),
		}
	}
	if n := len(m.GetSampled()); n > 0 {
		r.Sampled = make([]stage.Sampled, n)
	}
	for i, s := range m.GetSampled() {
		smp := stage.Sampled{Seq: s.GetSeq(), Token: s.GetToken(), Logprob: s.GetLogprob(), Err: s.GetErr()}
		for _, t := range s.GetTop() {
			smp.Top = append(smp.Top, stage.TokenLogprob{Token: t.GetToken(), Logprob: t.GetLogprob()})
		}
		r.Sampled[i] = smp
	}
	for _, l := range m.GetLogits() {
		sl := stage.SeqLogits{Seq: l.GetSeq(), Rows: make([][]float32, len(l.GetRows()))}
		for j, row := range l.GetRows() {
			sl.Rows[j] = row.GetValues()
		}
		r.Logits = append(r.Logits, sl)
	}
	return r, nil
}
