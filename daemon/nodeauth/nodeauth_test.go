package nodeauth

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"

	"github.com/tandem-llm/tandem/daemon/apierr"
	"github.com/tandem-llm/tandem/linkauth"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

const protocol = "node/1 control/2 data/2"

func cred(t testing.TB, secret string) *linkauth.Credential {
	t.Helper()
	c, err := linkauth.NewCredential([]byte(secret))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// node is a Node server that records the callers it served.
type node struct {
	tandemv1.UnimplementedNodeServer
	callers chan string
}

func (n *node) Release(ctx context.Context, in *tandemv1.ReleaseRequest) (*tandemv1.ReleaseResponse, error) {
	c, _ := Caller(ctx)
	n.callers <- c
	return &tandemv1.ReleaseResponse{}, nil
}

// serve runs a Node server behind v and returns a connection to it whose
// calls pass through intercept (nil: none).
func serve(t *testing.T, v *Verifier, intercept grpc.UnaryClientInterceptor) (tandemv1.NodeClient, healthpb.HealthClient, *node) {
	t.Helper()
	ln := bufconn.Listen(1 << 20)
	srv := grpc.NewServer(grpc.UnaryInterceptor(v.Unary))
	n := &node{callers: make(chan string, 16)}
	tandemv1.RegisterNodeServer(srv, n)
	healthpb.RegisterHealthServer(srv, health.NewServer())
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)
	opts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return ln.DialContext(ctx) })}
	if intercept != nil {
		opts = append(opts, grpc.WithUnaryInterceptor(intercept))
	}
	conn, err := grpc.NewClient("passthrough:///node", opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return tandemv1.NewNodeClient(conn), healthpb.NewHealthClient(conn), n
}

// TestVerifier calls a Node server through a Verifier with the cluster
// credential: a call signed with it reaches the handler with its caller;
// every forgery, another secret or protocol, a replay, a changed body, a
// call from the past and a caller Authorize refuses do not.
func TestVerifier(t *testing.T) {
	secret := "0123456789abcdef0123456789abcdef"
	now := time.Unix(1_800_000_000, 0)
	clock := func() time.Time { return now }
	authorize := func(_ context.Context, caller, method string) error {
		if caller != "leader" {
			return apierr.Preconditionf("%s: %s is not the leader", method, caller)
		}
		return nil
	}
	v := NewVerifier(VerifierConfig{Protocol: protocol, Credential: cred(t, secret), Authorize: authorize, Now: clock})
	good := Signer{Node: "leader", Protocol: protocol, Credential: cred(t, secret), Now: clock}
	client, hc, n := serve(t, v, nil)
	ctx := context.Background()
	call := func(md []string, epoch uint64) error {
		_, err := client.Release(metadata.AppendToOutgoingContext(ctx, md...), &tandemv1.ReleaseRequest{Epoch: epoch})
		return err
	}
	sign := func(s Signer, epoch uint64) []string {
		md, err := s.metadata("/tandem.v1.Node/Release", &tandemv1.ReleaseRequest{Epoch: epoch})
		if err != nil {
			t.Fatal(err)
		}
		return md
	}
	md := sign(good, 7)
	if err := call(md, 7); err != nil {
		t.Fatalf("signed call: %v", err)
	}
	if c := <-n.callers; c != "leader" {
		t.Errorf("the handler saw caller %q, want leader", c)
	}
	other := good
	other.Credential = cred(t, "fedcba9876543210fedcba9876543210")
	unsigned := good
	unsigned.Credential = nil
	skewed := good
	skewed.Now = func() time.Time { return now.Add(-10 * time.Minute) }
	stage := good
	stage.Node = "stage-1"
	newer := good
	newer.Protocol = "node/2 control/2 data/2"
	for _, c := range []struct {
		name  string
		md    []string
		epoch uint64
		code  codes.Code
		want  string
	}{
		{"no metadata", nil, 7, codes.Unauthenticated, "names no internal protocol"},
		{"unsigned", sign(unsigned, 7), 7, codes.Unauthenticated, "sent no proof"},
		{"another secret", sign(other, 7), 7, codes.Unauthenticated, "proof of the cluster credential is wrong"},
		{"replayed", md, 7, codes.Unauthenticated, "replay"},
		{"another body", sign(good, 7), 1<<64 - 1, codes.Unauthenticated, "proof of the cluster credential is wrong"},
		{"from the past", sign(skewed, 7), 7, codes.Unauthenticated, "clocks in step"},
		{"another protocol", sign(newer, 7), 7, codes.FailedPrecondition, `speaks internal protocol "node/2 control/2 data/2", this node "node/1 control/2 data/2"`},
		{"not the leader", sign(stage, 7), 7, codes.FailedPrecondition, "stage-1 is not the leader"},
	} {
		err := call(c.md, c.epoch)
		if status.Code(err) != c.code || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want %v containing %q", c.name, err, c.code, c.want)
		}
	}
	if len(n.callers) != 0 {
		t.Errorf("%d refused calls reached the handler", len(n.callers))
	}
	// Through the interceptor, as the daemon calls.
	client, _, n = serve(t, v, good.Unary)
	for range 2 {
		if _, err := client.Release(ctx, &tandemv1.ReleaseRequest{Epoch: 9}); err != nil {
			t.Fatalf("call through Signer.Unary: %v", err)
		}
		<-n.callers
	}
	// Other services pass unchecked.
	if _, err := hc.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		t.Errorf("health through the verifier: %v", err)
	}
}

// TestWithoutCredential: with no credential on either end calls name
// their caller unproven; a proof sent to a node without a credential is
// refused, as is a call without one to a node that has one.
func TestWithoutCredential(t *testing.T) {
	v := NewVerifier(VerifierConfig{Protocol: protocol})
	client, _, n := serve(t, v, Signer{Node: "leader", Protocol: protocol}.Unary)
	if _, err := client.Release(context.Background(), &tandemv1.ReleaseRequest{}); err != nil {
		t.Fatal(err)
	}
	if c := <-n.callers; c != "leader" {
		t.Errorf("caller %q, want leader", c)
	}
	signed := Signer{Node: "leader", Protocol: protocol, Credential: cred(t, "0123456789abcdef")}
	client, _, _ = serve(t, v, signed.Unary)
	_, err := client.Release(context.Background(), &tandemv1.ReleaseRequest{})
	if status.Code(err) != codes.Unauthenticated || !strings.Contains(err.Error(), "none is configured here") {
		t.Errorf("a proof to a node without credential: %v", err)
	}
}

// FuzzVerifier feeds arbitrary call metadata (what any client controls) to
// a Verifier with a credential: it never panics and accepts nothing but a
// call signed with the credential.
func FuzzVerifier(f *testing.F) {
	secret := "0123456789abcdef0123456789abcdef"
	good := Signer{Node: "leader", Protocol: protocol, Credential: cred(f, secret)}
	md, err := good.metadata("/tandem.v1.Node/Release", &tandemv1.ReleaseRequest{Epoch: 3})
	if err != nil {
		f.Fatal(err)
	}
	f.Add(md[1], md[3], md[5], md[7], md[9], uint64(3))
	f.Add(protocol, "leader", "1", "", "", uint64(0))
	f.Add("", "", "-9223372036854775808", "x", "y", uint64(1<<63))
	key := cred(f, secret)
	v := NewVerifier(VerifierConfig{Protocol: protocol, Credential: key})
	f.Fuzz(func(t *testing.T, proto, caller, at, nonce, proof string, epoch uint64) {
		ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs(
			mdProtocol, proto, mdCaller, caller, mdTime, at, mdNonce, nonce, mdProof, proof))
		got, err := v.check(ctx, "/tandem.v1.Node/Release", &tandemv1.ReleaseRequest{Epoch: epoch})
		if err == nil {
			body, _ := bodyHash(&tandemv1.ReleaseRequest{Epoch: epoch})
			if got != caller || !key.Verify([]byte(proof), purpose, []byte(proto), []byte(caller), []byte("/tandem.v1.Node/Release"), []byte(at), []byte(nonce), body) {
				t.Fatalf("accepted a call of %q without the credential's proof", got)
			}
		}
		if err != nil && apierr.KindOf(err) == 0 {
			t.Fatalf("refusal of no kind: %v", err)
		}
	})
}
