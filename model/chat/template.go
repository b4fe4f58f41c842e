package chat

import (
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/ardanlabs/jinja"
)

// Template is one compiled chat template. It is immutable: Render may be
// called from any number of goroutines.
type Template struct {
	name string
	tmpl *jinja.Template
	err  error // why the template could not be compiled; Render returns it
	env  *Env
	// loopsContent: the template iterates over a message's content, so it
	// takes content as a list of parts.
	loopsContent bool
}

// Env is what a template sees besides the request: the tokenizer's special
// tokens and the clock of strftime_now.
type Env struct {
	// SpecialTokens maps variable names (bos_token, eos_token, unk_token,
	// pad_token) to token strings, as Hugging Face passes them.
	SpecialTokens map[string]string
	// Now is strftime_now's clock; nil means time.Now.
	Now func() time.Time
}

// Request is one rendering: the conversation and the variables a client
// sets. Messages and Tools are JSON, kept as the client wrote them (the
// order of object keys shows in tool definitions).
type Request struct {
	// Messages is a JSON array of message objects.
	Messages json.RawMessage
	// Tools is a JSON array of tool definitions; empty or null for none.
	Tools json.RawMessage
	// AddGenerationPrompt asks the template to open the assistant's turn.
	AddGenerationPrompt bool
	// ContinueFinalMessage ends the prompt inside the final message, so
	// the model continues it (exclusive with AddGenerationPrompt).
	ContinueFinalMessage bool
	// Kwargs are extra template variables (enable_thinking, ...), each a
	// JSON value. They override the special tokens, as in Hugging Face.
	Kwargs map[string]json.RawMessage
	// FlattenTextContent joins a message content given as a list of text
	// parts into one string (the parts' texts joined by "\n", as vLLM
	// does) unless the template iterates over content itself. Hugging
	// Face does not do this; OpenAI clients send parts to any model.
	FlattenTextContent bool
}

// Error is a template that failed: it could not be compiled, it raised an
// exception (raise_exception), or rendering failed (an undefined value, a
// bad operation).
type Error struct {
	Template string // the template's name
	// Raised: the template called raise_exception; Message is the
	// template's own message.
	Raised  bool
	Message string
}

func (e *Error) Error() string {
	if e.Raised {
		return fmt.Sprintf("chat template %s raised an exception: %s", e.Template, e.Message)
	}
	return fmt.Sprintf("chat template %s: %s", e.Template, e.Message)
}

// InputError is a request that cannot be rendered whatever the template:
// malformed messages, tools or kwargs. Field names the part at fault.
type InputError struct {
	Field string
	Err   error
}

func (e *InputError) Error() string { return fmt.Sprintf("%s: %v", e.Field, e.Err) }
func (e *InputError) Unwrap() error { return e.Err }

// reserved are the variables a request's kwargs cannot set.
var reserved = map[string]bool{
	"messages": true, "tools": true, "documents": true, "add_generation_prompt": true,
	"raise_exception": true, "strftime_now": true, tojsonName: true,
}

// loopsContentRE finds a for loop over a message's content.
var loopsContentRE = regexp.MustCompile(`\{%-?\s*for\s+[\w, ]+\s+in\s+[\w.\[\]'"]*content\b`)

// New compiles a template's source. A template the engine cannot compile
// is not an error here: the returned Template's Render reports it, so a
// checkpoint with such a template still serves everything else.
func New(name, src string, env *Env) *Template {
	if env == nil {
		env = &Env{}
	}
	t := &Template{name: name, env: env, loopsContent: loopsContentRE.MatchString(src)}
	t.tmpl, t.err = jinja.Compile(prepare(src))
	if t.err != nil {
		t.err = &Error{Template: name, Message: fmt.Sprintf("cannot compile: %v", t.err)}
	}
	return t
}

// Name is the template's name ("default" for the checkpoint's main one).
func (t *Template) Name() string { return t.name }

// Err is why the template cannot render at all (nil when it compiled).
func (t *Template) Err() error { return t.err }

// raised is the error of raise_exception.
type raised struct{ msg string }

func (r *raised) Error() string { return r.msg }

// Render renders the request as Hugging Face's apply_chat_template does
// (tokenize=False). Errors are *InputError or *Error.
func (t *Template) Render(r Request) (string, error) {
	if t.err != nil {
		return "", t.err
	}
	if r.ContinueFinalMessage && r.AddGenerationPrompt {
		return "", &InputError{Field: "continue_final_message", Err: errors.New("cannot be combined with add_generation_prompt")}
	}
	data, err := t.data(r)
	if err != nil {
		return "", err
	}
	out, err := t.tmpl.RenderValues(data)
	if err != nil {
		if rerr, ok := errors.AsType[*raised](err); ok {
			return "", &Error{Template: t.name, Raised: true, Message: rerr.msg}
		}
		return "", &Error{Template: t.name, Message: err.Error()}
	}
	if r.ContinueFinalMessage {
		return continueFinal(out, data["messages"], t.name)
	}
	return out, nil
}

// data builds the variables the template sees.
func (t *Template) data(r Request) (map[string]jinja.Value, error) {
	msgs, err := fromJSON(r.Messages)
	if err != nil {
		return nil, &InputError{Field: "messages", Err: err}
	}
	if !msgs.IsList() {
		return nil, &InputError{Field: "messages", Err: errors.New("want a JSON array of messages")}
	}
	for i, m := range msgs.AsList().Items {
		if !m.IsDict() {
			return nil, &InputError{Field: fmt.Sprintf("messages[%d]", i), Err: errors.New("want a JSON object")}
		}
		if r.FlattenTextContent && !t.loopsContent {
			flattenText(m.AsDict())
		}
	}
	tools := jinja.None()
	if len(r.Tools) > 0 {
		if tools, err = fromJSON(r.Tools); err != nil {
			return nil, &InputError{Field: "tools", Err: err}
		}
		if !tools.IsList() && !tools.IsNone() {
			return nil, &InputError{Field: "tools", Err: errors.New("want a JSON array of tools")}
		}
	}
	now := t.env.Now
	if now == nil {
		now = time.Now
	}
	data := map[string]jinja.Value{
		"messages":              msgs,
		"tools":                 tools,
		"documents":             jinja.None(),
		"add_generation_prompt": jinja.NewBool(r.AddGenerationPrompt),
		"raise_exception": jinja.NewCallable("raise_exception", func(args []jinja.Value, _ map[string]jinja.Value) (jinja.Value, error) {
			if len(args) == 0 {
				return jinja.Undefined(), &raised{msg: ""}
			}
			return jinja.Undefined(), &raised{msg: pyStr(args[0])}
		}),
		"strftime_now": jinja.NewCallable("strftime_now", func(args []jinja.Value, _ map[string]jinja.Value) (jinja.Value, error) {
			if len(args) != 1 || !args[0].IsString() {
				return jinja.Undefined(), errors.New("strftime_now() takes one format string")
			}
			return jinja.NewString(strftime(now(), args[0].AsString())), nil
		}),
		tojsonName: jinja.NewCallable("tojson", tojsonFilter),
	}
	for k, v := range t.env.SpecialTokens {
		data[k] = jinja.NewString(v)
	}
	for k, raw := range r.Kwargs {
		if reserved[k] || strings.HasPrefix(k, "__") {
			return nil, &InputError{Field: "chat_template_kwargs", Err: fmt.Errorf("%q cannot be set", k)}
		}
		v, err := fromJSON(raw)
		if err != nil {
			return nil, &InputError{Field: "chat_template_kwargs." + k, Err: err}
		}
		data[k] = v
	}
	return data, nil
}

// flattenText replaces a content that is a list of text parts by their texts
// joined with "\n".
func flattenText(m *jinja.Dict) {
	c, ok := m.Get("content")
	if !ok || !c.IsList() {
		return
	}
	var texts []string
	for _, p := range c.AsList().Items {
		if !p.IsDict() {
			return
		}
		typ, _ := p.AsDict().Get("type")
		text, ok := p.AsDict().Get("text")
		if !typ.IsString() || typ.AsString() != "text" || !ok || !text.IsString() {
			return
		}
		texts = append(texts, text.AsString())
	}
	m.Set("content", jinja.NewString(strings.Join(texts, "\n")))
}

// pyStr is Python's str() of a template value, as raise_exception's message.
func pyStr(v jinja.Value) string {
	if v.IsString() {
		return v.AsString()
	}
	return v.String()
}

// continueFinal cuts a rendered chat right after the final message's
// content, so the model continues that message, as Hugging Face does: the
// content (its last text part when it is a list) is found from the end;
// trailing whitespace the template trimmed stays trimmed.
func continueFinal(out string, msgs jinja.Value, name string) (string, error) {
	fail := func(msg string) (string, error) {
		return "", &InputError{Field: "continue_final_message", Err: errors.New(msg)}
	}
	items := msgs.AsList().Items
	if len(items) == 0 {
		return fail("there is no final message to continue")
	}
	c, _ := items[len(items)-1].AsDict().Get("content")
	final := ""
	switch {
	case c.IsString():
		final = c.AsString()
	case c.IsList():
		found := false
		for i := len(c.AsList().Items) - 1; i >= 0 && !found; i-- {
			p := c.AsList().Items[i]
			if !p.IsDict() {
				continue
			}
			if text, ok := p.AsDict().Get("text"); ok && text.IsString() {
				final, found = text.AsString(), true
			}
		}
		if !found {
			return fail("the final message has no text to continue")
		}
	default:
		return fail("the final message has no text to continue")
	}
	stripped := pyStrip(final)
	at := strings.LastIndex(out, stripped)
	if at < 0 {
		return fail(fmt.Sprintf("the final message does not appear in the output of chat template %s (it changes the message's text)", name))
	}
	left := pyLStrip(final)
	if strings.HasPrefix(out[at:], left) && out[at:at+len(left)] == final {
		return out[:at+len(left)], nil
	}
	return out[:at+len(stripped)], nil
}

// isPySpace reports whether Python's str.isspace holds for r.
func isPySpace(r rune) bool {
	switch r {
	case ' ', '\t', '\n', '\v', '\f', '\r', 0x1c, 0x1d, 0x1e, 0x1f, 0x85, 0xa0, 0x1680, 0x2028, 0x2029, 0x202f, 0x205f, 0x3000:
		return true
	}
	return r >= 0x2000 && r <= 0x200a
}

func pyStrip(s string) string  { return strings.TrimFunc(s, isPySpace) }
func pyLStrip(s string) string { return strings.TrimLeftFunc(s, isPySpace) }
