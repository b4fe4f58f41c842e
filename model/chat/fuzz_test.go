package chat

import (
	"encoding/json"
	"errors"
	"testing"
)

// FuzzRender renders untrusted request JSON through a template that walks
// every message, part and tool: it must render or return an *InputError or
// *Error, never panic.
func FuzzRender(f *testing.F) {
	f.Add([]byte(`[{"role":"user","content":"hi"}]`), []byte(`[{"type":"function","function":{"name":"f"}}]`), []byte(`true`))
	f.Add([]byte(`[{"role":"assistant","content":[{"type":"text","text":"x"}],"tool_calls":[{"function":{"arguments":{"a":1.5e300}}}]}]`), []byte(`null`), []byte(`{"a":[1,2]}`))
	f.Add([]byte(`[{"content":null}]`), []byte(``), []byte(`"s"`))
	tmpl := New("fuzz", `{% for m in messages %}{{ m.role }}{% if m.content is string %}{{ m.content | trim }}{% elif m.content is iterable %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}{% for c in m.tool_calls or [] %}{{ c.function | tojson(indent=2) }}{% endfor %}{% endfor %}{{ tools | tojson }}{{ extra | tojson(sort_keys=true) }}`, nil)
	f.Fuzz(func(t *testing.T, msgs, tools, extra []byte) {
		_, err := tmpl.Render(Request{Messages: msgs, Tools: tools, Kwargs: map[string]json.RawMessage{"extra": extra}, FlattenTextContent: true, ContinueFinalMessage: len(extra)%2 == 1})
		if err == nil {
			return
		}
		var ie *InputError
		var te *Error
		if !errors.As(err, &ie) && !errors.As(err, &te) {
			t.Fatalf("error of an unexpected kind: %T %v", err, err)
		}
	})
}

// FuzzParse reads untrusted tokenizer_config.json bytes: a Set or an error,
// never a panic.
func FuzzParse(f *testing.F) {
	f.Add([]byte(`{"chat_template": "{{ bos_token }}", "bos_token": "<s>"}`))
	f.Add([]byte(`{"chat_template": [{"name": "default", "template": "{% for m in messages %}"}]}`))
	f.Fuzz(func(t *testing.T, cfg []byte) {
		s, err := Parse(cfg, nil, nil)
		if err != nil {
			return
		}
		for _, n := range s.Names() {
			tmpl, err := s.Select(n, false)
			if err != nil {
				t.Fatal(err)
			}
			_, _ = tmpl.Render(Request{Messages: []byte(`[{"role":"user","content":"x"}]`)})
		}
	})
}
