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

// The expectations below are Python 3's own output (repr, strftime).

func TestPyFloat(t *testing.T) {
	for f, want := range map[float64]string{
		0.1: "0.1", 1.5: "1.5", 100: "100.0", 1e16: "1e+16", 1e-5: "1e-05", 0.0001: "0.0001",
		123456789012345678: "1.2345678901234568e+17", 1.0 / 3: "0.3333333333333333", -2.5: "-2.5",
		1e22: "1e+22", 5e-324: "5e-324", 1.7976931348623157e308: "1.7976931348623157e+308", 0: "0.0",
	} {
		if got := pyFloat(f); got != want {
			t.Errorf("pyFloat(%v) = %q, want %q", f, got, want)
		}
	}
}

func TestStrftime(t *testing.T) {
	at := time.Date(2026, 1, 5, 21, 4, 9, 123456000, time.UTC)
	for format, want := range map[string]string{
		"%d %b %Y":                   "05 Jan 2026",
		"%-d %B %Y":                  "5 January 2026",
		"%A %a %j %I %p %H:%M:%S":    "Monday Mon 005 09 PM 21:04:09",
		"%y %m %e %u %w %F %T %R %D": "26 01  5 1 1 2026-01-05 21:04:09 21:04 01/05/26",
		"%%Y 100%":                   "%Y 100%",
		"%f":                         "123456",
	} {
		if got := strftime(at, format); got != want {
			t.Errorf("strftime(%q) = %q, want %q", format, got, want)
		}
	}
}

func TestPrepare(t *testing.T) {
	for src, want := range map[string]string{
		"{{ x | tojson }}":                    "{{ x | " + tojsonName + " }}",
		"{{ x|tojson(indent=4) }}\n":          "{{ x|" + tojsonName + "(indent=4) }}",
		"{{ '| tojson' }} | tojson":           "{{ '| tojson' }} | tojson",
		"{# x | tojson #}{{ y | tojsonish }}": "{# x | tojson #}{{ y | tojsonish }}",
		"a\r\nb\rc\n\n":                       "a\nb\nc\n",
		"{% set s = x | tojson %}{{ s }}":     "{% set s = x | " + tojsonName + " %}{{ s }}",
		"{{ \"it's\" ~ x | trim | tojson }}":  "{{ \"it's\" ~ x | trim | " + tojsonName + " }}",
		"{{ x | tojson":                       "{{ x | " + tojsonName,
		"text | tojson {{ y }}":               "text | tojson {{ y }}",
		"{{ 'a\\'b' }}{{ z | tojson }}":       "{{ 'a\\'b' }}{{ z | " + tojsonName + " }}",
		"{%- for t in tools %}{{ t|tojson }}": "{%- for t in tools %}{{ t|" + tojsonName + " }}",
	} {
		if got := prepare(src); got != want {
			t.Errorf("prepare(%q) = %q, want %q", src, got, want)
		}
	}
}

func TestRenderInputErrors(t *testing.T) {
	tmpl := New("t", "{% for m in messages %}{{ m.content }}{% endfor %}", nil)
	for _, c := range []struct {
		req   Request
		field string
	}{
		{Request{Messages: []byte(`{"role":"user"}`)}, "messages"},
		{Request{Messages: []byte(`[1]`)}, "messages[0]"},
		{Request{Messages: []byte(`[{"content":"x"}`)}, "messages"},
		{Request{Messages: []byte(`[]`), Tools: []byte(`{}`)}, "tools"},
		{Request{Messages: []byte(`[]`), Kwargs: map[string]json.RawMessage{"messages": []byte(`1`)}}, "chat_template_kwargs"},
		{Request{Messages: []byte(`[]`), Kwargs: map[string]json.RawMessage{"__x": []byte(`1`)}}, "chat_template_kwargs"},
		{Request{Messages: []byte(`[]`), Kwargs: map[string]json.RawMessage{"x": []byte(`nope`)}}, "chat_template_kwargs.x"},
		{Request{Messages: []byte(`[{"role":"assistant","content":"a"}]`), AddGenerationPrompt: true, ContinueFinalMessage: true}, "continue_final_message"},
		{Request{Messages: []byte(`[]`), ContinueFinalMessage: true}, "continue_final_message"},
		{Request{Messages: []byte(`[{"role":"assistant"}]`), ContinueFinalMessage: true}, "continue_final_message"},
		{Request{Messages: []byte(`[` + strings.Repeat(`[`, 100) + strings.Repeat(`]`, 100) + `]`)}, "messages"},
	} {
		_, err := tmpl.Render(c.req)
		var ie *InputError
		if !errors.As(err, &ie) || ie.Field != c.field {
			t.Errorf("%s: got %v, want an input error on %s", c.req.Messages, err, c.field)
		}
	}
}

func TestRenderTemplateErrors(t *testing.T) {
	_, err := New("broken", "{% if x %}", nil).Render(Request{Messages: []byte(`[]`)})
	var terr *Error
	if !errors.As(err, &terr) || terr.Template != "broken" || !strings.Contains(err.Error(), "chat template broken") {
		t.Errorf("an uncompilable template: %v", err)
	}
	_, err = New("strict", "{{ raise_exception('no system role, ' ~ messages | length) }}", nil).Render(Request{Messages: []byte(`[{}]`)})
	if !errors.As(err, &terr) || !terr.Raised || terr.Message != "no system role, 1" {
		t.Errorf("raise_exception: %v", err)
	}
	// "+" joins two strings only, as in Jinja2 (Python); "~" joins any.
	for _, c := range []struct{ content, want string }{
		{`"hi"`, ""},
		{`[{"type": "text", "text": "hi"}]`, `can only concatenate str (not "list") to str`},
		{`null`, `can only concatenate str (not "NoneType") to str`},
	} {
		msgs := []byte(`[{"role": "user", "content": ` + c.content + `}]`)
		out, err := New("plus", "{{ '[' + messages[0]['content'] + ']' }}", nil).Render(Request{Messages: msgs})
		if c.want == "" && (err != nil || out != "[hi]") || c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)) {
			t.Errorf("'[' + %s + ']': %q, %v; want error %q", c.content, out, err, c.want)
		}
		if _, err := New("tilde", "{{ '[' ~ messages[0]['content'] ~ ']' }}", nil).Render(Request{Messages: msgs}); err != nil {
			t.Errorf("'[' ~ %s ~ ']': %v", c.content, err)
		}
	}
	if _, err := New("undef", "{{ 'x' + messages[0]['nope'] }}", nil).Render(Request{Messages: []byte(`[{"role": "user"}]`)}); err == nil || !strings.Contains(err.Error(), "undefined") {
		t.Errorf("'x' + an undefined key: %v, want an error", err)
	}
}

func TestContinueFinalMessage(t *testing.T) {
	tmpl := New("t", "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endfor %}", nil)
	for msgs, want := range map[string]string{
		`[{"role":"user","content":"hi"},{"role":"assistant","content":"Cats are"}]`:        "<user>hi</user><assistant>Cats are",
		`[{"role":"assistant","content":"Cats are "}]`:                                      "<assistant>Cats are",
		`[{"role":"assistant","content":[{"type":"text","text":"Dogs"},{"type":"image"}]}]`: "<assistant>[{'type': 'text', 'text': 'Dogs",
	} {
		got, err := tmpl.Render(Request{Messages: []byte(msgs), ContinueFinalMessage: true})
		if err != nil || got != want {
			t.Errorf("%s: got %q, %v; want %q", msgs, got, err, want)
		}
	}
	// A template that changes the final message's text cannot be continued.
	upper := New("u", "{% for m in messages %}{{ m.content | upper }}{% endfor %}", nil)
	_, err := upper.Render(Request{Messages: []byte(`[{"role":"assistant","content":"abc"}]`), ContinueFinalMessage: true})
	var ie *InputError
	if !errors.As(err, &ie) || ie.Field != "continue_final_message" {
		t.Errorf("a rewritten final message: %v", err)
	}
}

func TestFlattenTextContent(t *testing.T) {
	msgs := []byte(`[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]`)
	plain := New("plain", "{% for m in messages %}{{ m.content + '!' }}{% endfor %}", nil)
	if got, err := plain.Render(Request{Messages: msgs, FlattenTextContent: true}); err != nil || got != "a\nb!" {
		t.Errorf("flattened: %q, %v", got, err)
	}
	parts := New("parts", "{% for m in messages %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endfor %}", nil)
	if got, err := parts.Render(Request{Messages: msgs, FlattenTextContent: true}); err != nil || got != "[a][b]" {
		t.Errorf("a template that loops over content keeps the parts: %q, %v", got, err)
	}
}

func TestLoadAndSelect(t *testing.T) {
	dir := t.TempDir()
	write := func(name, data string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, name)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	s, err := Load(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Select("", false); !errors.Is(err, ErrNoTemplate) {
		t.Errorf("no template: %v", err)
	}
	write(TokenizerConfigFile, `{"bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>", "pad_token": null,
		"chat_template": [{"name": "default", "template": "D{{ bos_token }}{{ eos_token }}"}, {"name": "tool_use", "template": "T"}, {"name": "rag", "template": "R"}]}`)
	s, err = Load(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	render := func(name string, tools bool) string {
		t.Helper()
		tmpl, err := s.Select(name, tools)
		if err != nil {
			t.Fatal(err)
		}
		out, err := tmpl.Render(Request{Messages: []byte(`[]`)})
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	if got := render("", false); got != "D<s></s>" {
		t.Errorf("default: %q", got)
	}
	if got := render("", true); got != "T" {
		t.Errorf("tools pick tool_use: %q", got)
	}
	if got := render("rag", true); got != "R" {
		t.Errorf("named: %q", got)
	}
	if _, err := s.Select("nope", false); err == nil || !strings.Contains(err.Error(), "rag") {
		t.Errorf("unknown name: %v", err)
	}
	// chat_template.jinja takes the default's place.
	write(TemplateFile, "J{{ eos_token }}\n")
	write(filepath.Join(AdditionalDir, "extra.jinja"), "X")
	if s, err = Load(dir, nil); err != nil {
		t.Fatal(err)
	}
	if got := render("", false); got != "J</s>" {
		t.Errorf("chat_template.jinja: %q", got)
	}
	if got := render("extra", false); got != "X" {
		t.Errorf("additional template: %q", got)
	}
	for _, bad := range []string{`{`, `{"chat_template": 3}`, `{"chat_template": [{"name": "x"}]}`, `{"bos_token": 1}`} {
		write(TokenizerConfigFile, bad)
		if _, err := Load(dir, nil); err == nil || !strings.Contains(err.Error(), TokenizerConfigFile) {
			t.Errorf("%s: %v", bad, err)
		}
	}
}
