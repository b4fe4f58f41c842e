package frontend

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"unicode/utf8"

	"github.com/tandem-llm/tandem/daemon/apierr"
	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/tokenizer"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
	"github.com/tandem-llm/tandem/sched"
	"github.com/tandem-llm/tandem/stage"
)

// Limits on a Generate request.
const (
	defaultMaxTokens = 16
	maxStopStrings   = 16
	maxStopBytes     = 256
	maxStopTokens    = 64
	maxLogprobs      = 20
)

// Engine runs requests: the leader's scheduler over its pipeline.
type Engine interface {
	// Submit queues a request and returns the stream of its tokens;
	// cancelling ctx cancels the request. Its refusals are domain errors
	// (package apierr).
	Submit(ctx context.Context, r sched.Request) (*sched.Stream, error)
}

// Engines gives a request the engine that runs it, or a domain error
// saying why none can (this node is not the leader, no pipeline is ready,
// the node is draining).
type Engines interface {
	Engine() (Engine, error)
}

// Server implements tandem.v1.Inference on the leader.
type Server struct {
	tandemv1.UnimplementedInferenceServer
	model   *model.Config
	tok     *tokenizer.Tokenizer
	engines Engines
}

// New returns the frontend of a model: requests are validated against cfg,
// their text encoded and decoded with tok, and run on the engine engines
// gives.
func New(cfg *model.Config, tok *tokenizer.Tokenizer, engines Engines) *Server {
	return &Server{model: cfg, tok: tok, engines: engines}
}

// generation is a validated Generate request.
type generation struct {
	req      sched.Request
	stop     []string
	logprobs bool
}

// validate checks a request against the model and builds what the engine
// runs; every refusal is INVALID_ARGUMENT naming the field.
func (s *Server) validate(in *tandemv1.GenerateRequest) (*generation, error) {
	g := &generation{}
	vocab := s.model.VocabSize
	switch {
	case in.GetPrompt() != "" && len(in.GetPromptTokenIds()) > 0:
		return nil, apierr.Invalidf("prompt and prompt_token_ids are both set; set one")
	case len(in.GetPromptTokenIds()) > 0:
		for i, id := range in.GetPromptTokenIds() {
			if id < 0 || int(id) >= vocab {
				return nil, apierr.Invalidf("prompt_token_ids[%d] = %d is outside the vocabulary [0, %d)", i, id, vocab)
			}
		}
		g.req.Prompt = slices.Clone(in.GetPromptTokenIds())
	case in.GetPrompt() != "":
		g.req.Prompt = s.tok.Encode(in.GetPrompt(), true)
		if len(g.req.Prompt) == 0 {
			return nil, apierr.Invalidf("prompt %q encodes to no tokens", in.GetPrompt())
		}
	default:
		return nil, apierr.Invalidf("empty prompt: set prompt or prompt_token_ids")
	}
	g.req.MaxTokens = int(in.GetMaxTokens())
	if g.req.MaxTokens == 0 {
		g.req.MaxTokens = defaultMaxTokens
	}
	if n, ctxLen := len(g.req.Prompt), s.model.MaxPositions; n+g.req.MaxTokens > ctxLen {
		return nil, apierr.Invalidf("prompt of %d tokens plus max_tokens %d exceeds the context length %d", n, g.req.MaxTokens, ctxLen)
	}
	if len(in.GetStop()) > maxStopStrings {
		return nil, apierr.Invalidf("%d stop strings, at most %d", len(in.GetStop()), maxStopStrings)
	}
	for i, st := range in.GetStop() {
		if st == "" || len(st) > maxStopBytes || !utf8.ValidString(st) {
			return nil, apierr.Invalidf("stop[%d]: want 1 to %d bytes of UTF-8, got %d bytes", i, maxStopBytes, len(st))
		}
	}
	g.stop = in.GetStop()
	if len(in.GetStopTokenIds()) > maxStopTokens {
		return nil, apierr.Invalidf("%d stop token ids, at most %d", len(in.GetStopTokenIds()), maxStopTokens)
	}
	for i, id := range in.GetStopTokenIds() {
		if id < 0 || int(id) >= vocab {
			return nil, apierr.Invalidf("stop_token_ids[%d] = %d is outside the vocabulary [0, %d)", i, id, vocab)
		}
	}
	g.req.StopTokens = slices.Clone(in.GetStopTokenIds())
	if !in.GetIgnoreEos() {
		for _, id := range s.model.EOS {
			g.req.StopTokens = append(g.req.StopTokens, int32(id))
		}
	}
	t, p := float64(in.GetTemperature()), float64(in.GetTopP())
	switch {
	case math.IsNaN(t) || math.IsInf(t, 0) || t < 0:
		return nil, apierr.Invalidf("temperature %v: want a finite number ≥ 0", in.GetTemperature())
	case math.IsNaN(p) || p < 0 || p > 1:
		return nil, apierr.Invalidf("top_p %v: want a number in [0, 1]", in.GetTopP())
	case in.GetTopK() < 0:
		return nil, apierr.Invalidf("top_k %d: want ≥ 0", in.GetTopK())
	case in.GetTopK() > int32(vocab):
		return nil, apierr.Invalidf("top_k %d: larger than the vocabulary of %d", in.GetTopK(), vocab)
	case in.Logprobs != nil && in.GetLogprobs() > maxLogprobs:
		return nil, apierr.Invalidf("logprobs %d: at most %d", in.GetLogprobs(), maxLogprobs)
	}
	g.logprobs = in.Logprobs != nil
	g.req.Sampling = stage.Sampling{
		Temperature: in.GetTemperature(),
		TopP:        in.GetTopP(),
		TopK:        int(in.GetTopK()),
		Seed:        in.GetSeed(),
		Logprobs:    int(in.GetLogprobs()),
	}
	return g, nil
}

// Generate implements tandem.v1.Inference.
func (s *Server) Generate(in *tandemv1.GenerateRequest, stream tandemv1.Inference_GenerateServer) error {
	return apierr.GRPC(s.GenerateTo(stream.Context(), in, stream.Send))
}

// GenerateTo validates a request, runs it, and sends its completion to
// send as it is generated: each message carries every token ready, with
// its text (stop strings applied), and the last one the finish reason
// and usage. Its errors are domain errors (package apierr); an error of
// send ends the request and is returned.
func (s *Server) GenerateTo(ctx context.Context, in *tandemv1.GenerateRequest, send func(*tandemv1.GenerateResponse) error) error {
	g, err := s.validate(in)
	if err != nil {
		return err
	}
	e, err := s.engines.Engine()
	if err != nil {
		return err
	}
	if len(g.stop) > 0 {
		// The scheduler ends the request on the token that completes a stop
		// string, freeing its KV blocks at once; this stream's own decoder
		// cuts the text there.
		check, seen := newTextStream(s.tok, g.stop), 0
		g.req.StopCheck = func(generated []int32) bool {
			for ; seen < len(generated) && !check.stopped; seen++ {
				check.add(generated[seen])
			}
			return check.stopped
		}
	}
	// Leaving cancels ctx, which cancels the request in the scheduler.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := e.Submit(ctx, g.req)
	if err != nil {
		return err
	}
	text := newTextStream(s.tok, g.stop)
	produced := 0
	for {
		outs, err := recvReady(ctx, stream)
		if err != nil {
			switch {
			case ctx.Err() != nil:
				return ctx.Err()
			case apierr.KindOf(err) != 0:
				return err // no pipeline served it in time: the engine says why
			case errors.Is(err, sched.ErrTooLarge):
				return apierr.Exhaustedf("%v", err)
			}
			return apierr.Unavailablef("the request was cut short: %v", err)
		}
		msg := &tandemv1.GenerateResponse{}
		finish := ""
		for _, o := range outs {
			produced++
			msg.TokenIds = append(msg.TokenIds, o.Token.Token)
			if g.logprobs {
				msg.Logprobs = append(msg.Logprobs, logprobsOf(o.Token))
			}
			msg.Text += text.add(o.Token.Token)
			finish = o.Finish
			if text.stopped {
				finish = sched.FinishStop
			}
			if finish != "" {
				break
			}
		}
		if finish != "" {
			if !text.stopped {
				msg.Text += text.flush()
			}
			msg.FinishReason = finishReasons[finish]
			msg.Usage = &tandemv1.Usage{PromptTokens: uint32(len(g.req.Prompt)), CompletionTokens: uint32(produced)}
		}
		if err := send(msg); err != nil {
			return fmt.Errorf("send to client: %w", err)
		}
		if finish != "" {
			return nil
		}
	}
}

// errNoneReady cancels the context of a Recv that must not wait.
var errNoneReady = errors.New("no token ready")

// recvReady waits for the stream's next token and returns it with every
// other token already delivered, so one message carries them all.
func recvReady(ctx context.Context, s *sched.Stream) ([]sched.Output, error) {
	o, err := s.Recv(ctx)
	if err != nil {
		return nil, err
	}
	outs := []sched.Output{o}
	now, cancel := context.WithCancelCause(ctx)
	cancel(errNoneReady)
	for o.Finish == "" {
		if o, err = s.Recv(now); err != nil {
			break // nothing more ready, or the end, which the next call sees
		}
		outs = append(outs, o)
	}
	return outs, nil
}

var finishReasons = map[string]tandemv1.FinishReason{
	sched.FinishStop:   tandemv1.FinishReason_FINISH_REASON_STOP,
	sched.FinishLength: tandemv1.FinishReason_FINISH_REASON_LENGTH,
}

func logprobsOf(t stage.Sampled) *tandemv1.TokenLogprobs {
	lp := &tandemv1.TokenLogprobs{TokenId: t.Token, Logprob: t.Logprob}
	for _, a := range t.Top {
		lp.Top = append(lp.Top, &tandemv1.TopLogprob{TokenId: a.Token, Logprob: a.Logprob})
	}
	return lp
}

// NotLeader is the UNAVAILABLE error of a node that is not the leader,
// naming the leader and its address ("no leader" when there is none yet).
func NotLeader(leader, addr string) error {
	if leader == "" {
		return apierr.Unavailablef("no leader has been chosen yet")
	}
	return apierr.Unavailablef("this node is not the leader; the leader is %s at %s", leader, addr)
}
