package openai

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"testing"
)

// FuzzRequests sends untrusted bodies to every POST route: each gets a
// JSON answer with status 200 or 4xx, never a panic or a 5xx.
func FuzzRequests(f *testing.F) {
	f.Add(0, []byte(`{"model":"tiny","messages":[{"role":"user","content":"Hi"}],"max_tokens":3,"logprobs":true,"top_logprobs":2,"stop":["x"]}`))
	f.Add(0, []byte(`{"messages":[{"role":"user","content":[{"type":"text","text":"a"}]}],"tools":[{"type":"function","function":{"name":"f"}}],"chat_template_kwargs":{"x":1}}`))
	f.Add(1, []byte(`{"prompt":[[1,2]],"max_tokens":2,"logprobs":1,"stream":true,"stream_options":{"include_usage":true}}`))
	f.Add(1, []byte(`{"prompt":"a","stop":"b","seed":-1,"top_k":-1,"temperature":0}`))
	f.Add(2, []byte(`{"messages":[{"role":"user","content":"x"}],"add_special_tokens":true}`))
	f.Add(3, []byte(`{"tokens":[1,2,3]}`))
	routes := []string{"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"}
	fe := newFake(f, "Hi")
	srv := New(Config{Engine: fe})
	f.Fuzz(func(t *testing.T, route int, body []byte) {
		path := routes[(route%len(routes)+len(routes))%len(routes)]
		rec := httptest.NewRecorder()
		srv.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, path, bytes.NewReader(body)))
		if rec.Code >= 500 {
			t.Fatalf("%s %q: status %d: %s", path, body, rec.Code, rec.Body)
		}
	})
}
