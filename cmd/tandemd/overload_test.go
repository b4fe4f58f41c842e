package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/tandem-llm/tandem/model/randinit"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// TestQueueBound runs a leader holding its one stage with
// --max-num-waiting 1 and --max-seqs 1: with one request running and one
// waiting, the next is refused at once with RESOURCE_EXHAUSTED over gRPC
// and 429 over HTTP, saying how many wait; the two accepted ones finish.
func TestQueueBound(t *testing.T) {
	dir := testModel(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, _ := startClusterSpec(t, ctx, clusterSpec{model: dir, stages: 1, leaderStage: true,
		leaderExtra: []string{"--max-num-waiting", "1", "--max-seqs", "1", "--http", "127.0.0.1:0"}})
	inf := tandemv1.NewInferenceClient(c.Conn)
	req := func(n uint32) *tandemv1.GenerateRequest {
		return &tandemv1.GenerateRequest{PromptTokenIds: []int32{5, 6, 7}, MaxTokens: n, IgnoreEos: true, Temperature: proto.Float32(0)}
	}
	running, err := inf.Generate(ctx, req(400))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := running.Recv(); err != nil {
		t.Fatal(err)
	}
	waiting, err := inf.Generate(ctx, req(4))
	if err != nil {
		t.Fatal(err)
	}
	awaitStatus(t, ctx, tandemv1.NewAdminClient(c.Conn), "one request waiting", func(st *tandemv1.StatusResponse) bool { return st.GetRequestsWaiting() == 1 })
	refused, err := inf.Generate(ctx, req(4))
	if err == nil {
		_, err = refused.Recv()
	}
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "1 wait for admission") {
		t.Errorf("past the queue bound over gRPC: %v, want RESOURCE_EXHAUSTED saying 1 waits", err)
	}
	resp, err := http.Post("http://"+c.Leader.HTTP+"/v1/completions", "application/json", strings.NewReader(`{"model":"model","prompt":[5,6,7],"max_tokens":4}`))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusTooManyRequests || !strings.Contains(string(body), "wait for admission") {
		t.Errorf("past the queue bound over HTTP: %d %s, want 429", resp.StatusCode, body)
	}
	resp, err = http.Get("http://" + c.Leader.HTTP + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), "\ntandem_requests_refused_total 2\n") {
		t.Errorf("/metrics: want tandem_requests_refused_total 2:\n%s", body)
	}
	for name, s := range map[string]tandemv1.Inference_GenerateClient{"running": running, "waiting": waiting} {
		for {
			_, err := s.Recv()
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Errorf("the %s request: %v", name, err)
				break
			}
		}
	}
}

// TestHugePrompts: a real leader refuses a text prompt longer than any
// prompt of the context can be without encoding it (INVALID_ARGUMENT, or
// 400, in bytes), and a message or body far larger before it has read it
// (RESOURCE_EXHAUSTED naming both sizes, or 413); it serves on.
func TestHugePrompts(t *testing.T) {
	dir := testModel(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, _ := startClusterSpec(t, ctx, clusterSpec{model: dir, stages: 1, leaderStage: true, leaderExtra: []string{"--http", "127.0.0.1:0"}})
	for _, tc := range []struct {
		bytes, http int
		want        string
	}{
		{100_000, 400, "prompt of 100000 bytes: longer than any prompt of the context length 2048 tokens"},
		{3_900_000, 413, "request body larger than 1048576 bytes"},
	} {
		resp, err := http.Post("http://"+c.Leader.HTTP+"/v1/completions", "application/json",
			strings.NewReader(`{"model":"model","max_tokens":4,"prompt":"`+strings.Repeat("x", tc.bytes)+`"}`))
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.http || !strings.Contains(string(body), tc.want) {
			t.Errorf("HTTP, a prompt of %d bytes: %d %.300s, want %d saying %q", tc.bytes, resp.StatusCode, body, tc.http, tc.want)
		}
	}
	for _, tc := range []struct {
		bytes int
		code  codes.Code
		want  string
	}{
		{100_000, codes.InvalidArgument, "prompt of 100000 bytes: longer than any prompt of the context length 2048 tokens"},
		{3_900_000, codes.ResourceExhausted, "received message larger than max"},
	} {
		_, err := generate(ctx, c.Conn, &tandemv1.GenerateRequest{Prompt: strings.Repeat("x", tc.bytes), MaxTokens: 4})
		if status.Code(err) != tc.code || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("a prompt of %d bytes: %v, want %v saying %q", tc.bytes, err, tc.code, tc.want)
		}
	}
	if g, err := generate(ctx, c.Conn, &tandemv1.GenerateRequest{Prompt: "Hello", MaxTokens: 4, IgnoreEos: true}); err != nil || len(g.ids) != 4 {
		t.Errorf("after the huge prompts: %d tokens, %v", len(g.ids), err)
	}
}

// TestKVCapacityMessage: on a pipeline whose KV cache holds fewer
// positions than the model's context, a request longer than the cache is
// refused (RESOURCE_EXHAUSTED) naming the KV capacity, not the model's
// length.
func TestKVCapacityMessage(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "model")
	o := randinit.DefaultOptions()
	o.MaxPositions = 1 << 17
	if err := randinit.Write(dir, o); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, _ := startClusterSpec(t, ctx, clusterSpec{model: dir, stages: 1, leaderStage: true, extra: []string{"--memory", "128MiB"}})
	st, err := tandemv1.NewAdminClient(c.Conn).Status(ctx, &tandemv1.StatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	kv := int(st.GetKvTokens())
	if kv >= o.MaxPositions {
		t.Fatalf("KV capacity %d positions: want fewer than the context, %d", kv, o.MaxPositions)
	}
	_, err = generate(ctx, c.Conn, &tandemv1.GenerateRequest{PromptTokenIds: []int32{1, 2, 3}, MaxTokens: uint32(kv + 10)})
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), fmt.Sprintf("the KV capacity is %d blocks (%d positions)", kv/16, kv)) || strings.Contains(err.Error(), "model length") {
		t.Errorf("a request of %d positions on a KV cache of %d: %v, want RESOURCE_EXHAUSTED naming the KV capacity", kv+13, kv, err)
	}
	t.Logf("KV capacity %d positions; refusal: %v", kv, err)
}
