package frontend

import (
	"context"
	"time"

	"github.com/tandem-llm/tandem/daemon/apierr"
	"github.com/tandem-llm/tandem/daemon/openai"
	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/chat"
	"github.com/tandem-llm/tandem/model/tokenizer"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
	"github.com/tandem-llm/tandem/sched"
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
	// Ready is nil while a pipeline serves requests here (the node's
	// health is SERVING), else a domain error saying why not. The engine
	// may still take requests while it is not ready: they wait for a
	// pipeline being rebuilt.
	Ready() error
}

// Config is what a Server serves and runs requests on.
type Config struct {
	// Model is the checkpoint's configuration: requests are validated
	// against it.
	Model *model.Config
	// Tokenizer encodes prompts and decodes completions.
	Tokenizer *tokenizer.Tokenizer
	// Generation holds generation_config.json's defaults (temperature,
	// top_p, top_k, EOS ids) for what a request leaves unset (nil: none).
	Generation *model.GenerationConfig
	// Chat holds the checkpoint's chat templates (nil: none; the OpenAI
	// API then refuses chat completions).
	Chat *chat.Set
	// Name is the model's name in the OpenAI API; Created is when it was
	// loaded.
	Name    string
	Created time.Time
	// Engines runs the requests.
	Engines Engines
	// Metrics records every request (nil: none are recorded).
	Metrics *Metrics
}

// Server is the leader's request frontend: it implements tandem.v1.Inference
// and, through OpenAI, the engine of the OpenAI HTTP API (package openai).
type Server struct {
	tandemv1.UnimplementedInferenceServer
	model   *model.Config
	tok     *tokenizer.Tokenizer
	gen     model.GenerationConfig
	eos     []int32 // the ids that end generation unless ignore_eos
	engines Engines
	metrics *Metrics
	openai  *openai.Model
}

// New returns the frontend of a model. It starts nothing.
func New(cfg Config) *Server {
	s := &Server{model: cfg.Model, tok: cfg.Tokenizer, engines: cfg.Engines, metrics: cfg.Metrics}
	if cfg.Generation != nil {
		s.gen = *cfg.Generation
	}
	eos := model.EOSIDs(cfg.Model, cfg.Generation)
	for _, id := range eos {
		s.eos = append(s.eos, int32(id))
	}
	s.openai = &openai.Model{
		ID:         cfg.Name,
		Created:    cfg.Created,
		MaxContext: cfg.Model.MaxPositions,
		Tokenizer:  cfg.Tokenizer,
		Chat:       cfg.Chat,
		Defaults:   s.gen,
		EOS:        eos,
	}
	return s
}

// NotLeader is the UNAVAILABLE error of a node that is not the leader,
// naming the leader and its address ("no leader" when there is none yet).
func NotLeader(leader, addr string) error {
	if leader == "" {
		return apierr.Unavailablef("no leader has been chosen yet")
	}
	return apierr.Unavailablef("this node is not the leader; the leader is %s at %s", leader, addr)
}
