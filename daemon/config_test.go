package daemon

import (
	"encoding/base64"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/tandem-llm/tandem/sched"
)

// TestExampleConfig parses the commented example and checks a key of every
// section.
func TestExampleConfig(t *testing.T) {
	cfg, err := LoadConfig("testdata/tandemd.toml")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Name != "node-a" || cfg.Listen.GRPC != "127.0.0.1:7400" || cfg.Listen.Metrics != "127.0.0.1:9400" || cfg.Cluster.ExpectStages != 2 ||
		cfg.Stage.Memory != 8<<30 || time.Duration(cfg.Cluster.DrainTimeout) != 30*time.Second ||
		cfg.Security.AdminTokenFile != "/etc/tandem/admin.token" || len(cfg.Plan) != 2 || cfg.Plan[1].Layers != [2]int{16, 32} ||
		cfg.Cluster.LeaderEligible == nil || !*cfg.Cluster.LeaderEligible || time.Duration(cfg.Cluster.RecoveryTimeout) != time.Minute ||
		time.Duration(cfg.Cluster.StepTimeout) != 30*time.Second || cfg.Cluster.AutoRebalance == nil || !*cfg.Cluster.AutoRebalance ||
		time.Duration(cfg.Listen.IdleTimeout) != 5*time.Minute {
		t.Errorf("example config parsed as %+v", cfg)
	}
	full, err := cfg.withDefaults()
	if err != nil {
		t.Errorf("example config: %v", err)
	}
	if full.Stage.MaxSeqs != 64 || full.Stage.BlockSize != 32 || full.Stage.Backend != "cuda" || full.Stage.GraphMode != "PIECEWISE" || full.Stage.MaxCaptureSize != 256 ||
		full.Stage.GraphMemory != 1<<30 || full.Stage.Handoff == nil || *full.Stage.Handoff || full.Stage.CompensatedTokens != 32 ||
		full.admission() != (sched.Config{MaxNumWaiting: 2048, GrowthReserve: 64, MaxPreemptions: 2}) {
		t.Errorf("with defaults: %+v", full.Stage)
	}
	def, err := Config{Name: "n", Model: "m", Stage: StageConfig{MaxBatchTokens: 128}}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	if def.Listen.Metrics != "" {
		t.Errorf("metrics endpoint %q by default, want off", def.Listen.Metrics)
	}
	if time.Duration(def.Listen.IdleTimeout) != DefaultIdleTimeout {
		t.Errorf("idle timeout %v by default, want %v", time.Duration(def.Listen.IdleTimeout), DefaultIdleTimeout)
	}
	if cl := def.Cluster; time.Duration(cl.RecoveryTimeout) != time.Minute || time.Duration(cl.StepTimeout) != 30*time.Second || !*cl.AutoRebalance {
		t.Errorf("cluster defaults: %+v, want recovery in 60s, steps within 30s, auto-rebalance on", cl)
	}
	if def.Stage.BlockSize != 16 {
		t.Errorf("KV block size %d by default, want 16", def.Stage.BlockSize)
	}
	if s := def.Stage; s.Backend != BackendAuto || s.GraphMode != "FULL_AND_PIECEWISE" || s.MaxCaptureSize != 128 || s.GraphMemory != DefaultGraphMemory || !*s.Handoff ||
		s.CompensatedTokens != 16 {
		t.Errorf("defaults: %+v", s)
	}
}

func TestConfigErrors(t *testing.T) {
	for _, tc := range []struct {
		name, toml, want string
	}{
		{"unknown key", "model = \"m\"\n[stage]\nmemroy = \"1GiB\"\n", "line 3: unknown key stage.memroy"},
		{"unknown section", "model = \"m\"\n[cluser]\nseeds = []\n", "cluser"},
		{"bad size", "model = \"m\"\n[stage]\nmemory = \"lots\"\n", "size \"lots\""},
		{"bad duration", "model = \"m\"\n[cluster]\ndrain_timeout = \"soon\"\n", "soon"},
		{"wrong type", "model = 3\n", "line 1"},
	} {
		_, err := ParseConfig([]byte(tc.toml))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error mentioning %q", tc.name, err, tc.want)
		}
	}
	for _, tc := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"no model", Config{Name: "n"}, "model"},
		{"bad grpc address", Config{Name: "n", Model: "m", Listen: ListenConfig{GRPC: "7400"}}, "listen.grpc"},
		{"wildcard without advertise", Config{Name: "n", Model: "m", Listen: ListenConfig{GRPC: "0.0.0.0:7400"}}, "listen.advertise"},
		{"bad metrics address", Config{Name: "n", Model: "m", Listen: ListenConfig{Metrics: "9400"}}, "listen.metrics"},
		{"bad seed", Config{Name: "n", Model: "m", Cluster: ClusterConfig{Seeds: []string{"host"}}}, "cluster.seeds"},
		{"bad backend", Config{Name: "n", Model: "m", Stage: StageConfig{Backend: "tpu"}}, "stage.backend \"tpu\""},
		{"bad device", Config{Name: "n", Model: "m", Stage: StageConfig{Device: -1}}, "stage.device -1"},
		{"bad graph mode", Config{Name: "n", Model: "m", Stage: StageConfig{GraphMode: "PARTIAL"}}, "stage.graph_mode"},
		{"unsorted capture sizes", Config{Name: "n", Model: "m", Stage: StageConfig{CaptureSizes: []int{8, 4}}}, "stage.capture_sizes"},
		{"capture past the batch", Config{Name: "n", Model: "m", Stage: StageConfig{MaxBatchTokens: 64, MaxCaptureSize: 128}}, "exceeds stage.max_batch_tokens"},
		{"negative block size", Config{Name: "n", Model: "m", Stage: StageConfig{BlockSize: -4}}, "stage.block_size -4: want 1 to 1024"},
		{"huge block size", Config{Name: "n", Model: "m", Stage: StageConfig{BlockSize: 4096}}, "stage.block_size 4096"},
		{"compensated rows", Config{Name: "n", Model: "m", Stage: StageConfig{CompensatedTokens: -2}}, "stage.compensated_tokens -2"},
		{"cert without key", Config{Name: "n", Model: "m", Security: SecurityConfig{TLSCertFile: "c"}}, "go together"},
		{"bad plan", Config{Name: "n", Model: "m", Plan: []PlanRange{{Node: "a", Layers: [2]int{3, 3}}}}, "plan[0]"},
		{"negative expect", Config{Name: "n", Model: "m", Cluster: ClusterConfig{ExpectStages: -1}}, "expect_stages"},
		{"negative idle timeout", Config{Name: "n", Model: "m", Listen: ListenConfig{IdleTimeout: Duration(-time.Second)}}, "listen.idle_timeout -1s: want a positive duration"},
		{"negative balance wait", Config{Name: "n", Model: "m", Cluster: ClusterConfig{BalanceByTimeAfter: Duration(-time.Second)}}, "cluster.balance_by_time_after -1s: want a positive duration"},
		{"balance and plan", Config{Name: "n", Model: "m", Cluster: ClusterConfig{BalanceByTimeAfter: Duration(time.Minute)}, Plan: []PlanRange{{Node: "a", Layers: [2]int{0, 4}}}}, "cluster.balance_by_time_after 1m0s with a plan"},
		{"queue bound", Config{Name: "n", Model: "m", Stage: StageConfig{MaxNumWaiting: -2}}, "stage.max_num_waiting -2"},
		{"growth reserve", Config{Name: "n", Model: "m", Stage: StageConfig{GrowthReserve: -5}}, "growth reserve -5 is below -1"},
		{"preemptions", Config{Name: "n", Model: "m", Stage: StageConfig{MaxPreemptions: -1}}, "max preemptions -1 is negative"},
	} {
		_, err := tc.cfg.withDefaults()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error mentioning %q", tc.name, err, tc.want)
		}
	}
}

func TestByteSize(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want ByteSize
		text string
	}{
		{"1024", 1024, "1KiB"},
		{"8GiB", 8 << 30, "8GiB"},
		{"1.5 GiB", 3 << 29, "1536MiB"},
		{"2GB", 2e9, "1953125KiB"},
		{"1000", 1000, "1000"},
		{"512MiB", 512 << 20, "512MiB"},
		{"7B", 7, "7"},
	} {
		got, err := ParseByteSize(tc.in)
		if err != nil || got != tc.want || got.String() != tc.text {
			t.Errorf("ParseByteSize(%q) = %d (%s), %v; want %d (%s)", tc.in, got, got, err, tc.want, tc.text)
		}
	}
	for _, bad := range []string{"", "GiB", "-1GiB", "1e30TiB", "12XB"} {
		if _, err := ParseByteSize(bad); err == nil {
			t.Errorf("ParseByteSize(%q) succeeded", bad)
		}
	}
}

// TestSecretsStayOut checks the secret files' validation, and that a
// configuration logged with slog names the files but not what they hold.
func TestSecretsStayOut(t *testing.T) {
	dir := t.TempDir()
	write := func(name, data string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	key := base64.StdEncoding.EncodeToString([]byte("0123456789abcdef"))
	cfg := Config{Name: "n", Model: "m", Security: SecurityConfig{AdminTokenFile: write("token", "hunter2\n")}, Cluster: ClusterConfig{GossipKeyFile: write("key", key)}}
	s, err := cfg.readSecrets()
	if err != nil || s.adminToken != "hunter2" || len(s.gossipKey) != 16 {
		t.Fatalf("secrets %+v, %v", s, err)
	}
	var logged strings.Builder
	slog.New(slog.NewTextHandler(&logged, nil)).Info("config", "config", cfg)
	if strings.Contains(logged.String(), "hunter2") || strings.Contains(logged.String(), key) || !strings.Contains(logged.String(), "config.admin_token=true") {
		t.Errorf("logged config: %s", logged.String())
	}
	for _, tc := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"empty token", Config{Security: SecurityConfig{AdminTokenFile: write("empty", " \n")}}, "empty"},
		{"missing token", Config{Security: SecurityConfig{AdminTokenFile: filepath.Join(dir, "nope")}}, "admin_token_file"},
		{"not base64", Config{Cluster: ClusterConfig{GossipKeyFile: write("k1", "!!")}}, "not base64"},
		{"short key", Config{Cluster: ClusterConfig{GossipKeyFile: write("k2", base64.StdEncoding.EncodeToString([]byte("short")))}}, "5 bytes"},
	} {
		_, err := tc.cfg.readSecrets()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error mentioning %q", tc.name, err, tc.want)
		}
	}
}

// TestListenersNeedSecret: without a cluster secret every listener must
// be on loopback, unless security.insecure; with one (the cluster key or
// the gossip key), any address goes.
func TestListenersNeedSecret(t *testing.T) {
	exposed := ListenConfig{GRPC: "10.0.0.7:7400", Gossip: "127.0.0.1:7401", HTTP: "0.0.0.0:8000", Advertise: "10.0.0.7"}
	for _, tc := range []struct {
		name string
		cfg  Config
		want string // "" for no error
	}{
		{"loopback", Config{Listen: ListenConfig{GRPC: "127.0.0.1:7400", Gossip: "[::1]:7401", Control: "localhost:0", Metrics: "127.0.0.2:9400"}}, ""},
		{"exposed", Config{Listen: exposed}, "listen.grpc 10.0.0.7:7400, listen.http 0.0.0.0:8000: listening beyond loopback needs a cluster secret"},
		{"a host name", Config{Listen: ListenConfig{GRPC: "node-a:7400"}}, "listen.grpc node-a:7400"},
		{"cluster key", Config{Listen: exposed, Cluster: ClusterConfig{KeyFile: "k"}}, ""},
		{"gossip key", Config{Listen: exposed, Cluster: ClusterConfig{GossipKeyFile: "k"}}, ""},
		{"insecure", Config{Listen: exposed, Security: SecurityConfig{Insecure: true}}, ""},
	} {
		tc.cfg.Name, tc.cfg.Model = "n", "m"
		_, err := tc.cfg.withDefaults()
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%s: %v", tc.name, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%s: %v, want an error mentioning %q", tc.name, err, tc.want)
		}
	}
}

// TestClusterSecret: the cluster key file makes the credential and, with
// no gossip key, the gossip key; the gossip key alone is the secret;
// nodes configured alike derive credentials that check each other.
func TestClusterSecret(t *testing.T) {
	dir := t.TempDir()
	write := func(name string, secret []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(base64.StdEncoding.EncodeToString(secret)+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	cluster := write("cluster", []byte("a cluster secret of 32 bytes...."))
	gossip := write("gossip", []byte("0123456789abcdef"))
	read := func(c ClusterConfig) secrets {
		t.Helper()
		s, err := (&Config{Cluster: c}).readSecrets()
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	none := read(ClusterConfig{})
	if none.cred != nil || none.gossipKey != nil {
		t.Errorf("no secret configured: %+v", none)
	}
	a, b := read(ClusterConfig{KeyFile: cluster}), read(ClusterConfig{KeyFile: cluster})
	if a.cred == nil || len(a.gossipKey) != 32 || string(a.gossipKey) != string(b.gossipKey) {
		t.Errorf("cluster key: credential %v, gossip key of %d bytes", a.cred, len(a.gossipKey))
	}
	if sig := a.cred.Sign("test", []byte("x")); !b.cred.Verify(sig, "test", []byte("x")) {
		t.Error("two nodes with the same cluster key do not check each other")
	}
	both := read(ClusterConfig{KeyFile: cluster, GossipKeyFile: gossip})
	if string(both.gossipKey) != "0123456789abcdef" || !both.cred.Verify(a.cred.Sign("test"), "test") {
		t.Error("with both keys, gossip must use the gossip key and links the cluster key")
	}
	g := read(ClusterConfig{GossipKeyFile: gossip})
	if g.cred == nil || g.cred.Verify(a.cred.Sign("test"), "test") {
		t.Error("the gossip key alone must make a credential of its own")
	}
	for _, tc := range []struct{ name, file, want string }{
		{"short", write("short", []byte("short")), "5 bytes, want at least 16"},
		{"missing", filepath.Join(dir, "missing"), "cluster.key_file"},
	} {
		if _, err := (&Config{Cluster: ClusterConfig{KeyFile: tc.file}}).readSecrets(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error mentioning %q", tc.name, err, tc.want)
		}
	}
}

// TestMaxStreams: a connection's concurrent streams are bounded by twice
// the waiting queue and a full batch, at least 256; not at all without a
// queue bound.
func TestMaxStreams(t *testing.T) {
	for _, tc := range []struct {
		waiting, seqs int
		want          uint32
	}{
		{0, 64, 2 * (sched.DefaultMaxNumWaiting + 64)},
		{10, 4, 256},
		{1000, 100, 2200},
		{-1, 64, 1<<32 - 1},
	} {
		c := Config{Stage: StageConfig{MaxNumWaiting: tc.waiting, MaxSeqs: tc.seqs}}
		if got := c.maxStreams(); got != tc.want {
			t.Errorf("waiting %d, seqs %d: %d streams, want %d", tc.waiting, tc.seqs, got, tc.want)
		}
	}
}
