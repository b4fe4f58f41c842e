package openai

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"strings"
	"testing"

	oa "github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/tandem-llm/tandem/model/chat"
	"github.com/tandem-llm/tandem/model/randinit"
)

// The tests in this file drive the API with the official client,
// github.com/openai/openai-go, as users' programs do.

func client(srv string) oa.Client {
	return oa.NewClient(option.WithBaseURL(srv+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
}

const reply = "Hello there, general Kenobi! 😀 Fine day."

// chatPrompt is what the chat template makes of one user turn, tokenised.
func chatPrompt(t *testing.T, m *Model, user string) []int32 {
	t.Helper()
	tmpl, err := m.Chat.Select("", false)
	if err != nil {
		t.Fatal(err)
	}
	text, err := tmpl.Render(chat.Request{Messages: []byte(`[{"role":"user","content":` + quote(user) + `}]`), AddGenerationPrompt: true})
	if err != nil {
		t.Fatal(err)
	}
	return chat.PromptTokens(m.Tokenizer, text, true)
}

func quote(s string) string {
	return `"` + strings.NewReplacer(`"`, `\"`, `\`, `\\`, "\n", `\n`).Replace(s) + `"`
}

func TestChatStreaming(t *testing.T) {
	f := newFake(t, reply)
	srv := serve(t, f)
	c := client(srv.URL)
	stream := c.Chat.Completions.NewStreaming(context.Background(), oa.ChatCompletionNewParams{
		Model:         "tiny",
		Messages:      []oa.ChatCompletionMessageParamUnion{oa.UserMessage("Hi!")},
		StreamOptions: oa.ChatCompletionStreamOptionsParam{IncludeUsage: oa.Bool(true)},
	})
	acc := oa.ChatCompletionAccumulator{}
	chunks := 0
	for stream.Next() {
		acc.AddChunk(stream.Current())
		chunks++
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if len(acc.Choices) != 1 {
		t.Fatalf("choices %+v", acc.Choices)
	}
	ch := acc.Choices[0]
	if ch.Message.Content != reply || ch.FinishReason != "stop" || ch.Message.Role != "assistant" {
		t.Errorf("content %q finish %q role %q", ch.Message.Content, ch.FinishReason, ch.Message.Role)
	}
	prompt := chatPrompt(t, f.model, "Hi!")
	g := f.last(t)
	if !slices.Equal(g.Prompt, prompt) {
		t.Errorf("prompt %v, want the chat template's %v", g.Prompt, prompt)
	}
	if acc.Usage.PromptTokens != int64(len(prompt)) || acc.Usage.CompletionTokens != int64(len(f.reply)) || acc.Usage.TotalTokens != int64(len(prompt)+len(f.reply)) {
		t.Errorf("usage %+v, want %d prompt and %d completion tokens", acc.Usage, len(prompt), len(f.reply))
	}
	if acc.Model != "tiny" || !strings.HasPrefix(acc.ID, "chatcmpl-") || chunks < 3 {
		t.Errorf("model %q id %q after %d chunks", acc.Model, acc.ID, chunks)
	}
	// Unset sampling fields take generation_config.json's values; the
	// stop tokens are the model's EOS.
	if s := g.Sampling; s.Temperature != float32(randinit.GenTemperature) || s.TopP != float32(randinit.GenTopP) || s.TopK != randinit.GenTopK {
		t.Errorf("sampling %+v, want the checkpoint's defaults", s)
	}
	if !slices.Equal(g.StopTokens, []int32{int32(f.model.EOS[0])}) || g.MaxTokens != f.model.MaxContext-len(prompt) {
		t.Errorf("stop tokens %v max tokens %d", g.StopTokens, g.MaxTokens)
	}
}

func TestChatNonStreaming(t *testing.T) {
	f := newFake(t, reply)
	c := client(serve(t, f).URL)
	resp, err := c.Chat.Completions.New(context.Background(), oa.ChatCompletionNewParams{
		Model:               "tiny",
		Messages:            []oa.ChatCompletionMessageParamUnion{oa.SystemMessage("Be brief."), oa.UserMessage("Hi!")},
		Temperature:         oa.Float(0),
		TopP:                oa.Float(0.5),
		Seed:                oa.Int(42),
		MaxCompletionTokens: oa.Int(5),
		Logprobs:            oa.Bool(true),
		TopLogprobs:         oa.Int(3),
	}, option.WithJSONSet("top_k", 7), option.WithJSONSet("ignore_eos", true))
	if err != nil {
		t.Fatal(err)
	}
	want := f.model.Tokenizer.Decode(f.reply[:5], true)
	if len(resp.Choices) != 1 || resp.Choices[0].Message.Content != want || resp.Choices[0].FinishReason != "length" {
		t.Fatalf("response %+v, want %q cut by length", resp.Choices, want)
	}
	if resp.Object != "chat.completion" || resp.Usage.CompletionTokens != 5 {
		t.Errorf("object %q usage %+v", resp.Object, resp.Usage)
	}
	lps := resp.Choices[0].Logprobs.Content
	if len(lps) != 5 {
		t.Fatalf("%d logprobs, want 5", len(lps))
	}
	for i, lp := range lps {
		tok := f.model.Tokenizer.Decode(f.reply[i:i+1], false)
		if lp.Token != tok || lp.Logprob != -0.25*float64(i+1) || len(lp.TopLogprobs) != 3 || string(int64sToBytes(lp.Bytes)) != tok {
			t.Errorf("logprob %d: %+v, want token %q", i, lp, tok)
		}
	}
	g := f.last(t)
	if s := g.Sampling; s.Temperature != 0 || s.TopP != 0.5 || s.TopK != 7 || s.Seed != 42 || s.Logprobs != 3 || g.MaxTokens != 5 || len(g.StopTokens) != 0 {
		t.Errorf("generation %+v: the request's own values must win, ignore_eos drops EOS", g)
	}
}

func int64sToBytes(v []int64) []byte {
	b := make([]byte, len(v))
	for i, x := range v {
		b[i] = byte(x)
	}
	return b
}

// TestStopStringCancels: a stop string cuts the text before it, ends the
// completion with finish_reason "stop", and cancels the generation at
// once (the engine sees its context end) though tokens remain.
func TestStopStringCancels(t *testing.T) {
	f := newFake(t, reply)
	c := client(serve(t, f).URL)
	stream := c.Completions.NewStreaming(context.Background(), oa.CompletionNewParams{
		Model:     "tiny",
		Prompt:    oa.CompletionNewParamsPromptUnion{OfString: oa.String("Say hello")},
		MaxTokens: oa.Int(100),
		Stop:      oa.CompletionNewParamsStopUnion{OfStringArray: []string{"Kenobi", "nowhere"}},
	})
	var text, finish string
	for stream.Next() {
		ch := stream.Current()
		for _, c := range ch.Choices {
			text += c.Text
			if c.FinishReason != "" {
				finish = string(c.FinishReason)
			}
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if text != "Hello there, general " || finish != "stop" {
		t.Errorf("text %q finish %q", text, finish)
	}
	f.awaitCancel(t)
	// The raw prompt got the tokenizer's BOS.
	if g := f.last(t); g.Prompt[0] != int32(randinitBOS(f)) || g.MaxTokens != 100 {
		t.Errorf("prompt %v max %d", g.Prompt, g.MaxTokens)
	}
}

func randinitBOS(f *fakeEngine) int32 {
	id, _ := f.model.Tokenizer.TokenID(randinit.BOSToken)
	return id
}

func TestCompletionNonStreaming(t *testing.T) {
	f := newFake(t, reply)
	c := client(serve(t, f).URL)
	resp, err := c.Completions.New(context.Background(), oa.CompletionNewParams{
		Model:    "tiny",
		Prompt:   oa.CompletionNewParamsPromptUnion{OfArrayOfTokens: []int64{1, 2, 3}},
		Logprobs: oa.Int(2),
	})
	if err != nil {
		t.Fatal(err)
	}
	// max_tokens defaults to 16, as in OpenAI's API.
	want := f.model.Tokenizer.Decode(f.reply[:16], true)
	if len(resp.Choices) != 1 || resp.Choices[0].Text != want || resp.Choices[0].FinishReason != "length" {
		t.Fatalf("choices %+v, want %q", resp.Choices, want)
	}
	lp := resp.Choices[0].Logprobs
	if len(lp.Tokens) != 16 || len(lp.TokenLogprobs) != 16 || len(lp.TopLogprobs) != 16 || len(lp.TextOffset) != 16 || lp.TextOffset[0] != 0 {
		t.Errorf("logprobs %+v", lp)
	}
	if resp.Usage.PromptTokens != 3 || resp.Usage.CompletionTokens != 16 {
		t.Errorf("usage %+v", resp.Usage)
	}
	if g := f.last(t); !slices.Equal(g.Prompt, []int32{1, 2, 3}) {
		t.Errorf("prompt %v", g.Prompt)
	}
}

// TestErrors: each refusal reaches the client as an *openai.Error with
// OpenAI's status, type and the field at fault.
func TestErrors(t *testing.T) {
	f := newFake(t, reply)
	c := client(serve(t, f).URL)
	msgs := []oa.ChatCompletionMessageParamUnion{oa.UserMessage("Hi")}
	for _, tc := range []struct {
		name   string
		setup  func()
		params oa.ChatCompletionNewParams
		opts   []option.RequestOption
		status int
		param  string
		text   string
	}{
		{name: "n", params: oa.ChatCompletionNewParams{Model: "tiny", Messages: msgs, N: oa.Int(2)}, status: 400, param: "n"},
		{name: "unknown model", params: oa.ChatCompletionNewParams{Model: "gpt-17", Messages: msgs}, status: 404, param: "model", text: "gpt-17"},
		{name: "temperature", params: oa.ChatCompletionNewParams{Model: "tiny", Messages: msgs, Temperature: oa.Float(-1)}, status: 400, param: "temperature"},
		{name: "top_p", params: oa.ChatCompletionNewParams{Model: "tiny", Messages: msgs, TopP: oa.Float(1.5)}, status: 400, param: "top_p"},
		{name: "top_logprobs", params: oa.ChatCompletionNewParams{Model: "tiny", Messages: msgs, Logprobs: oa.Bool(true), TopLogprobs: oa.Int(21)}, status: 400, param: "top_logprobs"},
		{name: "too long", params: oa.ChatCompletionNewParams{Model: "tiny", Messages: msgs, MaxTokens: oa.Int(100000)}, status: 400, param: "max_tokens", text: "maximum context length is 256"},
		{name: "stop", params: oa.ChatCompletionNewParams{Model: "tiny", Messages: msgs, Stop: oa.ChatCompletionNewParamsStopUnion{OfStringArray: []string{""}}}, status: 400, param: "stop"},
		{name: "template raises", params: oa.ChatCompletionNewParams{Model: "tiny", Messages: msgs}, opts: []option.RequestOption{option.WithJSONSet("messages", []any{map[string]any{"role": "user", "content": 3}})}, status: 400, param: "messages[0].content"},
		{name: "content parts", params: oa.ChatCompletionNewParams{Model: "tiny", Messages: msgs}, opts: []option.RequestOption{option.WithJSONSet("messages", []any{map[string]any{"role": "user", "content": []any{map[string]any{"type": "image_url"}}}})}, status: 400, param: "messages[0].content[0]"},
		{name: "wrong type", params: oa.ChatCompletionNewParams{Model: "tiny", Messages: msgs}, opts: []option.RequestOption{option.WithJSONSet("max_tokens", "many")}, status: 400, param: "max_tokens"},
		{name: "unavailable", setup: func() { f.submitErr = errors.Join(ErrUnavailable, errors.New("the node is draining")) }, params: oa.ChatCompletionNewParams{Model: "tiny", Messages: msgs}, status: 503, text: "draining"},
		{name: "queue full", setup: func() { f.submitErr = errors.Join(ErrOverloaded, errors.New("64 requests wait")) }, params: oa.ChatCompletionNewParams{Model: "tiny", Messages: msgs}, status: 429},
		{name: "never fits", setup: func() { f.submitErr = errors.Join(ErrInvalid, errors.New("needs more KV cache than the pipeline has")) }, params: oa.ChatCompletionNewParams{Model: "tiny", Messages: msgs}, status: 400, text: "KV cache"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f.mu.Lock()
			f.submitErr = nil
			if tc.setup != nil {
				tc.setup()
			}
			f.mu.Unlock()
			_, err := c.Chat.Completions.New(context.Background(), tc.params, tc.opts...)
			var apiErr *oa.Error
			if !errors.As(err, &apiErr) {
				t.Fatalf("got %v, want an API error", err)
			}
			if apiErr.StatusCode != tc.status || apiErr.Param != tc.param || !strings.Contains(apiErr.Message, tc.text) || apiErr.Type == "" {
				t.Errorf("status %d param %q type %q message %q; want %d, %q, containing %q", apiErr.StatusCode, apiErr.Param, apiErr.Type, apiErr.Message, tc.status, tc.param, tc.text)
			}
		})
	}
}

// TestTemplateError: a template that raises is a 400 naming the template
// and carrying its message.
func TestTemplateError(t *testing.T) {
	f := newFake(t, reply)
	m := *f.model
	set, err := chat.Parse([]byte(`{"chat_template": "{{ raise_exception('roles must alternate') }}"}`), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	m.Chat = set
	f.model = &m
	c := client(serve(t, f).URL)
	_, err = c.Chat.Completions.New(context.Background(), oa.ChatCompletionNewParams{
		Model: "tiny", Messages: []oa.ChatCompletionMessageParamUnion{oa.UserMessage("Hi")},
	})
	var apiErr *oa.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusBadRequest || !strings.Contains(apiErr.Message, "chat template default raised an exception: roles must alternate") {
		t.Fatalf("got %v", err)
	}
}

// TestClientCancel: a client that goes away mid-stream cancels the
// generation at once.
func TestClientCancel(t *testing.T) {
	f := newFake(t, reply)
	f.block = true
	c := client(serve(t, f).URL)
	ctx, cancel := context.WithCancel(context.Background())
	stream := c.Chat.Completions.NewStreaming(ctx, oa.ChatCompletionNewParams{
		Model: "tiny", Messages: []oa.ChatCompletionMessageParamUnion{oa.UserMessage("Hi")},
	})
	// The role chunk and the first token's arrive; the next token never
	// comes.
	for i := 0; i < 2 && stream.Next(); i++ {
	}
	cancel()
	f.awaitCancel(t)
	for stream.Next() {
	}
	if err := stream.Err(); err == nil {
		t.Error("the cancelled stream ended without an error")
	}
}
