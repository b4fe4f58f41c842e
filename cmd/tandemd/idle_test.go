package main

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"

	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// TestIdleConnectionsClosed runs a leader with --idle-timeout 300ms: a
// gRPC client connection and an HTTP keep-alive connection with no
// request in flight are closed by the leader (before, they stayed open for
// good, holding about 17 KB and a file descriptor each), and the gRPC
// client's next call reconnects transparently.
func TestIdleConnectionsClosed(t *testing.T) {
	dir := testModel(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, _ := startClusterSpec(t, ctx, clusterSpec{model: dir, stages: 1, leaderStage: true,
		leaderExtra: []string{"--idle-timeout", "300ms", "--http", "127.0.0.1:0"}})

	conn, err := grpc.NewClient(c.Leader.GRPC, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	admin := tandemv1.NewAdminClient(conn)
	if _, err := admin.Status(ctx, &tandemv1.StatusRequest{}); err != nil {
		t.Fatal(err)
	}
	wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
	defer wcancel()
	for s := conn.GetState(); s == connectivity.Ready; s = conn.GetState() {
		if !conn.WaitForStateChange(wctx, s) {
			t.Fatal("the idle gRPC connection still open 10 s later")
		}
	}
	if _, err := admin.Status(ctx, &tandemv1.StatusRequest{}); err != nil {
		t.Errorf("a call after the idle connection closed: %v", err)
	}

	hc, err := net.Dial("tcp", c.Leader.HTTP)
	if err != nil {
		t.Fatal(err)
	}
	defer hc.Close()
	if _, err := io.WriteString(hc, "GET /health HTTP/1.1\r\nHost: leader\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(hc)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.Close {
		t.Fatalf("/health: %d, close %t; want 200 on a kept-alive connection", resp.StatusCode, resp.Close)
	}
	hc.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := br.Read(make([]byte, 1)); err != io.EOF {
		t.Errorf("the idle HTTP connection: read %d bytes, %v; want EOF (closed by the leader)", n, err)
	}
}
