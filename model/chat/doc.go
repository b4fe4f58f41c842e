// Package chat renders a model's chat templates exactly as Hugging Face
// transformers does (apply_chat_template with tokenize=False), so a
// conversation reaches the model as the model was trained to read it.
//
// Templates come from a Hugging Face model directory: chat_template.jinja
// and additional_chat_templates/NAME.jinja, else chat_template in
// tokenizer_config.json (a string, or a list of named templates). They
// render in Hugging Face's environment: Jinja with trim_blocks and
// lstrip_blocks, loop controls (break, continue), the globals
// raise_exception and strftime_now, a tojson filter that is Python's
// json.dumps without ASCII escaping (indent, separators, sort_keys,
// ensure_ascii), and the variables messages, tools, documents (none),
// add_generation_prompt, the tokenizer's special tokens (bos_token,
// eos_token, ...) and any extra variables of the request (enable_thinking
// ...). continue_final_message cuts the output after the final message as
// Hugging Face does.
//
// The Jinja engine is github.com/ardanlabs/jinja, made for chat templates:
// v1.8.0 with one change, vendored in third_party/jinja (see its
// README.tandem.md), so that "+" of a string and another type fails as in
// Jinja2.
// The package supplies what the engine does differently from Jinja2 in
// Hugging Face's environment: messages and tools keep the key order of the
// client's JSON, tojson is replaced (the template's uses are renamed to
// ours), raise_exception returns an error that names the template and
// carries the template's own message, strftime_now follows Python's
// directives with an injectable clock, and the template source is read as
// Jinja reads it (newlines normalised, one trailing newline dropped). One
// difference remains: where Jinja2 fails on a string joined with a list,
// None or an undefined value ("+"), the engine joins them, so a template
// that Hugging Face would refuse to render with such a conversation (a
// content given as a list of parts to a template that expects a string, a
// tool call without content) renders here. FlattenTextContent turns text
// parts into a string for the templates that expect one, as vLLM does.
//
// PromptTokens decides which special tokens a prompt gets when tokenised:
// a rendered chat prompt none (the template wrote them), a raw prompt the
// tokenizer's, never twice.
//
// # Usage
//
//	set, err := chat.Load(modelDir, nil)
//	if err != nil { ... }
//	tmpl, err := set.Select("", hasTools) // "tool_use" when tools, else "default"
//	if err != nil { ... }                 // chat.ErrNoTemplate: the model has none
//	text, err := tmpl.Render(chat.Request{
//		Messages:            messagesJSON,
//		Tools:               toolsJSON,
//		AddGenerationPrompt: true,
//		Kwargs:              map[string]json.RawMessage{"enable_thinking": []byte("false")},
//	})
//	// err: *chat.InputError (a bad request field) or *chat.Error (the
//	// template failed or raised; it names the template)
//	ids := chat.PromptTokens(tok, text, true)
//
// # Concurrency
//
// A Set and its Templates are immutable after Load: Render may be called
// from any number of goroutines at once.
package chat
