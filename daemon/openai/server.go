package openai

import (
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"net/http"
	"time"
)

// DefaultMaxBodyBytes bounds a request body unless Config sets another.
const DefaultMaxBodyBytes = 16 << 20

// Config configures a Server.
type Config struct {
	Engine Engine
	// Logger gets the node's log lines; nil discards them.
	Logger *slog.Logger
	// Metrics, when set, serves GET /metrics on the same listener, as
	// vLLM's API port does.
	Metrics http.Handler
	// MaxBodyBytes bounds a request body (0: DefaultMaxBodyBytes).
	MaxBodyBytes int64
	// Now is the clock of "created" (nil: time.Now).
	Now func() time.Time
}

// Server is the OpenAI-compatible HTTP API over an Engine. It is an
// http.Handler; the caller owns the listener and the http.Server.
type Server struct {
	engine  Engine
	log     *slog.Logger
	maxBody int64
	now     func() time.Time
	mux     *http.ServeMux
}

// New builds the API's routes. It starts nothing.
func New(cfg Config) *Server {
	s := &Server{engine: cfg.Engine, log: cfg.Logger, maxBody: cfg.MaxBodyBytes, now: cfg.Now, mux: http.NewServeMux()}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	if s.maxBody <= 0 {
		s.maxBody = DefaultMaxBodyBytes
	}
	if s.now == nil {
		s.now = time.Now
	}
	s.mux.HandleFunc("POST /v1/chat/completions", s.chatCompletions)
	s.mux.HandleFunc("POST /v1/completions", s.completions)
	s.mux.HandleFunc("GET /v1/models", s.models)
	s.mux.HandleFunc("GET /v1/models/{id...}", s.modelByID)
	s.mux.HandleFunc("GET /health", s.health)
	s.mux.HandleFunc("POST /tokenize", s.tokenize)
	s.mux.HandleFunc("POST /detokenize", s.detokenize)
	if cfg.Metrics != nil {
		s.mux.Handle("GET /metrics", cfg.Metrics)
	}
	return s
}

// ServeHTTP implements http.Handler. Unknown paths and methods get
// OpenAI's error shape.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h, pattern := s.mux.Handler(r)
	if pattern == "" {
		// The mux's own 404 or 405 (with its Allow header): answer in
		// JSON with the status it chose.
		rec := &statusRecorder{header: http.Header{}}
		h.ServeHTTP(rec, r)
		if allow := rec.header.Get("Allow"); allow != "" {
			w.Header().Set("Allow", allow)
		}
		status := rec.status
		if status == 0 {
			status = http.StatusNotFound
		}
		writeJSON(w, status, (&apiError{status: status, typ: "invalid_request_error",
			message: http.StatusText(status) + ": " + r.Method + " " + r.URL.Path}).body())
		return
	}
	s.mux.ServeHTTP(w, r) // matches again, setting the path's wildcards
}

// statusRecorder catches the status the mux's fallback handler writes.
type statusRecorder struct {
	header http.Header
	status int
}

func (r *statusRecorder) Header() http.Header         { return r.header }
func (r *statusRecorder) Write(b []byte) (int, error) { return len(b), nil }
func (r *statusRecorder) WriteHeader(status int)      { r.status = status }

type modelObject struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	OwnedBy string `json:"owned_by"`
	// MaxModelLen is vLLM's extension: the context length.
	MaxModelLen int `json:"max_model_len"`
}

type modelList struct {
	Object string        `json:"object"`
	Data   []modelObject `json:"data"`
}

func (s *Server) modelObject() modelObject {
	m := s.engine.Model()
	return modelObject{ID: m.ID, Object: "model", Created: m.Created.Unix(), OwnedBy: "tandem", MaxModelLen: m.MaxContext}
}

func (s *Server) models(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, modelList{Object: "list", Data: []modelObject{s.modelObject()}})
}

func (s *Server) modelByID(w http.ResponseWriter, r *http.Request) {
	if id := r.PathValue("id"); id != s.engine.Model().ID {
		writeError(w, modelNotFound(id))
		return
	}
	writeJSON(w, http.StatusOK, s.modelObject())
}

// health answers 200 while the engine serves, 503 otherwise, as vLLM and
// llama.cpp do.
func (s *Server) health(w http.ResponseWriter, _ *http.Request) {
	if err := s.engine.Ready(); err != nil {
		writeJSON(w, http.StatusServiceUnavailable, (&apiError{typ: "service_unavailable", message: err.Error()}).body())
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

// logFailure logs a generation that failed after it was accepted (the
// client's own refusals are not logged: the client has them).
func (s *Server) logFailure(r *http.Request, err error) {
	if r.Context().Err() == nil {
		s.log.Warn("openai: generation failed", "path", r.URL.Path, "err", err)
	}
}

// newID is a random identifier for a completion.
func newID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
