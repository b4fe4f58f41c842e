package chat

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// Files of a Hugging Face model directory that hold chat templates.
const (
	TokenizerConfigFile = "tokenizer_config.json"
	TemplateFile        = "chat_template.jinja"
	// AdditionalDir holds named templates, NAME.jinja each.
	AdditionalDir = "additional_chat_templates"
)

// DefaultName is the name of a checkpoint's main template; ToolUseName is
// the one Hugging Face picks when tools are given and it exists.
const (
	DefaultName = "default"
	ToolUseName = "tool_use"
)

// ErrNoTemplate: the checkpoint has no chat template.
var ErrNoTemplate = errors.New("the model has no chat template (tokenizer_config.json sets no chat_template and there is no chat_template.jinja)")

// Set is a checkpoint's chat templates with the environment they render in.
type Set struct {
	templates map[string]*Template
	env       *Env
}

// specialTokenNames are the special tokens of tokenizer_config.json that
// templates see as variables.
var specialTokenNames = []string{"bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"}

// Load reads a model directory's chat templates: chat_template.jinja and
// additional_chat_templates/*.jinja where present, else chat_template in
// tokenizer_config.json (a string, or a list of {"name", "template"}), with
// the special tokens of tokenizer_config.json. A directory without any is
// not an error: the Set has no templates and Select says so. now sets
// strftime_now's clock (nil: time.Now).
func Load(dir string, env *Env) (*Set, error) {
	cfg, err := os.ReadFile(filepath.Join(dir, TokenizerConfigFile))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("read chat templates: %w", err)
	}
	files := map[string]string{}
	if b, err := os.ReadFile(filepath.Join(dir, TemplateFile)); err == nil {
		files[DefaultName] = string(b)
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("read chat templates: %w", err)
	}
	extra, err := filepath.Glob(filepath.Join(dir, AdditionalDir, "*.jinja"))
	if err != nil {
		return nil, fmt.Errorf("read chat templates: %w", err)
	}
	for _, p := range extra {
		b, err := os.ReadFile(p)
		if err != nil {
			return nil, fmt.Errorf("read chat templates: %w", err)
		}
		files[strings.TrimSuffix(filepath.Base(p), ".jinja")] = string(b)
	}
	s, err := Parse(cfg, files, env)
	if err != nil {
		return nil, fmt.Errorf("read chat templates of %s: %w", dir, err)
	}
	return s, nil
}

// Parse builds a Set from the contents of tokenizer_config.json (nil when
// absent) and template files by name, which take precedence over the
// config's templates of the same name.
func Parse(tokenizerConfig []byte, files map[string]string, env *Env) (*Set, error) {
	e := &Env{SpecialTokens: map[string]string{}}
	if env != nil {
		e.Now = env.Now
		for k, v := range env.SpecialTokens {
			e.SpecialTokens[k] = v
		}
	}
	srcs := map[string]string{}
	if len(tokenizerConfig) > 0 {
		var cfg map[string]json.RawMessage
		if err := json.Unmarshal(tokenizerConfig, &cfg); err != nil {
			return nil, fmt.Errorf("parse %s: %w", TokenizerConfigFile, err)
		}
		for _, name := range specialTokenNames {
			tok, err := specialToken(cfg[name])
			if err != nil {
				return nil, fmt.Errorf("parse %s: %s: %w", TokenizerConfigFile, name, err)
			}
			if _, set := e.SpecialTokens[name]; tok != "" && !set {
				e.SpecialTokens[name] = tok
			}
		}
		if err := templateSources(cfg["chat_template"], srcs); err != nil {
			return nil, fmt.Errorf("parse %s: chat_template: %w", TokenizerConfigFile, err)
		}
	}
	for name, src := range files {
		srcs[name] = src
	}
	s := &Set{templates: map[string]*Template{}, env: e}
	for name, src := range srcs {
		s.templates[name] = New(name, src, e)
	}
	return s, nil
}

// specialToken reads a special token: a string, an AddedToken object
// {"content": ...}, or null.
func specialToken(raw json.RawMessage) (string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	var tok struct {
		Content *string `json:"content"`
	}
	if err := json.Unmarshal(raw, &tok); err != nil || tok.Content == nil {
		return "", errors.New("want a string or an object with a content string")
	}
	return *tok.Content, nil
}

// templateSources reads chat_template: a string (the default template) or a
// list of {"name", "template"}.
func templateSources(raw json.RawMessage, into map[string]string) error {
	if len(raw) == 0 || string(raw) == "null" {
		return nil
	}
	var one string
	if err := json.Unmarshal(raw, &one); err == nil {
		into[DefaultName] = one
		return nil
	}
	var list []struct {
		Name     *string `json:"name"`
		Template *string `json:"template"`
	}
	if err := json.Unmarshal(raw, &list); err != nil {
		return errors.New("want a string or a list of {\"name\", \"template\"}")
	}
	for i, t := range list {
		if t.Name == nil || *t.Name == "" || t.Template == nil {
			return fmt.Errorf("entry %d: want a name and a template", i)
		}
		into[*t.Name] = *t.Template
	}
	return nil
}

// Names lists the templates, sorted.
func (s *Set) Names() []string {
	names := make([]string, 0, len(s.templates))
	for n := range s.templates {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// SpecialTokens returns the special-token variables templates see.
func (s *Set) SpecialTokens() map[string]string { return s.env.SpecialTokens }

// Select picks a template as Hugging Face does: the one named (an error if
// there is none by that name), else "tool_use" when the request has tools
// and the checkpoint has one, else the default.
func (s *Set) Select(name string, hasTools bool) (*Template, error) {
	if name != "" {
		if t, ok := s.templates[name]; ok {
			return t, nil
		}
		return nil, fmt.Errorf("the model has no chat template named %q (it has %s)", name, strings.Join(s.Names(), ", "))
	}
	if t, ok := s.templates[ToolUseName]; ok && hasTools {
		return t, nil
	}
	if t, ok := s.templates[DefaultName]; ok {
		return t, nil
	}
	if len(s.templates) == 0 {
		return nil, ErrNoTemplate
	}
	return nil, fmt.Errorf("the model has chat templates %s but none named %q; name one", strings.Join(s.Names(), ", "), DefaultName)
}
