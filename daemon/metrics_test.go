package daemon

import (
	"context"
	"encoding/base64"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// scrape gets url's metrics and parses them.
func scrape(t *testing.T, c *http.Client, url string) (map[string]*dto.MetricFamily, string) {
	t.Helper()
	resp, err := c.Get(url)
	if err != nil {
		t.Fatalf("scrape %s: %v", url, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape %s: status %s, %v", url, resp.Status, err)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(strings.NewReader(string(body)))
	if err != nil {
		t.Fatalf("parse the metrics of %s: %v\n%s", url, err, body)
	}
	return fams, string(body)
}

// metricValue is the value of the family's metric whose labels include
// want, and whether there is one.
func metricValue(fams map[string]*dto.MetricFamily, name string, want map[string]string) (float64, bool) {
	f := fams[name]
	if f == nil {
		return 0, false
	}
next:
	for _, m := range f.GetMetric() {
		labels := map[string]string{}
		for _, l := range m.GetLabel() {
			labels[l.GetName()] = l.GetValue()
		}
		for k, v := range want {
			if labels[k] != v {
				continue next
			}
		}
		switch {
		case m.GetCounter() != nil:
			return m.GetCounter().GetValue(), true
		case m.GetGauge() != nil:
			return m.GetGauge().GetValue(), true
		}
	}
	return 0, false
}

// TestMetricsEndpoint runs a one-node CPU cluster with the metrics
// endpoint on, generates two completions and checks that /metrics agrees
// with Admin.Status and Admin.Graphs: the CUDA-graph dispatch counts (all
// NONE on the CPU) sum to the steps Graphs reports, the scheduler figures
// are Status's, and no secret is exported. Run's goroutine-leak check
// (TestMain) covers the HTTP server's shutdown.
func TestMetricsEndpoint(t *testing.T) {
	sec, keyFile, gossipKey := testSecrets(t)
	cfg := Config{
		Name:     "m",
		Model:    testModel(t),
		Listen:   ListenConfig{GRPC: "127.0.0.1:0", Gossip: "127.0.0.1:0", Metrics: "127.0.0.1:0"},
		Cluster:  ClusterConfig{FastFailureDetection: true, GossipKeyFile: keyFile},
		Stage:    StageConfig{Backend: BackendCPU, Memory: 1 << 30, MaxBatchTokens: 64, MaxSeqs: 4},
		Security: sec,
	}
	d, stop := runDaemon(t, cfg, io.Discard)
	if d.Addrs().Metrics == "" {
		t.Fatal("metrics endpoint configured but no address bound")
	}
	url := "http://" + d.Addrs().Metrics + "/metrics"
	tr := &http.Transport{}
	client := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	defer tr.CloseIdleConnections()

	admin := "s3cret-admin-token"
	conn := dialTLS(t, d.Addrs().GRPC, sec, admin)
	waitHealth(t, conn, healthpb.HealthCheckResponse_SERVING, 20*time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, prompt := range [][]int32{{5, 6, 7}, {9, 10, 11, 12, 13}} {
		stream, err := tandemv1.NewInferenceClient(conn).Generate(ctx, &tandemv1.GenerateRequest{PromptTokenIds: prompt, MaxTokens: 6, IgnoreEos: true})
		if err != nil {
			t.Fatal(err)
		}
		for {
			if _, err := stream.Recv(); errors.Is(err, io.EOF) {
				break
			} else if err != nil {
				t.Fatal(err)
			}
		}
	}
	// Wait for the steps still in flight (sampled tokens of finished
	// requests) so that the figures stand still.
	ac := tandemv1.NewAdminClient(conn)
	var st *tandemv1.StatusResponse
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		var err error
		if st, err = ac.Status(ctx, &tandemv1.StatusRequest{}); err != nil {
			t.Fatal(err)
		}
		if st.GetScheduler().GetInFlight() == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("steps still in flight: %v", st.GetScheduler())
		}
	}
	gr, err := ac.Graphs(ctx, &tandemv1.GraphsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var graphSteps uint64
	for _, s := range gr.GetSteps() {
		graphSteps += s.GetCount()
	}
	if gr.GetMode() != "NONE" || graphSteps == 0 {
		t.Fatalf("Admin.Graphs %v: want NONE steps on the CPU", gr)
	}

	fams, body := scrape(t, client, url)
	sc := st.GetScheduler()
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"tandem_steps_total", nil, float64(sc.GetSteps())},
		{"tandem_kv_blocks_total", nil, float64(sc.GetKvBlocks())},
		{"tandem_kv_blocks_used", nil, 0},
		{"tandem_kv_cache_usage_ratio", nil, 0},
		{"tandem_requests_running", nil, 0},
		{"tandem_requests_waiting", nil, 0},
		{"tandem_requests_finished_total", map[string]string{"reason": "length"}, 2},
		{"tandem_requests_finished_total", map[string]string{"reason": "stop"}, 0},
		{"tandem_generation_tokens_total", nil, 12},
		{"tandem_prompt_tokens_total", nil, 8},
		{"tandem_preemptions_total", nil, float64(sc.GetPreemptions())},
		{"tandem_discarded_tokens_total", nil, float64(sc.GetDiscardedTokens())},
		{"tandem_pipeline_serving", nil, 1},
		{"tandem_leader", nil, 1},
		{"tandem_pipeline_epoch", nil, float64(st.GetEpoch())},
	} {
		if got, ok := metricValue(fams, c.name, c.labels); !ok || got != c.want {
			t.Errorf("%s%v = %v (present %v), want %v", c.name, c.labels, got, ok, c.want)
		}
	}
	if got, ok := metricValue(fams, "tandem_step_seconds", map[string]string{"stat": "mean"}); !ok || got <= 0 || got != sc.GetMeanStepTime().AsDuration().Seconds() {
		t.Errorf("tandem_step_seconds{stat=mean} = %v (present %v), want Status's %v", got, ok, sc.GetMeanStepTime().AsDuration())
	}
	if got, ok := metricValue(fams, "tandem_graph_memory_bytes", map[string]string{"stage": "0", "node": "m"}); !ok || got != 0 {
		t.Errorf("tandem_graph_memory_bytes of the CPU stage = %v (present %v), want 0", got, ok)
	}
	var none float64
	for _, m := range fams["tandem_graph_steps_total"].GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == "mode" && l.GetValue() != "NONE" {
				t.Errorf("graph steps in mode %s on the CPU", l.GetValue())
			}
		}
		none += m.GetCounter().GetValue()
	}
	if none != float64(graphSteps) {
		t.Errorf("tandem_graph_steps_total sums to %v, Admin.Graphs reports %d steps", none, graphSteps)
	}
	for _, name := range []string{"go_goroutines", "process_cpu_seconds_total", "tandem_node_info"} {
		if fams[name] == nil {
			t.Errorf("no %s in the metrics", name)
		}
	}
	for _, secret := range []string{admin, gossipKey, base64.StdEncoding.EncodeToString([]byte(gossipKey))} {
		if strings.Contains(body, secret) {
			t.Errorf("the metrics carry a secret")
		}
	}
	t.Logf("metrics sample:\n%s", tandemLines(body))

	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if _, err := client.Get(url); err == nil {
		t.Error("the metrics endpoint still answers after Run returned")
	}
}

// tandemLines are the tandem_ samples of a scrape.
func tandemLines(body string) string {
	var out []string
	for _, l := range strings.Split(body, "\n") {
		if strings.HasPrefix(l, "tandem_") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
