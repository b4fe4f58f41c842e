package main

import (
	"context"
	"encoding/json"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tandem-llm/tandem/daemon/openai"
	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/chat"
	"github.com/tandem-llm/tandem/model/tokenizer"
	"github.com/tandem-llm/tandem/stage"
)

// TestChatTemplateReference runs chat-template over every conversation of
// shared/chat with the Llama 3.1 template and compares with Hugging
// Face's rendering (skipped without ../shared).
func TestChatTemplateReference(t *testing.T) {
	dir := filepath.Join("..", "..", "..", "shared", "chat")
	if s := os.Getenv("TANDEM_SHARED"); s != "" {
		dir = filepath.Join(s, "chat")
	}
	refData, err := os.ReadFile(filepath.Join(dir, "reference.json"))
	if err != nil {
		t.Skipf("no shared chat-template reference (%v): skipping", err)
	}
	var ref struct {
		Cases []struct {
			Template             string                     `json:"template"`
			Conversation         string                     `json:"conversation"`
			AddGenerationPrompt  bool                       `json:"add_generation_prompt"`
			ContinueFinalMessage bool                       `json:"continue_final_message"`
			Kwargs               map[string]json.RawMessage `json:"kwargs"`
			Output               *string                    `json:"output"`
			Error                string                     `json:"error"`
		} `json:"cases"`
	}
	var convs []struct {
		ID       string          `json:"id"`
		Messages json.RawMessage `json:"messages"`
		Tools    json.RawMessage `json:"tools"`
	}
	convData, err := os.ReadFile(filepath.Join(dir, "conversations.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(refData, &ref); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(convData, &convs); err != nil {
		t.Fatal(err)
	}
	byID := map[string]int{}
	for i, c := range convs {
		byID[c.ID] = i
	}
	var inputs []map[string]any
	var wants []*string
	var errs []string
	for _, c := range ref.Cases {
		if c.Template != "llama3.1-8b-instruct" || c.Conversation == "strftime_now_date" { // strftime_now: the reference pinned the clock
			continue
		}
		conv := convs[byID[c.Conversation]]
		inputs = append(inputs, map[string]any{"messages": conv.Messages, "tools": conv.Tools, "add_generation_prompt": c.AddGenerationPrompt,
			"continue_final_message": c.ContinueFinalMessage, "kwargs": c.Kwargs})
		wants = append(wants, c.Output)
		errs = append(errs, c.Error)
	}
	stdin, _ := json.Marshal(inputs)
	out, err := run(t, string(stdin), "chat-template", "--template", filepath.Join(dir, "templates", "llama3.1-8b-instruct.jinja"))
	if err != nil {
		t.Fatal(err)
	}
	var got []struct {
		Output *string `json:"output"`
		Error  string  `json:"error"`
	}
	if err := json.Unmarshal([]byte(out), &got); err != nil || len(got) != len(inputs) {
		t.Fatalf("printed %.300q: %v", out, err)
	}
	for i := range got {
		switch {
		case wants[i] == nil && (got[i].Output != nil || !strings.Contains(got[i].Error, errs[i])):
			t.Errorf("case %d: got %+v, want the error %q", i, got[i], errs[i])
		case wants[i] != nil && (got[i].Output == nil || *got[i].Output != *wants[i]):
			t.Errorf("case %d: got %+v, want %q", i, got[i], *wants[i])
		}
	}
	t.Logf("%d conversations rendered as Hugging Face does", len(got))
}

// TestChatTemplateModelDir renders with a model init checkpoint's
// template (special tokens from its tokenizer_config.json), and reports a
// failing conversation as an error entry.
func TestChatTemplateModelDir(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "m")
	if _, err := run(t, "", "model", "init", "--out", dir); err != nil {
		t.Fatal(err)
	}
	out, err := run(t, `[{"messages":[{"role":"user","content":"Hi <b>"}],"add_generation_prompt":true},{"messages":[{"role":"user","content":[1]}]},{"messages":[{"role":"user","content":"x"}],"kwargs":{"bos_token":"[B]"}}]`,
		"chat-template", "--template", dir)
	if err != nil {
		t.Fatal(err)
	}
	want := `[
  {
    "output": "<|begin_of_text|>### user\nHi <b><|end_of_text|>\n### assistant\n"
  },
  {
    "error": "chat template default raised an exception: message content must be a string"
  },
  {
    "output": "[B]### user\nx<|end_of_text|>\n"
  }
]
`
	if out != want {
		t.Errorf("printed\n%s\nwant\n%s", out, want)
	}
	for _, bad := range []string{`{}`, `null`, `[`} {
		if _, err := run(t, bad, "chat-template", "--template", dir); err == nil {
			t.Errorf("stdin %q accepted", bad)
		}
	}
}

// replyEngine answers every turn with a fixed reply and records the
// prompts it was given.
type replyEngine struct {
	m     *openai.Model
	reply []int32
	mu    sync.Mutex
	seen  []string // decoded prompts
}

func (e *replyEngine) Model() *openai.Model { return e.m }
func (e *replyEngine) Ready() error         { return nil }
func (e *replyEngine) Submit(_ context.Context, g openai.Generation) (openai.Stream, error) {
	e.mu.Lock()
	e.seen = append(e.seen, e.m.Tokenizer.Decode(g.Prompt, false))
	e.mu.Unlock()
	return &replyStream{e: e, g: g}, nil
}

type replyStream struct {
	e *replyEngine
	g openai.Generation
	n int
}

func (s *replyStream) Recv(ctx context.Context) (openai.Token, error) {
	if err := ctx.Err(); err != nil {
		return openai.Token{}, err
	}
	tok := openai.Token{Sampled: stage.Sampled{Token: s.e.reply[s.n]}}
	s.n++
	if s.n == len(s.e.reply) {
		tok.Finish = openai.FinishStop
	}
	return tok, nil
}

// TestChat holds a two-turn conversation through the OpenAI API served
// over a fake engine: the replies print, and the second prompt carries
// the first exchange.
func TestChat(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "m")
	if _, err := run(t, "", "model", "init", "--out", dir); err != nil {
		t.Fatal(err)
	}
	cfg, err := model.LoadConfig(dir)
	if err != nil {
		t.Fatal(err)
	}
	tok, err := tokenizer.Load(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		t.Fatal(err)
	}
	set, err := chat.Load(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	eng := &replyEngine{
		m:     &openai.Model{ID: "m", MaxContext: cfg.MaxPositions, Tokenizer: tok, Chat: set, EOS: cfg.EOS},
		reply: append(tok.Encode("Nice to meet you.", false), int32(cfg.EOS[0])),
	}
	srv := httptest.NewServer(openai.New(openai.Config{Engine: eng, Now: func() time.Time { return time.Unix(1, 0) }}))
	defer srv.Close()
	out, err := run(t, "Hello, I am Ann.\n\nWhat did I say?\n", "chat", "--url", srv.URL+"/v1", "--system", "Be kind.")
	if err != nil {
		t.Fatal(err)
	}
	if want := "> Nice to meet you.\n> > Nice to meet you.\n> \n"; out != want {
		t.Errorf("printed %q, want %q", out, want)
	}
	if len(eng.seen) != 2 || !strings.Contains(eng.seen[1], "### system\nBe kind.<|end_of_text|>\n### user\nHello, I am Ann.<|end_of_text|>\n### assistant\nNice to meet you.<|end_of_text|>\n### user\nWhat did I say?") {
		t.Errorf("prompts %q: the second must carry the first exchange", eng.seen)
	}
}
