package frontend

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tandem-llm/tandem/sched"
)

// Finish reasons of the requests counted by the metrics: the scheduler's
// (a stop token or string, the length limit) and reasonAbort, a request
// that ended without its last token (its client left, it failed, the
// pipeline stopped).
const reasonAbort = "abort"

// MetricName is one request-level metric under tandem's name and vLLM's.
type MetricName struct {
	Tandem, VLLM string
	Help         string
}

// The request-level metrics, with vLLM's meaning and buckets (vLLM v1's
// PrometheusStatLogger): each tandem name maps to one vLLM name.
var (
	NameTTFT = MetricName{"tandem_time_to_first_token_seconds", "vllm:time_to_first_token_seconds",
		"Time from a request's arrival to its first token, in seconds."}
	NameITL = MetricName{"tandem_inter_token_latency_seconds", "vllm:inter_token_latency_seconds",
		"Time between two consecutive tokens of a request, in seconds."}
	NameE2E = MetricName{"tandem_request_latency_seconds", "vllm:e2e_request_latency_seconds",
		"Time from a request's arrival to its last token, in seconds (requests that finished)."}
	NameQueue = MetricName{"tandem_request_queue_seconds", "vllm:request_queue_time_seconds",
		"Time a request waited before the scheduler first ran it, in seconds."}
	NamePrefill = MetricName{"tandem_request_prefill_seconds", "vllm:request_prefill_time_seconds",
		"Time from a request's first scheduling to its first token, in seconds."}
	NameDecode = MetricName{"tandem_request_decode_seconds", "vllm:request_decode_time_seconds",
		"Time from a request's first token to its last, in seconds."}
	NameInference = MetricName{"tandem_request_inference_seconds", "vllm:request_inference_time_seconds",
		"Time from a request's first scheduling to its last token, in seconds."}
	NamePromptTokens = MetricName{"tandem_prompt_tokens_total", "vllm:prompt_tokens_total",
		"Prompt tokens of the requests that got their first token."}
	NameGenerationTokens = MetricName{"tandem_generation_tokens_total", "vllm:generation_tokens_total",
		"Tokens generated."}
	NameFinished = MetricName{"tandem_requests_finished_total", "vllm:request_success_total",
		"Requests ended, by reason: stop (a stop token or string), length (max tokens), abort (cancelled by the client or failed)."}
	NameRunning = MetricName{"tandem_requests_running", "vllm:num_requests_running",
		"Requests admitted by the scheduler, holding KV blocks."}
	NameWaiting = MetricName{"tandem_requests_waiting", "vllm:num_requests_waiting",
		"Requests waiting for admission, or preempted."}
	NameKVUsage = MetricName{"tandem_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc",
		"Fraction of the KV cache's blocks in use, from 0 to 1."}
	NamePreemptions = MetricName{"tandem_preemptions_total", "vllm:num_preemptions_total",
		"Requests sent back to waiting for lack of KV blocks."}
)

// MetricNames lists every request-level metric.
var MetricNames = []MetricName{NameTTFT, NameITL, NameE2E, NameQueue, NamePrefill, NameDecode, NameInference,
	NamePromptTokens, NameGenerationTokens, NameFinished, NameRunning, NameWaiting, NameKVUsage, NamePreemptions}

// vLLM's buckets.
var (
	ttftBuckets = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
		20.0, 40.0, 80.0, 160.0, 640.0, 2560.0}
	itlBuckets = []float64{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
		20.0, 40.0, 80.0}
	requestBuckets = []float64{0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
		240.0, 480.0, 960.0, 1920.0, 7680.0}
)

// MetricsConfig configures Metrics.
type MetricsConfig struct {
	// ModelName is the model_name label of the vLLM-named metrics.
	ModelName string
	// VLLMNames also exports every metric under vLLM's name, with vLLM's
	// labels (model_name, engine="0", finished_reason).
	VLLMNames bool
	// Engine is the scheduler's state now; false while no scheduler runs
	// on this node (it does not lead), when the gauges are left out.
	Engine func() (sched.Stats, bool)
	// Counters count the preemptions of every scheduler the process runs
	// (nil: none counted).
	Counters *sched.Counters
}

// Metrics are the request-level metrics of the leader, recorded by the
// frontend for every API: vLLM's set (see MetricNames), whose counters
// and histograms live as long as the process, whatever pipelines come and
// go. It is a prometheus.Collector.
type Metrics struct {
	cfg                                               MetricsConfig
	ttft, itl, e2e, queue, prefill, decode, inference histograms
	prompt, generation                                counters
	finished                                          map[string]counters
	finishedVecs                                      []*prometheus.CounterVec
	gauges                                            []gauge
}

// NewMetrics returns the metrics, all zero.
func NewMetrics(cfg MetricsConfig) *Metrics {
	m := &Metrics{cfg: cfg, finished: map[string]counters{}}
	m.ttft = m.histograms(NameTTFT, ttftBuckets)
	m.itl = m.histograms(NameITL, itlBuckets)
	m.e2e = m.histograms(NameE2E, requestBuckets)
	m.queue = m.histograms(NameQueue, requestBuckets)
	m.prefill = m.histograms(NamePrefill, requestBuckets)
	m.decode = m.histograms(NameDecode, requestBuckets)
	m.inference = m.histograms(NameInference, requestBuckets)
	m.prompt = m.counters(NamePromptTokens)
	m.generation = m.counters(NameGenerationTokens)
	tv := prometheus.NewCounterVec(prometheus.CounterOpts{Name: NameFinished.Tandem, Help: NameFinished.Help}, []string{"reason"})
	m.finishedVecs = append(m.finishedVecs, tv)
	var vv *prometheus.CounterVec
	if cfg.VLLMNames {
		vv = prometheus.NewCounterVec(prometheus.CounterOpts{Name: NameFinished.VLLM, Help: NameFinished.Help, ConstLabels: m.vllmLabels()}, []string{"finished_reason"})
		m.finishedVecs = append(m.finishedVecs, vv)
	}
	for _, r := range []string{sched.FinishStop, sched.FinishLength, reasonAbort} {
		c := counters{tv.WithLabelValues(r)}
		if vv != nil {
			c = append(c, vv.WithLabelValues(r))
		}
		m.finished[r] = c
	}
	for _, g := range []struct {
		name  MetricName
		value func(sched.Stats) float64
	}{
		{NameRunning, func(s sched.Stats) float64 { return float64(s.Running) }},
		{NameWaiting, func(s sched.Stats) float64 { return float64(s.Waiting) }},
		{NameKVUsage, func(s sched.Stats) float64 {
			if s.KVBlocks == 0 {
				return 0
			}
			return float64(s.KVBlocksUsed) / float64(s.KVBlocks)
		}},
	} {
		m.gauges = append(m.gauges, gauge{descs: m.descs(g.name), value: g.value})
	}
	return m
}

// vllmLabels are the labels vLLM puts on every metric.
func (m *Metrics) vllmLabels() prometheus.Labels {
	return prometheus.Labels{"model_name": m.cfg.ModelName, "engine": "0"}
}

// histograms is one histogram under tandem's name, and vLLM's when asked.
type histograms []prometheus.Histogram

func (m *Metrics) histograms(n MetricName, buckets []float64) histograms {
	h := histograms{prometheus.NewHistogram(prometheus.HistogramOpts{Name: n.Tandem, Help: n.Help, Buckets: buckets})}
	if m.cfg.VLLMNames {
		h = append(h, prometheus.NewHistogram(prometheus.HistogramOpts{Name: n.VLLM, Help: n.Help, Buckets: buckets, ConstLabels: m.vllmLabels()}))
	}
	return h
}

func (h histograms) observe(d time.Duration) {
	for _, x := range h {
		x.Observe(d.Seconds())
	}
}

// counters is one counter under tandem's name, and vLLM's when asked.
type counters []prometheus.Counter

func (m *Metrics) counters(n MetricName) counters {
	c := counters{prometheus.NewCounter(prometheus.CounterOpts{Name: n.Tandem, Help: n.Help})}
	if m.cfg.VLLMNames {
		c = append(c, prometheus.NewCounter(prometheus.CounterOpts{Name: n.VLLM, Help: n.Help, ConstLabels: m.vllmLabels()}))
	}
	return c
}

func (c counters) add(v int) {
	for _, x := range c {
		x.Add(float64(v))
	}
}

// gauge is a value read from the scheduler at every scrape.
type gauge struct {
	descs []*prometheus.Desc
	value func(sched.Stats) float64
}

// descs are the descriptions of a metric read at scrape time, under
// tandem's name and vLLM's when asked.
func (m *Metrics) descs(n MetricName) []*prometheus.Desc {
	d := []*prometheus.Desc{prometheus.NewDesc(n.Tandem, n.Help, nil, nil)}
	if m.cfg.VLLMNames {
		d = append(d, prometheus.NewDesc(n.VLLM, n.Help, nil, m.vllmLabels()))
	}
	return d
}

// collectors are the metrics that keep their own values.
func (m *Metrics) collectors() []prometheus.Collector {
	var cs []prometheus.Collector
	for _, h := range []histograms{m.ttft, m.itl, m.e2e, m.queue, m.prefill, m.decode, m.inference} {
		for _, x := range h {
			cs = append(cs, x)
		}
	}
	for _, c := range []counters{m.prompt, m.generation} {
		for _, x := range c {
			cs = append(cs, x)
		}
	}
	for _, v := range m.finishedVecs {
		cs = append(cs, v)
	}
	return cs
}

// preemptionDescs describe the preemption counter.
func (m *Metrics) preemptionDescs() []*prometheus.Desc { return m.descs(NamePreemptions) }

// Describe implements prometheus.Collector.
func (m *Metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, c := range m.collectors() {
		c.Describe(ch)
	}
	for _, g := range m.gauges {
		for _, d := range g.descs {
			ch <- d
		}
	}
	for _, d := range m.preemptionDescs() {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (m *Metrics) Collect(ch chan<- prometheus.Metric) {
	for _, c := range m.collectors() {
		c.Collect(ch)
	}
	if m.cfg.Counters != nil {
		for _, d := range m.preemptionDescs() {
			ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(m.cfg.Counters.Preemptions()))
		}
	}
	if m.cfg.Engine == nil {
		return
	}
	st, ok := m.cfg.Engine()
	if !ok {
		return
	}
	for _, g := range m.gauges {
		for _, d := range g.descs {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, g.value(st))
		}
	}
}

// record is one request's timeline, reported to the metrics (m nil:
// nothing is reported).
type record struct {
	m *Metrics
	// arrival is when the frontend took the request; scheduled when the
	// scheduler first ran it; first and last when its first and latest
	// tokens came back to the scheduler.
	arrival, scheduled, first, last time.Time
	prompt, generated               int
	finished                        bool
}

// token records a token.
func (r *record) token(o sched.Output, now time.Time) {
	at := o.Time
	if at.IsZero() {
		at = now
	}
	if r.generated == 0 {
		r.first, r.scheduled = at, o.Scheduled
		if r.scheduled.IsZero() {
			r.scheduled = at
		}
		if r.m != nil {
			r.m.ttft.observe(at.Sub(r.arrival))
			r.m.prompt.add(r.prompt)
		}
	} else if r.m != nil {
		r.m.itl.observe(at.Sub(r.last))
	}
	r.last = at
	r.generated++
	if r.m != nil {
		r.m.generation.add(1)
	}
}

// finish records the end of the request, once: a finish reason of the
// scheduler's, or reasonAbort.
func (r *record) finish(reason string, now time.Time) {
	if r.finished {
		return
	}
	r.finished = true
	if r.m == nil {
		return
	}
	r.m.finished[reason].add(1)
	if reason == reasonAbort || r.generated == 0 {
		return
	}
	r.m.e2e.observe(now.Sub(r.arrival))
	r.m.queue.observe(r.scheduled.Sub(r.arrival))
	r.m.prefill.observe(r.first.Sub(r.scheduled))
	r.m.decode.observe(r.last.Sub(r.first))
	r.m.inference.observe(r.last.Sub(r.scheduled))
}
