package chat

import (
	"encoding/json"
	"errors"
	"os"
	"testing"
	"time"
)

// TestEnvironment renders the small templates of testdata/env.json, which
// exercise Hugging Face's environment one feature at a time (trim_blocks,
// lstrip_blocks, loop controls, tojson's arguments, strftime_now,
// raise_exception), and compares with Jinja2's output (recipe:
// testdata/env.py).
func TestEnvironment(t *testing.T) {
	b, err := os.ReadFile("testdata/env.json")
	if err != nil {
		t.Fatal(err)
	}
	var f struct {
		Data struct {
			Tools    json.RawMessage `json:"tools"`
			Messages json.RawMessage `json:"messages"`
		} `json:"data"`
		Cases []struct {
			Name     string  `json:"name"`
			Template string  `json:"template"`
			Output   *string `json:"output"`
			Error    string  `json:"error"`
		} `json:"cases"`
	}
	if err := json.Unmarshal(b, &f); err != nil {
		t.Fatal(err)
	}
	env := &Env{Now: func() time.Time { return time.Date(2026, 1, 15, 9, 5, 7, 0, time.UTC) }}
	for _, c := range f.Cases {
		t.Run(c.Name, func(t *testing.T) {
			out, err := New(c.Name, c.Template, env).Render(Request{Messages: f.Data.Messages, Tools: f.Data.Tools})
			if c.Output == nil {
				var terr *Error
				if !errors.As(err, &terr) || !terr.Raised || terr.Message != c.Error {
					t.Fatalf("got %q, %v; want the raised error %q", out, err, c.Error)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if out != *c.Output {
				t.Errorf("\n got %q\nwant %q", out, *c.Output)
			}
		})
	}
}
