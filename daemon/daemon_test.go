package daemon

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/tandem-llm/tandem/daemon/nodewire"
	"github.com/tandem-llm/tandem/daemon/sdnotify/sdnotifytest"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

func TestMain(m *testing.M) {
	// memberlist's connection handlers may take a moment to return after
	// Shutdown; goleak retries for a while before it reports them.
	goleak.VerifyTestMain(m)
}

// syncBuffer is a log sink shared by daemons.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// testSecrets writes a self-signed certificate for 127.0.0.1, an admin
// token and a gossip key, and returns the security and the gossip key
// file.
func testSecrets(t *testing.T) (SecurityConfig, string, string) {
	t.Helper()
	dir := t.TempDir()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "tandem test"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1)},
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	write := func(name string, data []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	cert := write("node.crt", pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
	sec := SecurityConfig{
		TLSCertFile:    cert,
		TLSKeyFile:     write("node.key", pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})),
		TLSCAFile:      cert,
		AdminTokenFile: write("token", []byte("s3cret-admin-token\n")),
	}
	gossipKey := "0123456789abcdef0123456789abcdef"
	return sec, write("gossip.key", []byte(base64.StdEncoding.EncodeToString([]byte(gossipKey)))), gossipKey
}

// runDaemon starts a daemon in this process and returns it once it
// listens; stop cancels it and returns Run's error.
func runDaemon(t *testing.T, cfg Config, logs io.Writer) (d *Daemon, stop func() error) {
	t.Helper()
	d, err := New(cfg, slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	select {
	case <-d.Listening():
	case err := <-done:
		t.Fatalf("daemon %s: %v", cfg.Name, err)
	}
	var once sync.Once
	var runErr error
	stop = func() error {
		once.Do(func() {
			cancel()
			runErr = <-done
		})
		return runErr
	}
	t.Cleanup(func() { stop() })
	return d, stop
}

func dialTLS(t *testing.T, addr string, sec SecurityConfig, token string, more ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	pool, err := loadCAs(sec.TLSCAFile)
	if err != nil {
		t.Fatal(err)
	}
	opts := append([]grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: pool}))}, more...)
	if token != "" {
		opts = append(opts, grpc.WithPerRPCCredentials(bearer{token: token, secure: true}))
	}
	conn, err := grpc.NewClient(addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func waitHealth(t *testing.T, conn *grpc.ClientConn, want healthpb.HealthCheckResponse_ServingStatus, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	hc := healthpb.NewHealthClient(conn)
	for {
		r, err := hc.Check(context.Background(), &healthpb.HealthCheckRequest{Service: "tandem.v1.Inference"})
		if err == nil && r.GetStatus() == want {
			return time.Since(start)
		}
		if time.Since(start) > within {
			t.Fatalf("health %v (%v) after %v, want %v", r.GetStatus(), err, within, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestSecureCluster runs two daemons in this process with TLS, an admin
// token and encrypted gossip: the leader holds the first stage, the other
// node the second. It checks health before and after the pipeline forms,
// the token on Admin and Node calls, Generate over TLS, that no secret
// reaches the logs or Status, a stale epoch refused, and that a shutdown
// lets the request in flight finish.
func TestSecureCluster(t *testing.T) {
	dir := testModel(t)
	sec, keyFile, gossipKey := testSecrets(t)
	logs := &syncBuffer{}
	base := Config{
		Model:    dir,
		Listen:   ListenConfig{GRPC: "127.0.0.1:0", Gossip: "127.0.0.1:0"},
		Cluster:  ClusterConfig{Leader: "a", ExpectStages: 2, FastFailureDetection: true, GossipKeyFile: keyFile, DrainTimeout: Duration(20 * time.Second)},
		Stage:    StageConfig{Memory: 1 << 30, MaxBatchTokens: 64, MaxSeqs: 4},
		Security: sec,
	}
	notify := sdnotifytest.Listen(t)
	ca := base
	ca.Name = "a"
	a, stopA := runDaemon(t, ca, logs)
	admin := "s3cret-admin-token"
	conn := dialTLS(t, a.Addrs().GRPC, sec, admin)
	waitHealth(t, conn, healthpb.HealthCheckResponse_NOT_SERVING, time.Second)
	// Listening without a pipeline is not ready for systemd.
	if got := notify.Until(t, 300*time.Millisecond, ""); slices.Contains(got, "READY=1") {
		t.Errorf("READY=1 sent before any pipeline served: %q", got)
	}

	cb := base
	cb.Name = "b"
	cb.Cluster.Seeds = []string{a.Addrs().Gossip}
	b, stopB := runDaemon(t, cb, logs)
	formed := waitHealth(t, conn, healthpb.HealthCheckResponse_SERVING, 20*time.Second)
	t.Logf("2-node cluster serving %v after the second node started", formed.Round(time.Millisecond))
	if got := notify.Until(t, 5*time.Second, "READY=1"); !slices.Contains(got, "READY=1") {
		t.Errorf("no READY=1 once the pipeline served: %q", got)
	}

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	st, err := tandemv1.NewAdminClient(conn).Status(ctx, &tandemv1.StatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(st.GetStages()) != 2 || st.GetStages()[0].GetNode() != "a" || st.GetStages()[1].GetNode() != "b" || !st.GetServing() {
		t.Errorf("status %v: want a then b serving", st)
	}
	if sc := st.GetScheduler(); sc == nil || sc.GetBlockSize() != 16 || sc.GetKvBlocks()*uint64(sc.GetBlockSize()) != st.GetKvTokens() || sc.GetKvBlocksUsed() != 0 || sc.GetRunning() != 0 {
		t.Errorf("status scheduler %v: want an idle scheduler with KV capacity %d tokens in blocks of 16", sc, st.GetKvTokens())
	}
	js, _ := protojson.Marshal(st)
	for _, secret := range []string{admin, gossipKey, base64.StdEncoding.EncodeToString([]byte(gossipKey))} {
		if strings.Contains(string(js), secret) {
			t.Errorf("status carries a secret: %s", js)
		}
	}

	// Node calls must also be signed with the cluster secret (here the
	// gossip key) by the leader, a.
	secrets, err := ca.readSecrets()
	if err != nil {
		t.Fatal(err)
	}
	asLeader := nodeSigner("a", secrets)
	t.Run("admin token", func(t *testing.T) {
		for _, tc := range []struct {
			name, token string
			want        codes.Code
		}{{"none", "", codes.Unauthenticated}, {"wrong", "guess", codes.Unauthenticated}, {"right", admin, codes.OK}} {
			c := dialTLS(t, b.Addrs().GRPC, sec, tc.token, asLeader)
			_, err := tandemv1.NewAdminClient(c).Status(ctx, &tandemv1.StatusRequest{})
			_, nerr := tandemv1.NewNodeClient(c).Release(ctx, &tandemv1.ReleaseRequest{Epoch: 1})
			if status.Code(err) != tc.want {
				t.Errorf("Status with %s token: %v, want %v", tc.name, err, tc.want)
			}
			if want := map[bool]codes.Code{true: codes.FailedPrecondition, false: codes.Unauthenticated}[tc.want == codes.OK]; status.Code(nerr) != want {
				t.Errorf("Node.Release (stale epoch 1) with %s token: %v, want %v", tc.name, nerr, want)
			}
		}
		// The admin token alone does not make a Node call.
		c := dialTLS(t, b.Addrs().GRPC, sec, admin)
		if _, err := tandemv1.NewNodeClient(c).Release(ctx, &tandemv1.ReleaseRequest{Epoch: 1}); status.Code(err) != codes.Unauthenticated {
			t.Errorf("unsigned Node.Release with the admin token: %v, want UNAUTHENTICATED", err)
		}
	})
	t.Run("stale epoch", func(t *testing.T) {
		var trailer metadata.MD
		_, err := tandemv1.NewNodeClient(dialTLS(t, a.Addrs().GRPC, sec, admin, asLeader)).Load(ctx, &tandemv1.LoadRequest{Epoch: st.GetEpoch() - 1, ModelId: st.GetModelId(), LayerLo: 0, LayerHi: 1, MaxBatchTokens: 8, MaxSeqs: 1}, grpc.Trailer(&trailer))
		if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "stale leader epoch") {
			t.Errorf("Load with an older epoch: %v, want FAILED_PRECONDITION", err)
		}
		if got := trailer.Get(nodewire.EpochTrailer); len(got) != 1 || got[0] != strconv.FormatUint(st.GetEpoch(), 10) {
			t.Errorf("trailer %v, want the node's epoch %d", got, st.GetEpoch())
		}
	})
	t.Run("TLS only", func(t *testing.T) {
		c, err := grpc.NewClient(a.Addrs().GRPC, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{})))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_, err = healthpb.NewHealthClient(c).Check(ctx, &healthpb.HealthCheckRequest{})
		if status.Code(err) != codes.Unavailable {
			t.Errorf("client not trusting the certificate: %v, want a failed handshake", err)
		}
	})

	// A long request, then shutdown of the leader: it finishes first.
	stream, err := tandemv1.NewInferenceClient(conn).Generate(ctx, &tandemv1.GenerateRequest{PromptTokenIds: []int32{5, 6, 7}, MaxTokens: 300, IgnoreEos: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); err != nil {
		t.Fatal(err)
	}
	// Health, watched from before the shutdown: SERVING, then NOT_SERVING
	// once the drain begins, before the server stops.
	wctx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	watch, err := healthpb.NewHealthClient(conn).Watch(wctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if r, err := watch.Recv(); err != nil || r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health before the shutdown: %v, %v; want SERVING", r.GetStatus(), err)
	}
	notServing := make(chan error, 1)
	go func() {
		defer stopWatch() // ends the watch, which the server's graceful stop waits for
		for {
			r, err := watch.Recv()
			if err != nil {
				notServing <- fmt.Errorf("health watch ended before NOT_SERVING: %w", err)
				return
			}
			if r.GetStatus() == healthpb.HealthCheckResponse_NOT_SERVING {
				notServing <- nil
				return
			}
		}
	}()
	stopped := make(chan error, 1)
	go func() { stopped <- stopA() }()
	n, last := 0, (*tandemv1.GenerateResponse)(nil)
	for {
		msg, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("request in flight during the drain: %v", err)
		}
		n += len(msg.GetTokenIds())
		last = msg
	}
	if last.GetFinishReason() != tandemv1.FinishReason_FINISH_REASON_LENGTH || last.GetUsage().GetCompletionTokens() != 300 {
		t.Errorf("drained request ended with %v", last)
	}
	if err := <-notServing; err != nil {
		t.Errorf("draining leader: %v", err)
	}
	if err := <-stopped; err != nil {
		t.Errorf("leader Run: %v", err)
	}
	if got := notify.Until(t, 5*time.Second, "STOPPING=1"); !slices.Contains(got, "STOPPING=1") {
		t.Errorf("no STOPPING=1 from the draining leader: %q", got)
	}
	if err := stopB(); err != nil {
		t.Errorf("stage node Run: %v", err)
	}
	out := logs.String()
	for _, secret := range []string{admin, gossipKey, base64.StdEncoding.EncodeToString([]byte(gossipKey))} {
		if strings.Contains(out, secret) {
			t.Errorf("the logs carry a secret")
		}
	}
	if !strings.Contains(out, "serving [a[0,2) b[2,4)]") || !strings.Contains(out, "gossip_encrypted=true") {
		t.Errorf("logs lack the pipeline or the encryption flag:\n%s", out)
	}
}
