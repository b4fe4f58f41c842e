package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/tandem-llm/tandem/daemon/openai"
)

// httpReadHeaderTimeout bounds how long a client of the HTTP endpoints may
// take to send its request headers.
const httpReadHeaderTimeout = 10 * time.Second

// Descriptions of the node's metrics. Every figure is read at scrape time
// from the state Admin.Status and Admin.Graphs report, so these metrics
// keep no counts of their own. The request-level set (vLLM's: latencies,
// tokens, requests running, waiting and finished, KV-cache usage,
// preemptions) is the frontend's (frontend.Metrics), registered beside
// them. The pipeline-change totals are the supervisor's, which outlive its
// scheduler loops: they only grow for the process's life.
var (
	descInfo = prometheus.NewDesc("tandem_node_info",
		"This node: its name, software version and model identity (always 1).",
		[]string{"node", "version", "model_id"}, nil)
	descLeader = prometheus.NewDesc("tandem_leader",
		"1 while this node is the cluster's leader.", nil, nil)
	descServing = prometheus.NewDesc("tandem_pipeline_serving",
		"1 while a pipeline this node leads, or holds a stage of, is serving.", nil, nil)
	descEpoch = prometheus.NewDesc("tandem_pipeline_epoch",
		"The leader's epoch of the pipeline it runs (leader only).", nil, nil)
	descInFlight = prometheus.NewDesc("tandem_steps_in_flight",
		"Steps in the pipeline (leader only).", nil, nil)
	descKVUsed = prometheus.NewDesc("tandem_kv_blocks_used",
		"KV-cache blocks held by running requests (leader only).", nil, nil)
	descKVTotal = prometheus.NewDesc("tandem_kv_blocks_total",
		"KV-cache blocks of the pipeline (leader only).", nil, nil)
	descDiscarded = prometheus.NewDesc("tandem_discarded_tokens_total",
		"Sampled tokens dropped because their request was preempted, cancelled or finished meanwhile (while leading).", nil, nil)
	descSteps = prometheus.NewDesc("tandem_steps_total",
		"Steps completed (while leading).", nil, nil)
	descFailed = prometheus.NewDesc("tandem_requests_failed_total",
		"Accepted requests that ended in an error: a stage could not serve them, or no pipeline did within the recovery timeout (while leading).", nil, nil)
	descRefused = prometheus.NewDesc("tandem_requests_refused_total",
		"Requests refused with RESOURCE_EXHAUSTED (HTTP 429) because the waiting queue was full (while leading).", nil, nil)
	descStepTime = prometheus.NewDesc("tandem_step_seconds",
		"Time from scheduling a step to its result: the last step's, and a moving mean (leader only).",
		[]string{"stat"}, nil)
	descGraphSteps = prometheus.NewDesc("tandem_graph_steps_total",
		"Steps dispatched by CUDA-graph runtime mode, padded and unpadded token count (while leading).",
		[]string{"mode", "padded_tokens", "unpadded_tokens"}, nil)
	descGraphMem = prometheus.NewDesc("tandem_graph_memory_bytes",
		"Device memory of each stage's CUDA graphs (leader only).",
		[]string{"stage", "node"}, nil)
	descChanges = prometheus.NewDesc("tandem_pipeline_changes_total",
		"Pipeline changes this node completed as leader, since it started: recoveries from a lost stage, moves off a leaving or drained node, rebalances.",
		[]string{"kind"}, nil)
	descReprefilled = prometheus.NewDesc("tandem_reprefilled_requests_total",
		"Running requests re-prefilled on a new pipeline (a recovery or a move), since this node started.", nil, nil)
	descReprefilledTokens = prometheus.NewDesc("tandem_reprefilled_tokens_total",
		"KV positions re-prefilled requests computed again on a new pipeline, since this node started.", nil, nil)
	descStageBusy = prometheus.NewDesc("tandem_stage_busy_seconds_total",
		"Each node's busy time as a stage of the pipelines this node led, since it started, from the stages' own timing: their forward passes (of=\"forward\") and their device time (of=\"device\", 0 where not measured); its rate is the node's busy fraction (leader only).",
		[]string{"node", "of"}, nil)
)

// metricsCollector is a prometheus.Collector reading the daemon's live
// state at every scrape: the leader's scheduler statistics and CUDA-graph
// dispatch counts, and every node's serving state. Nothing secret is read.
type metricsCollector struct{ d *Daemon }

// Describe implements prometheus.Collector.
func (c metricsCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descInfo, descLeader, descServing, descEpoch, descInFlight, descKVUsed,
		descKVTotal, descDiscarded, descSteps, descFailed, descRefused, descStepTime, descGraphSteps, descGraphMem,
		descChanges, descReprefilled, descReprefilledTokens, descStageBusy} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c metricsCollector) Collect(ch chan<- prometheus.Metric) {
	d := c.d
	gauge := func(desc *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(desc, prometheus.GaugeValue, v, labels...)
	}
	counter := func(desc *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(desc, prometheus.CounterValue, float64(v), labels...)
	}
	flag := func(b bool) float64 {
		if b {
			return 1
		}
		return 0
	}
	gauge(descInfo, 1, d.cfg.Name, Version, d.ckpt.Identity())

	snap := d.sup.Snapshot()
	d.mu.Lock()
	draining, stageReady := d.draining, d.stageReady
	d.mu.Unlock()
	p := snap.Pipeline
	leading := p != nil && !draining
	gauge(descLeader, flag(snap.Leading))
	gauge(descServing, flag(leading || (stageReady && !draining)))
	// Counters count for the life of the process, whatever pipelines and
	// leaderships come and go.
	counter(descDiscarded, d.counters.Discarded())
	counter(descSteps, d.counters.Steps())
	counter(descFailed, d.counters.Failed())
	counter(descRefused, d.counters.Refused())
	for _, r := range d.graphSteps.Snapshot() {
		counter(descGraphSteps, r.Count, r.Mode.String(), strconv.Itoa(r.Padded), strconv.Itoa(r.Unpadded))
	}
	tot := snap.Totals
	counter(descChanges, tot.Recoveries, "recovery")
	counter(descChanges, tot.Moves, "move")
	counter(descChanges, tot.Rebalances, "rebalance")
	counter(descReprefilled, d.counters.Reprefilled())
	counter(descReprefilledTokens, d.counters.ReprefilledTokens())
	for _, b := range d.sup.Trace().NodeBusy() {
		ch <- prometheus.MustNewConstMetric(descStageBusy, prometheus.CounterValue, b.Busy.Seconds(), b.Node, "forward")
		ch <- prometheus.MustNewConstMetric(descStageBusy, prometheus.CounterValue, b.DeviceBusy.Seconds(), b.Node, "device")
	}
	if !snap.Leading {
		return
	}
	st := snap.Sched
	gauge(descInFlight, float64(st.InFlight))
	gauge(descKVUsed, float64(st.KVBlocksUsed))
	gauge(descKVTotal, float64(st.KVBlocks))
	gauge(descStepTime, st.LastStepTime.Seconds(), "last")
	gauge(descStepTime, st.StepTime.Seconds(), "mean")
	if p == nil {
		return
	}
	gauge(descEpoch, float64(p.Epoch))
	for i := range p.Stages {
		s := stageStatus(i, &p.Stages[i])
		gauge(descGraphMem, float64(s.GetGraphBytes()), strconv.Itoa(i), s.GetNode())
	}
}

// newMetricsRegistry is a private registry with the node's collector, the
// request-level metrics and the standard Go runtime and process
// collectors.
func newMetricsRegistry(d *Daemon) (*prometheus.Registry, error) {
	reg := prometheus.NewRegistry()
	for _, c := range []prometheus.Collector{
		metricsCollector{d: d},
		d.reqMetrics,
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register metrics: %w", err)
		}
	}
	return reg, nil
}

// httpServer serves one HTTP listener: listen.metrics (/metrics) or
// listen.http (the OpenAI API and /metrics).
type httpServer struct {
	key    string // the configuration key of its address
	lis    net.Listener
	srv    *http.Server
	served chan error
}

// listenHTTP binds listen.metrics and listen.http; a server is nil when
// its address is empty (the endpoint is off).
func (d *Daemon) listenHTTP() (metrics, api *httpServer, err error) {
	if d.cfg.Listen.Metrics == "" && d.cfg.Listen.HTTP == "" {
		return nil, nil, nil
	}
	reg, err := newMetricsRegistry(d)
	if err != nil {
		return nil, nil, err
	}
	scrape := promhttp.HandlerFor(reg, promhttp.HandlerOpts{
		ErrorLog: slog.NewLogLogger(d.log.Handler(), slog.LevelWarn),
		Registry: reg, // promhttp_metric_handler_errors_total counts failed scrapes
	})
	if addr := d.cfg.Listen.Metrics; addr != "" {
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", scrape)
		if metrics, err = d.newHTTPServer("listen.metrics", addr, mux); err != nil {
			return nil, nil, err
		}
	}
	if addr := d.cfg.Listen.HTTP; addr != "" {
		h := openai.New(openai.Config{Engine: d.fe.OpenAI(), Logger: d.log, Metrics: scrape, MaxBodyBytes: d.maxHTTPBody()})
		if api, err = d.newHTTPServer("listen.http", addr, h); err != nil {
			metrics.abandon()
			return nil, nil, err
		}
	}
	return metrics, api, nil
}

func (d *Daemon) newHTTPServer(key, addr string, h http.Handler) (*httpServer, error) {
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen on %s (%s): %w", addr, key, err)
	}
	return &httpServer{
		key: key,
		lis: lis,
		srv: &http.Server{Handler: h, ReadHeaderTimeout: httpReadHeaderTimeout, IdleTimeout: time.Duration(d.cfg.Listen.IdleTimeout),
			ErrorLog: slog.NewLogLogger(d.log.Handler(), slog.LevelWarn)},
		served: make(chan error, 1),
	}, nil
}

// addr is the bound address ("" when m is nil: the endpoint is off).
func (m *httpServer) addr() string {
	if m == nil {
		return ""
	}
	return m.lis.Addr().String()
}

// start serves in a goroutine that stop waits for.
func (m *httpServer) start() {
	if m == nil {
		return
	}
	go func() { m.served <- m.srv.Serve(m.lis) }()
}

// abandon closes the listener of a server never started.
func (m *httpServer) abandon() {
	if m != nil {
		m.lis.Close()
	}
}

// stop shuts a started server down: requests in progress get grace to
// finish, then every connection is closed. It returns the server's error,
// if any.
func (m *httpServer) stop(grace time.Duration) error {
	if m == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	if err := m.srv.Shutdown(ctx); err != nil {
		m.srv.Close()
	}
	if err := <-m.served; !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("serve %s: %w", m.key, err)
	}
	return nil
}
