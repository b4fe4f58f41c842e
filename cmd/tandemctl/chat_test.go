package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	oa "github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
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

// TestChat holds a two-turn conversation with a live daemon through its
// OpenAI endpoint, greedily: each reply printed is what openai-go gets,
// not streamed, for the same conversation, the second turn's with the
// first exchange in it (which the command must have kept).
func TestChat(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "m")
	if _, err := run(t, "", "model", "init", "--out", dir); err != nil {
		t.Fatal(err)
	}
	url := "http://" + startDaemonAddrs(t, dir, "tok-chat").HTTP + "/v1"
	out, err := run(t, "Hello, I am Ann.\n\nWhat did I say?\n", "chat", "--url", url, "--system", "Be kind.", "--temperature", "0", "--max-tokens", "6")
	if err != nil {
		t.Fatal(err)
	}
	client := oa.NewClient(option.WithBaseURL(url+"/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	history := []oa.ChatCompletionMessageParamUnion{oa.SystemMessage("Be kind.")}
	want := ""
	// The empty line between the turns prompts again.
	for i, turn := range []string{"Hello, I am Ann.", "What did I say?"} {
		history = append(history, oa.UserMessage(turn))
		resp, err := client.Chat.Completions.New(ctx, oa.ChatCompletionNewParams{
			Model: filepath.Base(dir), Messages: history, Temperature: oa.Float(0), MaxCompletionTokens: oa.Int(6),
		})
		if err != nil {
			t.Fatal(err)
		}
		reply := resp.Choices[0].Message.Content
		want += strings.Repeat("> ", i+1) + reply
		if resp.Choices[0].FinishReason == "length" {
			want += " [cut: max tokens]"
		}
		want += "\n"
		history = append(history, oa.AssistantMessage(reply))
	}
	want += "> \n"
	if out != want {
		t.Errorf("printed %q, want %q", out, want)
	}
	t.Logf("printed %q", out)
}
