package frontend

import (
	"context"
	"fmt"
	"math"
	"slices"

	"github.com/tandem-llm/tandem/daemon/apierr"
	"github.com/tandem-llm/tandem/daemon/textout"
	"github.com/tandem-llm/tandem/model/chat"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
	"github.com/tandem-llm/tandem/sched"
	"github.com/tandem-llm/tandem/stage"
)

// Limits on a Generate request (stop strings: textout.CheckStop;
// logprobs: stage.MaxLogprobs).
const (
	defaultMaxTokens = 16
	maxStopTokens    = 64
)

// generation is a validated Generate request.
type generation struct {
	req      sched.Request
	stop     []string
	logprobs bool
}

// validate checks a request against the model and builds what the engine
// runs, taking the checkpoint's generation defaults for the sampling
// fields it leaves unset; every refusal is INVALID_ARGUMENT naming the
// field.
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
		// Refused before it is encoded when it is longer than any prompt
		// of the context length: encoding megabytes costs the leader
		// memory and time for nothing.
		if n, most := len(in.GetPrompt()), s.tok.MaxTextBytes(s.model.MaxPositions); n > most {
			return nil, apierr.Invalidf("prompt of %d bytes: longer than any prompt of the context length %d tokens can be (%d bytes)", n, s.model.MaxPositions, most)
		}
		g.req.Prompt = chat.PromptTokens(s.tok, in.GetPrompt(), false)
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
	if err := textout.CheckStop(in.GetStop()); err != nil {
		return nil, apierr.Invalidf("%v", err)
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
		g.req.StopTokens = append(g.req.StopTokens, s.eos...)
	}
	sp, err := s.sampling(in)
	if err != nil {
		return nil, err
	}
	g.req.Sampling = sp
	g.logprobs = in.Logprobs != nil
	return g, nil
}

// sampling is the request's sampling: each field it sets, else the
// checkpoint's default, else greedy decoding with no filter.
func (s *Server) sampling(in *tandemv1.GenerateRequest) (stage.Sampling, error) {
	sp := stage.Sampling{Seed: in.GetSeed(), Logprobs: int(in.GetLogprobs())}
	switch {
	case in.Temperature != nil:
		if t := float64(in.GetTemperature()); math.IsNaN(t) || math.IsInf(t, 0) || t < 0 {
			return sp, apierr.Invalidf("temperature %v: want a finite number ≥ 0", in.GetTemperature())
		}
		sp.Temperature = in.GetTemperature()
	case s.gen.Temperature != nil:
		sp.Temperature = float32(*s.gen.Temperature)
	}
	switch {
	case in.TopP != nil:
		if p := float64(in.GetTopP()); math.IsNaN(p) || p < 0 || p > 1 {
			return sp, apierr.Invalidf("top_p %v: want a number in [0, 1]", in.GetTopP())
		}
		sp.TopP = in.GetTopP()
	case s.gen.TopP != nil:
		sp.TopP = float32(*s.gen.TopP)
	}
	switch k := in.GetTopK(); {
	case in.TopK == nil:
		if s.gen.TopK != nil {
			sp.TopK = *s.gen.TopK
		}
	case k < 0:
		return sp, apierr.Invalidf("top_k %d: want ≥ 0", k)
	case k > int32(s.model.VocabSize):
		return sp, apierr.Invalidf("top_k %d: larger than the vocabulary of %d", k, s.model.VocabSize)
	default:
		sp.TopK = int(k)
	}
	if in.Logprobs != nil && in.GetLogprobs() > stage.MaxLogprobs {
		return sp, apierr.Invalidf("logprobs %d: at most %d", in.GetLogprobs(), stage.MaxLogprobs)
	}
	return sp, nil
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
	r, err := s.start(ctx, g.req, textout.Config{Stop: g.stop})
	if err != nil {
		return err
	}
	// Leaving cancels the request in the scheduler, if it is not done.
	defer r.close()
	for {
		evs, err := r.ready(ctx)
		if err != nil {
			return err
		}
		msg := &tandemv1.GenerateResponse{}
		finish := ""
		for _, ev := range evs {
			msg.TokenIds = append(msg.TokenIds, ev.token.Token)
			if g.logprobs {
				msg.Logprobs = append(msg.Logprobs, logprobsOf(ev.token))
			}
			msg.Text += ev.text
			finish = ev.finish
		}
		if finish != "" {
			msg.FinishReason = finishReasons[finish]
			msg.Usage = &tandemv1.Usage{PromptTokens: uint32(len(g.req.Prompt)), CompletionTokens: uint32(r.tokens())}
		}
		if err := send(msg); err != nil {
			return fmt.Errorf("send to client: %w", err)
		}
		if finish != "" {
			return nil
		}
	}
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
