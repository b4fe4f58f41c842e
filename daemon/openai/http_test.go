package openai

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"
)

// These tests speak raw HTTP: the SSE framing byte for byte, and the
// routes beside the completions.

func post(t *testing.T, url, body string) (*http.Response, string) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, string(b)
}

var idRE = regexp.MustCompile(`"id":"((?:chatcmpl|cmpl)-[0-9a-f]{24})"`)

// TestSSEFramingChat: the exact bytes of a streamed chat completion with
// include_usage: a role chunk, a chunk per token, the finish chunk, the
// usage chunk, [DONE]; every event "data: " + JSON + a blank line.
func TestSSEFramingChat(t *testing.T) {
	f := newFake(t, "Hi there")
	srv := serve(t, f)
	resp, body := post(t, srv.URL+"/v1/chat/completions",
		`{"model":"tiny","messages":[{"role":"user","content":"Hello"}],"stream":true,"stream_options":{"include_usage":true}}`)
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("status %d content type %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	m := idRE.FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("no id in %q", body)
	}
	head := `data: {"id":"` + m[1] + `","object":"chat.completion.chunk","created":1700000123,"model":"tiny","choices":[{"index":0,`
	var want strings.Builder
	want.WriteString(head + `"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"usage":null}` + "\n\n")
	for _, id := range f.reply[:len(f.reply)-1] { // the EOS adds no text
		fmt.Fprintf(&want, head+`"delta":{"content":%q},"logprobs":null,"finish_reason":null}],"usage":null}`+"\n\n", f.model.Tokenizer.Decode([]int32{id}, true))
	}
	want.WriteString(head + `"delta":{},"logprobs":null,"finish_reason":"stop"}],"usage":null}` + "\n\n")
	n := len(chatPrompt(t, f.model, "Hello"))
	fmt.Fprintf(&want, `data: {"id":"%s","object":"chat.completion.chunk","created":1700000123,"model":"tiny","choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}`+"\n\n", m[1], n, len(f.reply), n+len(f.reply))
	want.WriteString("data: [DONE]\n\n")
	if body != want.String() {
		t.Errorf("stream\n%s\nwant\n%s", body, want.String())
	}
}

// TestSSEFramingCompletion: a streamed text completion without usage has
// no usage field, and ends on the length limit.
func TestSSEFramingCompletion(t *testing.T) {
	f := newFake(t, "Hi there")
	srv := serve(t, f)
	_, body := post(t, srv.URL+"/v1/completions", `{"model":"tiny","prompt":[5,6],"stream":true,"max_tokens":2}`)
	m := idRE.FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("no id in %q", body)
	}
	head := `data: {"id":"` + m[1] + `","object":"text_completion","created":1700000123,"model":"tiny","choices":[{"index":0,`
	var want strings.Builder
	for _, id := range f.reply[:2] {
		fmt.Fprintf(&want, head+`"text":%q,"logprobs":null,"finish_reason":null}]}`+"\n\n", f.model.Tokenizer.Decode([]int32{id}, true))
	}
	want.WriteString(head + `"text":"","logprobs":null,"finish_reason":"length"}]}` + "\n\n" + "data: [DONE]\n\n")
	if body != want.String() {
		t.Errorf("stream\n%s\nwant\n%s", body, want.String())
	}
}

func TestRoutes(t *testing.T) {
	f := newFake(t, "Hi")
	srv := serve(t, f)
	get := func(path string) (int, string) {
		resp, err := http.Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := get("/v1/models"); code != 200 || body != `{"object":"list","data":[{"id":"tiny","object":"model","created":1700000000,"owned_by":"tandem","max_model_len":256}]}`+"\n" {
		t.Errorf("/v1/models: %d %s", code, body)
	}
	if code, _ := get("/v1/models/tiny"); code != 200 {
		t.Errorf("/v1/models/tiny: %d", code)
	}
	if code, body := get("/v1/models/other"); code != 404 || !strings.Contains(body, "model_not_found") {
		t.Errorf("/v1/models/other: %d %s", code, body)
	}
	if code, body := get("/health"); code != 200 || body != `{"status":"ok"}`+"\n" {
		t.Errorf("/health: %d %s", code, body)
	}
	f.mu.Lock()
	f.ready = fmt.Errorf("no pipeline serves: 1 of 2 stages are up")
	f.mu.Unlock()
	if code, body := get("/health"); code != 503 || !strings.Contains(body, "no pipeline serves") {
		t.Errorf("/health while not serving: %d %s", code, body)
	}
	if code, body := get("/nope"); code != 404 || !strings.Contains(body, `"type":"invalid_request_error"`) {
		t.Errorf("/nope: %d %s", code, body)
	}
	if code, body := get("/v1/chat/completions"); code != 405 || !strings.Contains(body, `"error"`) {
		t.Errorf("GET /v1/chat/completions: %d %s", code, body)
	}
	resp, body := post(t, srv.URL+"/v1/completions", `{"model":"tiny","prompt":"x"`)
	if resp.StatusCode != 400 || !strings.Contains(body, "not a JSON object") {
		t.Errorf("malformed body: %d %s", resp.StatusCode, body)
	}
}

// TestLongPromptRefused: a completion prompt or a rendered conversation
// longer than any prompt of the context can be is a 400 naming its field
// and size, refused before it is tokenised (the engine never sees it).
func TestLongPromptRefused(t *testing.T) {
	f := newFake(t, "Hi")
	srv := serve(t, f)
	most := f.model.Tokenizer.MaxTextBytes(f.model.MaxContext)
	long := strings.Repeat("a ", most/2+1)
	for _, c := range []struct{ path, body, field string }{
		{"/v1/completions", `{"model":"tiny","prompt":"` + long + `"}`, "prompt"},
		{"/v1/completions", `{"model":"tiny","prompt":["` + long + `"]}`, "prompt"},
		{"/v1/chat/completions", `{"model":"tiny","messages":[{"role":"user","content":"` + long + `"}]}`, "messages"},
	} {
		resp, body := post(t, srv.URL+c.path, c.body)
		if resp.StatusCode != 400 || !strings.Contains(body, `"param":"`+c.field+`"`) || !strings.Contains(body, "bytes: longer than any prompt of the context length 256 tokens") {
			t.Errorf("%s with a %d-byte %s: %d %s", c.path, len(long), c.field, resp.StatusCode, body)
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.got) != 0 {
		t.Errorf("the engine got %d requests", len(f.got))
	}
}

func TestTokenize(t *testing.T) {
	f := newFake(t, "Hi")
	srv := serve(t, f)
	tok := f.model.Tokenizer
	var got struct {
		Count       int      `json:"count"`
		MaxModelLen int      `json:"max_model_len"`
		Tokens      []int32  `json:"tokens"`
		TokenStrs   []string `json:"token_strs"`
	}
	decode := func(body string) {
		t.Helper()
		got.TokenStrs = nil
		if err := json.Unmarshal([]byte(body), &got); err != nil {
			t.Fatalf("%v: %s", err, body)
		}
	}
	_, body := post(t, srv.URL+"/tokenize", `{"model":"tiny","prompt":"Hello world","return_token_strs":true}`)
	decode(body)
	want := tok.Encode("Hello world", true)
	if got.Count != len(want) || fmt.Sprint(got.Tokens) != fmt.Sprint(want) || got.MaxModelLen != 256 || len(got.TokenStrs) != len(want) {
		t.Errorf("prompt: %s, want %v", body, want)
	}
	_, body = post(t, srv.URL+"/tokenize", `{"prompt":"Hello world","add_special_tokens":false}`)
	decode(body)
	if fmt.Sprint(got.Tokens) != fmt.Sprint(tok.Encode("Hello world", false)) || got.TokenStrs != nil {
		t.Errorf("without special tokens: %s", body)
	}
	_, body = post(t, srv.URL+"/tokenize", `{"messages":[{"role":"user","content":"Hello"}]}`)
	decode(body)
	if fmt.Sprint(got.Tokens) != fmt.Sprint(chatPrompt(t, f.model, "Hello")) {
		t.Errorf("messages: %s", body)
	}
	resp, body := post(t, srv.URL+"/detokenize", fmt.Sprintf(`{"tokens":%v}`, strings.ReplaceAll(fmt.Sprint(want), " ", ",")))
	if resp.StatusCode != 200 || body != `{"prompt":"<|begin_of_text|>Hello world"}`+"\n" {
		t.Errorf("detokenize: %d %s", resp.StatusCode, body)
	}
	if resp, body := post(t, srv.URL+"/detokenize", `{"tokens":[-1]}`); resp.StatusCode != 400 || !strings.Contains(body, `"param":"tokens"`) {
		t.Errorf("detokenize out of range: %d %s", resp.StatusCode, body)
	}
}

// TestGenerationFails: a generation that fails after it started ends a
// stream with an error event and [DONE], and a non-streamed request with
// a 503.
func TestGenerationFails(t *testing.T) {
	f := newFake(t, "Hi there")
	f.fail = true
	srv := serve(t, f)
	_, body := post(t, srv.URL+"/v1/completions", `{"prompt":"x","stream":true}`)
	want := `data: {"error":{"message":"unavailable: the generation failed: stage 1 is lost","type":"service_unavailable","param":null,"code":null}}` + "\n\ndata: [DONE]\n\n"
	if !strings.HasSuffix(body, want) {
		t.Errorf("stream %q, want it to end with %q", body, want)
	}
	resp, body := post(t, srv.URL+"/v1/chat/completions", `{"messages":[{"role":"user","content":"x"}]}`)
	if resp.StatusCode != 503 || !strings.Contains(body, "stage 1 is lost") {
		t.Errorf("%d %s", resp.StatusCode, body)
	}
}
