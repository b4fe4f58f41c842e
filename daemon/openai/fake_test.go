package openai

import (
	"context"
	"fmt"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/tandem-llm/tandem/daemon/textout"
	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/chat"
	"github.com/tandem-llm/tandem/model/randinit"
	"github.com/tandem-llm/tandem/model/tokenizer"
	"github.com/tandem-llm/tandem/stage"
)

// testModel is the model of a tandemctl model init checkpoint: its
// tokenizer, chat template and generation defaults, read by the real
// loaders.
var testModel = sync.OnceValues(func() (*Model, error) {
	dir, err := os.MkdirTemp("", "openai-test")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	o := randinit.DefaultOptions()
	o.Layers = 1
	if err := randinit.Write(dir, o); err != nil {
		return nil, err
	}
	cfg, err := model.LoadConfig(dir)
	if err != nil {
		return nil, err
	}
	tok, err := tokenizer.Load(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		return nil, err
	}
	set, err := chat.Load(dir, nil)
	if err != nil {
		return nil, err
	}
	gen, err := model.LoadGenerationConfig(dir, cfg.VocabSize)
	if err != nil {
		return nil, err
	}
	return &Model{ID: "tiny", Created: time.Unix(1700000000, 0), MaxContext: 256, Tokenizer: tok, Chat: set,
		Defaults: *gen, EOS: model.EOSIDs(cfg, gen)}, nil
})

// fakeEngine is an Engine whose "model" answers every prompt with a fixed
// reply followed by EOS; it honours MaxTokens and StopTokens as the
// scheduler does and records what it was given.
type fakeEngine struct {
	model *Model
	reply []int32 // the tokens generated, EOS included where wanted

	mu        sync.Mutex
	ready     error
	submitErr error
	block     bool // after the first token, wait for cancellation
	fail      bool // after the first token, fail as a lost pipeline does
	got       []Generation
	cancelled chan struct{} // closed when a generation's ctx ends
}

func newFake(t testing.TB, reply string) *fakeEngine {
	t.Helper()
	m, err := testModel()
	if err != nil {
		t.Fatal(err)
	}
	ids := m.Tokenizer.Encode(reply, false)
	ids = append(ids, int32(m.EOS[0]))
	return &fakeEngine{model: m, reply: ids, cancelled: make(chan struct{})}
}

func (f *fakeEngine) Model() *Model { return f.model }

func (f *fakeEngine) Ready() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.ready
}

func (f *fakeEngine) Submit(ctx context.Context, g Generation) (Stream, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.submitErr != nil {
		return nil, f.submitErr
	}
	f.got = append(f.got, g)
	ctx, cancel := context.WithCancel(ctx)
	go func() {
		<-ctx.Done()
		f.mu.Lock()
		defer f.mu.Unlock()
		select {
		case <-f.cancelled:
		default:
			close(f.cancelled)
		}
	}()
	text := textout.New(f.model.Tokenizer, textout.Config{Stop: g.Stop, KeepSpecial: g.KeepSpecial})
	return &fakeStream{f: f, g: g, ctx: ctx, cancel: cancel, text: text, block: f.block, fail: f.fail}, nil
}

func (f *fakeEngine) last(t *testing.T) Generation {
	t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.got) == 0 {
		t.Fatal("no generation submitted")
	}
	return f.got[len(f.got)-1]
}

// awaitCancel waits until the last generation's context has ended.
func (f *fakeEngine) awaitCancel(t *testing.T) {
	t.Helper()
	select {
	case <-f.cancelled:
	case <-time.After(10 * time.Second):
		t.Fatal("the generation was not cancelled")
	}
}

// fakeStream applies the request's stop tokens, stop strings and
// MaxTokens as the request frontend does, with textout.
type fakeStream struct {
	f           *fakeEngine
	g           Generation
	ctx         context.Context // the generation's: Close cancels it
	cancel      context.CancelFunc
	text        *textout.Processor
	n           int
	block, fail bool
}

func (s *fakeStream) Close() { s.cancel() }

func (s *fakeStream) Recv(ctx context.Context) (Token, error) {
	if s.block && s.n > 0 {
		select {
		case <-ctx.Done():
		case <-s.ctx.Done():
		}
		return Token{}, context.Canceled
	}
	if err := ctx.Err(); err != nil {
		return Token{}, err
	}
	if s.fail && s.n > 0 {
		return Token{}, fmt.Errorf("%w: the generation failed: stage 1 is lost", ErrUnavailable)
	}
	if s.n >= len(s.f.reply) {
		return Token{}, fmt.Errorf("stream read after its end")
	}
	id := s.f.reply[s.n]
	s.n++
	tok := Token{Sampled: stage.Sampled{Token: id, Logprob: -0.25 * float32(s.n)}}
	for k := range s.g.Sampling.Logprobs {
		tok.Top = append(tok.Top, stage.TokenLogprob{Token: int32(k), Logprob: -float32(k + 1)})
	}
	if containsID(s.g.StopTokens, id) {
		tok.Text, tok.Finish = s.text.Finish(), FinishStop
		return tok, nil
	}
	d := s.text.Add(id)
	tok.Text = d.Text
	switch {
	case d.Stopped:
		tok.Finish = FinishStop
	case s.n == s.g.MaxTokens:
		tok.Text += s.text.Finish()
		tok.Finish = FinishLength
	}
	return tok, nil
}

func containsID(ids []int32, id int32) bool {
	for _, x := range ids {
		if x == id {
			return true
		}
	}
	return false
}

// serve starts the API over f on a loopback listener.
func serve(t *testing.T, f *fakeEngine) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(New(Config{Engine: f, Now: func() time.Time { return time.Unix(1700000123, 0) }}))
	t.Cleanup(srv.Close)
	return srv
}
