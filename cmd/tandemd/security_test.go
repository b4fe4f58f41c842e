package main

import (
	"context"
	"encoding/base64"
	"math"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/daemon/nodeauth"
	"github.com/tandem-llm/tandem/daemon/nodewire"
	"github.com/tandem-llm/tandem/linkauth"
	"github.com/tandem-llm/tandem/pipeline"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// writeSecret writes a base64 cluster secret file and returns its path
// and the credential every node derives from it.
func writeSecret(t *testing.T, name, secret string) (string, *linkauth.Credential) {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(base64.StdEncoding.EncodeToString([]byte(secret))+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cred, err := linkauth.NewCredential([]byte(secret))
	if err != nil {
		t.Fatal(err)
	}
	return p, cred
}

// signedNode is a client of the Node service at addr whose calls signer
// signs (nil: unsigned).
func signedNode(t *testing.T, addr string, signer *nodeauth.Signer) tandemv1.NodeClient {
	t.Helper()
	opts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	if signer != nil {
		opts = append(opts, grpc.WithUnaryInterceptor(signer.Unary))
	}
	conn, err := grpc.NewClient(addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return tandemv1.NewNodeClient(conn)
}

// TestAttacks runs the attacks of issue 13 on a real cluster with a
// cluster secret: a leader and a CPU stage daemon serving, and a second
// stage daemon the pipeline does not use. Node.Load at epoch 2^64-1 on the
// serving stage (unsigned, signed with another secret, signed with the
// right one by a member that does not lead) is refused and the cluster
// keeps serving. Then the test, holding the secret, assigns the idle stage
// layers [2, 4) as its leader would, which opens its data port and then
// its control port; forged connections to each (the guessable link names,
// epoch 0 or the real one, no or another secret) are refused, and the
// right peer is accepted after them. Before phase 2 the Load poisoned the
// stage and the forged hellos took its links.
func TestAttacks(t *testing.T) {
	dir := testModel(t)
	keyFile, cred := writeSecret(t, "cluster.key", "the cluster secret of this test!")
	_, wrong := writeSecret(t, "wrong.key", "another secret, not the cluster's")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	spec := clusterSpec{model: dir, stages: 1, extra: []string{"--cluster-key-file", keyFile}, leaderExtra: []string{"--auto-rebalance=false"}}
	c, _ := startClusterSpec(t, ctx, spec)
	idle, err := startDaemon(ctx, c.spec, "stage-2", c.spec.stageArgs("stage-2", c.Leader.Gossip))
	if err != nil {
		t.Fatal(err)
	}
	c.Stages = append(c.Stages, idle) // stopped with the cluster
	admin := tandemv1.NewAdminClient(c.Conn)
	st := awaitStatus(t, ctx, admin, "stage-2 a member", func(st *tandemv1.StatusResponse) bool {
		for _, m := range st.GetMembers() {
			if m.GetName() == "stage-2" && m.GetState() == tandemv1.MemberState_MEMBER_STATE_ALIVE {
				return st.GetServing()
			}
		}
		return false
	})
	if nodes := stageNodes(st); len(nodes) != 1 || nodes[0] != "stage-1" {
		t.Fatalf("stages %v, want stage-1 alone", nodes)
	}
	// The stage nodes' own status says who leads and whether they serve.
	for _, n := range []struct {
		p    *daemonProc
		want string
	}{
		{c.Stages[0], "led by leader; this node serves a stage of its pipeline"},
		{idle, "led by leader; this node holds no stage of its pipeline"},
	} {
		conn, err := grpc.NewClient(n.p.GRPC, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		own, err := tandemv1.NewAdminClient(conn).Status(ctx, &tandemv1.StatusRequest{})
		conn.Close()
		if err != nil || own.GetReason() != n.want || own.GetLeader() != "leader" {
			t.Errorf("%s's own status: leader %q, %q (%v); want %q", n.p.Name, own.GetLeader(), own.GetReason(), err, n.want)
		}
	}
	serves := func(when string) {
		t.Helper()
		g, err := generate(ctx, c.Conn, &tandemv1.GenerateRequest{Prompt: "Hello there", MaxTokens: 6, IgnoreEos: true, Temperature: proto.Float32(0)})
		if err != nil || len(g.ids) != 6 {
			t.Fatalf("Generate %s: %d tokens, %v", when, len(g.ids), err)
		}
	}

	// Node.Load at the last epoch on the serving stage, which would make it
	// refuse every later epoch of the real leader.
	poison := &tandemv1.LoadRequest{Epoch: math.MaxUint64, Leader: "leader", ModelId: st.GetModelId(), LayerLo: 0, LayerHi: 4, MaxBatchTokens: 8, MaxSeqs: 1, BlockSize: 16}
	for _, tc := range []struct {
		name   string
		signer *nodeauth.Signer
		code   codes.Code
		want   string
	}{
		{"unsigned", nil, codes.Unauthenticated, "names no internal protocol"},
		{"unsigned, naming the protocol", &nodeauth.Signer{Node: "leader", Protocol: nodewire.Protocol}, codes.Unauthenticated, "sent no proof"},
		{"another secret", &nodeauth.Signer{Node: "leader", Protocol: nodewire.Protocol, Credential: wrong}, codes.Unauthenticated, "proof of the cluster credential is wrong"},
		{"another protocol", &nodeauth.Signer{Node: "leader", Protocol: "node/0", Credential: cred}, codes.FailedPrecondition, `speaks internal protocol "node/0", this node "` + nodewire.Protocol},
		{"a member that does not lead", &nodeauth.Signer{Node: "stage-2", Protocol: nodewire.Protocol, Credential: cred}, codes.PermissionDenied, `takes plans only from the leader, which its membership says is "leader"`},
	} {
		_, err := signedNode(t, c.Stages[0].GRPC, tc.signer).Load(ctx, poison)
		if status.Code(err) != tc.code || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Load at epoch 2^64-1, %s: %v, want %v containing %q", tc.name, err, tc.code, tc.want)
		}
	}
	serves("after the Load attacks")
	if after, err := admin.Status(ctx, &tandemv1.StatusRequest{}); err != nil || after.GetEpoch() != st.GetEpoch() {
		t.Errorf("after the Load attacks: epoch %d (%v), want the pipeline of epoch %d untouched", after.GetEpoch(), err, st.GetEpoch())
	}

	// The idle stage, assigned layers [2, 4) by the test as the leader.
	const epoch = 42
	node := signedNode(t, idle.GRPC, &nodeauth.Signer{Node: "leader", Protocol: nodewire.Protocol, Credential: cred})
	load, err := node.Load(ctx, &tandemv1.LoadRequest{Epoch: epoch, Leader: "leader", ModelId: st.GetModelId(), Index: 1, LayerLo: 2, LayerHi: 4, MaxBatchTokens: 8, MaxSeqs: 1, BlockSize: 16})
	if err != nil {
		t.Fatalf("Load signed as the leader: %v", err)
	}
	defer node.Release(context.WithoutCancel(ctx), &tandemv1.ReleaseRequest{Epoch: epoch})
	// silent opens connections to addr that say nothing, more than a
	// listener serves at once, held open until the test ends.
	silent := func(addr string) {
		t.Helper()
		for range 20 {
			c, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { c.Close() })
		}
	}
	forged := func(what, addr string, dial func(link string, epoch uint64, cred *linkauth.Credential) error, links []string, right string) {
		t.Helper()
		for _, link := range links {
			for _, e := range []uint64{0, epoch} {
				for _, cr := range []*linkauth.Credential{nil, wrong} {
					err := dial(link, e, cr)
					if err == nil {
						t.Errorf("%s: a forged hello for link %q, epoch %d, credential %v was accepted", what, link, e, cr)
						continue
					}
					if link == right && e == epoch && cr == nil {
						t.Logf("%s: forged hello for the right link and epoch without the secret: %v", what, err)
					}
					if link == right && e == epoch && !strings.Contains(err.Error(), "authentication") {
						t.Errorf("%s: forged hello with the right link and epoch: %v, want an authentication failure", what, err)
					}
				}
			}
		}
		// Connections that say nothing, made first, do not hold the right
		// peer up (served one at a time, they did until its dial timed out).
		silent(addr)
		if err := dial(right, epoch, cred); err != nil {
			t.Errorf("%s: the right peer after the forged ones and 20 silent connections: %v", what, err)
		}
	}
	// Its data port: the previous stage's activations.
	forged("data port", load.GetDataAddr(), func(link string, e uint64, cr *linkauth.Credential) error {
		s, err := collective.DialConfig{Link: link, Epoch: e, Credential: cr}.Dial(ctx, load.GetDataAddr())
		if err == nil {
			s.Close()
		}
		return err
	}, []string{"activations->layer1", "activations->layer2", "activations->layer3"}, "activations->layer2")
	// Wired (Connect), it accepts its control link.
	if _, err := node.Connect(ctx, &tandemv1.ConnectRequest{Epoch: epoch, Prev: tandemv1.Transport_TRANSPORT_TCP}); err != nil {
		t.Fatalf("Connect: %v", err)
	}
	forged("control port", load.GetControlAddr(), func(link string, e uint64, cr *linkauth.Credential) error {
		l, err := pipeline.ControlConfig{Link: link, Epoch: e, Credential: cr}.Dial(ctx, load.GetControlAddr())
		if err == nil {
			l.Close()
		}
		return err
	}, []string{"", "control->stage-2"}, nodewire.ControlLink("stage-2"))
	serves("after the link attacks")
}

// TestListenBeyondLoopback: without a cluster secret, tandemd serve
// refuses to listen beyond loopback, naming the listener and the way out;
// with --insecure it serves and warns.
func TestListenBeyondLoopback(t *testing.T) {
	dir := testModel(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	logs := &logBuffer{}
	spec := clusterSpec{exe: os.Args[0], env: []string{asDaemonEnv + "=1"}, model: dir, logLevel: "info", stderr: logs}
	args := append(spec.commonArgs(), "--name", "solo", "--grpc", "0.0.0.0:0", "--advertise", "127.0.0.1")
	if p, err := startDaemon(ctx, spec, "solo", args); err == nil {
		p.kill()
		t.Fatalf("listening on 0.0.0.0 without a cluster secret was accepted; log:\n%s", logs)
	}
	if want := "listen.grpc 0.0.0.0:0: listening beyond loopback needs a cluster secret"; !strings.Contains(logs.String(), want) {
		t.Errorf("the refusal does not say %q:\n%s", want, logs)
	}
	p, err := startDaemon(ctx, spec, "solo", append(args, "--insecure"))
	if err != nil {
		t.Fatalf("--insecure: %v\n%s", err, logs)
	}
	if err := p.stop(30 * time.Second); err != nil {
		t.Error(err)
	}
	if want := "insecure: listening beyond loopback without a cluster secret"; !strings.Contains(logs.String(), want) {
		t.Errorf("no warning %q:\n%s", want, logs)
	}
}
