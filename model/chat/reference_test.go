package chat

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// sharedDir locates the shared test data: $TANDEM_SHARED, else ../shared
// beside the module root; "" when neither can be found.
func sharedDir() string {
	if d := os.Getenv("TANDEM_SHARED"); d != "" {
		return d
	}
	dir, err := os.Getwd()
	if err != nil {
		return ""
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return filepath.Join(filepath.Dir(dir), "shared")
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return ""
		}
		dir = parent
	}
}

// chatDir returns shared/chat, or skips the test when it is absent.
func chatDir(t testing.TB) string {
	t.Helper()
	d := filepath.Join(sharedDir(), "chat")
	if _, err := os.Stat(filepath.Join(d, "reference.json")); err != nil {
		t.Skipf("shared chat-template data not found (%v); set TANDEM_SHARED to the shared/ directory to run this test", err)
	}
	return d
}

type refConversation struct {
	ID                   string          `json:"id"`
	Messages             json.RawMessage `json:"messages"`
	Tools                json.RawMessage `json:"tools"`
	ContinueFinalMessage bool            `json:"continue_final_message"`
}

type refCase struct {
	Template             string                     `json:"template"`
	Conversation         string                     `json:"conversation"`
	AddGenerationPrompt  bool                       `json:"add_generation_prompt"`
	ContinueFinalMessage bool                       `json:"continue_final_message"`
	Kwargs               map[string]json.RawMessage `json:"kwargs"`
	Output               *string                    `json:"output"`
	Error                string                     `json:"error"`
	ErrorType            string                     `json:"error_type"`
}

// TestReference renders every (template, conversation) pair of
// shared/chat/reference.json and compares with Hugging Face transformers'
// rendering byte for byte; where Hugging Face raised, rendering must fail,
// with the template's own message for raise_exception and Python's for a
// TypeError ("+" of a string and another type: the engine is
// third_party/jinja, ardanlabs/jinja v1.8.0 with that one change).
func TestReference(t *testing.T) {
	dir := chatDir(t)
	var ref struct {
		Cases []refCase `json:"cases"`
	}
	readJSON(t, filepath.Join(dir, "reference.json"), &ref)
	var convs []refConversation
	readJSON(t, filepath.Join(dir, "conversations.json"), &convs)
	byID := map[string]refConversation{}
	for _, c := range convs {
		byID[c.ID] = c
	}
	// Hugging Face pinned strftime_now to this day.
	env := &Env{Now: func() time.Time { return time.Date(2026, 1, 15, 0, 0, 0, 0, time.UTC) }}
	templates := map[string]*Template{}
	matched := 0
	for _, c := range ref.Cases {
		id := c.Template + "/" + c.Conversation
		tmpl, ok := templates[c.Template]
		if !ok {
			src, err := os.ReadFile(filepath.Join(dir, "templates", c.Template+".jinja"))
			if err != nil {
				t.Fatal(err)
			}
			tmpl = New(c.Template, string(src), env)
			templates[c.Template] = tmpl
		}
		conv, ok := byID[c.Conversation]
		if !ok {
			t.Fatalf("%s: no conversation %q", id, c.Conversation)
		}
		// The kwargs hold the special tokens: pass them as the request's
		// variables, which is how they reach the template either way.
		out, err := tmpl.Render(Request{
			Messages:             conv.Messages,
			Tools:                conv.Tools,
			AddGenerationPrompt:  c.AddGenerationPrompt,
			ContinueFinalMessage: c.ContinueFinalMessage,
			Kwargs:               c.Kwargs,
		})
		switch {
		case c.Output != nil && err != nil:
			t.Errorf("%s: %v", id, err)
		case c.Output != nil && out != *c.Output:
			t.Errorf("%s:\n got %q\nwant %q", id, out, *c.Output)
		case c.Output != nil:
			matched++
		case err == nil:
			t.Errorf("%s: rendered %q, Hugging Face raised %s: %s", id, out, c.ErrorType, c.Error)
		default:
			var terr *Error
			if !errors.As(err, &terr) {
				t.Errorf("%s: error %v is not a template error", id, err)
			} else if c.ErrorType == "TemplateError" && (!terr.Raised || terr.Message != c.Error) {
				t.Errorf("%s: error %v, want the template's message %q", id, err, c.Error)
			} else if c.ErrorType == "TypeError" && !strings.Contains(err.Error(), c.Error) {
				t.Errorf("%s: error %v, want Python's %q", id, err, c.Error)
			} else if !strings.Contains(err.Error(), c.Template) {
				t.Errorf("%s: error %q does not name the template", id, err)
			}
			matched++
		}
	}
	t.Logf("chat templates: %d of %d reference cases match Hugging Face", matched, len(ref.Cases))
}

func readJSON(t testing.TB, path string, v any) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}
