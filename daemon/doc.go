// Package daemon is tandemd's core: one node of a cluster that serves a
// model by pipeline parallelism.
//
// Every daemon joins the cluster by gossip (package membership),
// announcing its backend, memory, addresses and model identity, and
// offers a stage slot through the internal gRPC service tandem.v1.Node
// (package stagehost). One member is the leader: the one named in the
// configuration, or the leader-eligible live member with the smallest
// name. The leader's supervisor (package supervise) places the model's
// layers over the stage nodes (package placement: by memory, for the
// largest KV capacity; a node too small to hold a layer, or whose KV
// cache would be the pipeline's smallest, is left out, and the leader's
// log and status say which and why), has each load its
// range (Node.Load), capture the CUDA graphs it will dispatch
// (Node.Capture), and wire its links (Node.Connect, then Node.Join for
// NCCL links), dials every stage's control link (package pipeline) and
// runs the request loop (package sched: continuous batching over the
// stages' paged KV caches); its request frontend (package frontend)
// validates requests and streams their text. Every step of the pipeline goes to every stage
// with the leader's epoch; stages refuse older epochs, so a stale leader
// cannot drive them. The leader alone knows every request's tokens; stages
// hold only caches, so a pipeline can always be rebuilt from the leader's
// state.
//
// # Backends and links
//
// A node's stage runs on the CPU (package stage/cpu) or on one GPU
// (stage/cuda): stage.backend cpu, cuda, or auto (the default), which
// takes the GPU when a CUDA driver and the configured device are there and
// otherwise logs "using CPU backend: ..." with the reason. The daemon opens
// the GPU at start, gossips its name and memory, and sizes each stage's KV
// cache from the memory it may use, after holding back stage.graph_memory
// for CUDA graphs; compiled kernels are cached in stage.cache_dir,
// $TANDEM_CACHE_DIR or systemd's $CACHE_DIRECTORY. stage.compensated_tokens
// trades a CUDA stage's precision for speed: its steps of up to that many
// token rows (default 16) carry the GEMMs' activations to about 16 bits,
// larger ones round them to bf16 as transformers' bf16 model does (-1:
// every step carries them). Activations go from each
// stage to the next over NCCL between two CUDA stages (a two-rank
// communicator per link: the sender makes the id at Connect, the leader
// hands it to the receiver's Join, both join within a minute; a lost peer
// aborts the communicator and fails the step, and the leader releases the
// stages of a stopped pipeline so none waits on a dead link), and over TCP
// otherwise, a CUDA end staging through host memory. Both backends send
// float32 activations; the leader refuses neighbours whose element types
// differ.
//
// # CUDA graphs and hand-off
//
// The leader reduces stage.graph_mode (default FULL_AND_PIECEWISE) to what
// every stage supports (graphs.Resolve, each reduction logged: a CPU stage
// makes it NONE), builds a graphs.Dispatcher over the capture sizes, has
// the CUDA stages capture its keys before they are wired, and dispatches
// once per step: every step carries its runtime mode and padded
// descriptor (stage.Batch.Graph), every stage obeys it, and a stage that
// cannot replay it fails the step, which fails the pipeline rather than
// hanging it. Admin.Graphs reports the dispatch counts (tandemctl graphs);
// Admin.Status each stage's graph memory and capture time; /metrics both
// (see Metrics). With stage.handoff (default true) and a first stage that
// takes hand-offs (stage.HandoffReceiver), the last stage sends
// its sampled tokens straight to the first over a ring link (NCCL between
// CUDA stages, else TCP; none for a single stage) and the scheduler keeps
// one more step in flight than there are stages, feeding decodes whose
// input the first stage fills on its own. Admin.Trace records the leader's
// next steps as a Chrome trace, every stage timing its own part
// (package daemon/steptrace; tandemctl trace), and Admin.Status gives each
// stage's busy time from the same timings.
//
// Package daemon wires these: configuration, lifecycle, the gRPC server,
// membership, health, metrics and systemd.
//
// Clients call the leader's tandem.v1.Inference (Generate) and
// tandem.v1.Admin (Status, Graphs; Drain, Undrain, Rebalance) services,
// with gRPC health (NOT_SERVING until a
// pipeline is ready and while draining) and server reflection. Domain
// errors become gRPC codes in one place (package apierr): INVALID_ARGUMENT for
// bad requests (a text prompt longer than any prompt of the context can
// be is refused before it is encoded), RESOURCE_EXHAUSTED for a request
// that can never fit the pipeline (sched.ErrTooLarge, naming the model's
// length or the KV capacity) and for one past the waiting queue
// (stage.max_num_waiting, sched.ErrQueueFull; HTTP 429), INTERNAL naming
// the stage for a request a stage could not serve while the others went
// on (sched.ErrRequestFailed; HTTP 500), UNAVAILABLE when no pipeline can
// serve. When an admin token is configured, Admin and Node calls must
// carry it; TLS is served when a certificate is configured. The gRPC
// server bounds each connection's concurrent streams to twice the waiting
// queue plus a full batch, and its messages to twice the largest valid
// request (1 to 4 MiB; the OpenAI API's bodies likewise, 1 to 16 MiB),
// so the leader's memory stays bounded under overload.
//
// # Security
//
// Every internal channel proves it comes from the cluster with a
// credential derived from the cluster secret (package linkauth):
// cluster.key_file, else the gossip key. The leader's calls of the Node
// service (package nodeauth, nodecalls.go) carry an HMAC over the caller's
// name, the method, the internal protocol versions, the time, a nonce and
// the request's bytes; a node refuses a call without one, with another
// secret, a replay, or a clock more than 5 minutes off, and obeys only the
// node its membership names leader (PERMISSION_DENIED otherwise, after
// waiting 2 s for its view to agree). The leader's control link to each
// stage and the data links between stages run a mutual challenge-response
// bound to the link's name and the epoch before any step or activation
// passes; a refused connection is logged and the stage waits for the right
// peer. Gossip is encrypted with the gossip key, or a key derived from the
// cluster secret. Members gossip their internal protocol versions
// (nodewire.Protocol); the leader places no stage node that speaks others,
// saying so in its status, and every handshake refuses another version
// naming both. Without a secret, every listener must be on loopback
// (config validation) unless security.insecure (--insecure), which logs a
// warning: then anyone who reaches the ports can drive the node. The
// public APIs (Inference, the OpenAI HTTP API, /metrics) are not
// authenticated by the cluster secret: an admin token guards Admin, TLS
// protects the gRPC listener.
//
// With listen.http set (default off) the daemon also serves the
// OpenAI-compatible HTTP API (package openai) and /metrics on that
// listener. Both APIs go through one request frontend (package frontend),
// which owns the text (detokenisation, stop strings), applies the
// checkpoint's generation_config.json defaults, records the request
// metrics, and maps the domain errors onto the HTTP statuses in one place
// (400 bad request or never fits, 503 no pipeline or draining). A node
// that does not lead answers 503 naming the leader. The model's name in
// the API is model_name, else the model directory's name. A client
// connection to the gRPC or HTTP listeners with no request in flight for
// listen.idle_timeout (default 5m) is closed; clients reconnect on their
// next request.
//
// A lost stage costs no request. When a stage node dies, hangs (a step
// past cluster.step_timeout) or its link breaks, the leader rebuilds a
// pipeline at a new epoch over the live stage nodes that can hold the
// model, and every running request re-prefills its prompt and the tokens
// already streamed there and goes on: its stream stays open, with no
// token repeated or skipped, and greedy and seeded outputs are those of an
// uninterrupted run. While no pipeline serves, the accepted requests wait
// and new ones queue, for cluster.recovery_timeout (default 60s); then
// they fail with UNAVAILABLE naming why, and new requests fail at once
// until a pipeline serves again. A stage node that leaves (SIGTERM) is a
// planned removal: the leader builds a pipeline without it and moves the
// requests there, or, when none is possible, lets them finish first. With
// cluster.auto_rebalance (default on) a restarted node rejoins the
// pipeline once the membership has been stable for a few seconds. Nodes
// keep retrying their seeds, so members find each other again after any
// restart, in any order.
//
// The pipeline moves live: Admin.Drain takes a stage node out of
// placement (it stays a member), Admin.Undrain puts it back (the
// rebalance follows at once with auto_rebalance), Admin.Rebalance moves to
// the balanced placement or an explicit plan (and with
// cluster.balance_by_time_after the leader moves to the placement the
// stages' own times call for by itself, once they have measured that
// long); each waits for the move and
// answers the layer maps before and after, the time it took and the
// requests re-prefilled; other nodes answer UNAVAILABLE naming the
// leader. A move builds the new pipeline beside the serving one: each
// stage node keeps its stage of it running while it loads the new one
// where its memory holds both (CPU stages; a CUDA stage sizes its KV cache
// from the device's free memory, so it releases its old stage first), and
// reuses a stage whose layers and batch bounds do not change (no reload;
// package stagehost). The requests switch at a step boundary, re-prefill
// on the new pipeline, and the old stages are released. Status shows the
// drained nodes, the stage nodes placement left out (and why) and the
// last change (start, recovery, move or rebalance: when, why, how long,
// the requests and tokens re-prefilled).
//
// When the leader dies (with no fixed cluster.leader), the leader-eligible
// live member with the next smallest name leads once gossip declares it
// dead (about 6s at the default LAN timings), and builds a pipeline over
// the stage nodes left at once: the cluster was up, so it does not wait
// for cluster.expect_stages. The requests in flight on the dead leader
// fail at their client (the leader alone held their tokens; the client
// retries on the new leader, which any other node names in its
// UNAVAILABLE answer).
//
// # Metrics
//
// With listen.metrics set (default off), Run serves Prometheus metrics
// over HTTP at /metrics from a private registry (metrics.go), and on
// listen.http too: the Go and process collectors; a collector that reads,
// at each scrape, what Admin.Status and Admin.Graphs report (on the leader
// tandem_kv_blocks_used and _total, tandem_steps_total,
// tandem_step_seconds, the CUDA-graph dispatch counts
// tandem_graph_steps_total{mode, padded_tokens, unpadded_tokens} and each
// stage's graph memory tandem_graph_memory_bytes{stage, node}; the
// counters, each node's busy time as a stage
// tandem_stage_busy_seconds_total{node, of: forward, device},
// tandem_steps_total, tandem_discarded_tokens_total,
// tandem_requests_failed_total, tandem_requests_refused_total (queue full),
// tandem_pipeline_changes_total{kind: recovery, move, rebalance},
// tandem_reprefilled_requests_total, tandem_reprefilled_tokens_total
// and the dispatch counts, count for the life of the process, whatever
// pipelines and leaderships come and go; on every node tandem_pipeline_serving and
// tandem_leader); and the frontend's request-level metrics, vLLM's set
// with vLLM's meaning and buckets, which count for the life of the
// process whatever pipelines come and go. metrics.vllm_names also exports
// them under vLLM's names, with vLLM's labels model_name (model_name) and
// engine ("0"), for the dashboards and routers that only read those:
//
//	tandem                               vLLM                                  what
//	tandem_time_to_first_token_seconds   vllm:time_to_first_token_seconds      histogram: arrival to first token
//	tandem_inter_token_latency_seconds   vllm:inter_token_latency_seconds      histogram: between two tokens of a request
//	tandem_request_latency_seconds       vllm:e2e_request_latency_seconds      histogram: arrival to last token
//	tandem_request_queue_seconds         vllm:request_queue_time_seconds       histogram: arrival to first scheduled
//	tandem_request_prefill_seconds       vllm:request_prefill_time_seconds     histogram: first scheduled to first token
//	tandem_request_decode_seconds        vllm:request_decode_time_seconds      histogram: first token to last
//	tandem_request_inference_seconds     vllm:request_inference_time_seconds   histogram: first scheduled to last token
//	tandem_prompt_tokens_total           vllm:prompt_tokens_total              counter: prompt tokens (at first token)
//	tandem_generation_tokens_total       vllm:generation_tokens_total          counter: tokens generated
//	tandem_requests_finished_total       vllm:request_success_total            counter by reason (finished_reason): stop, length, abort
//	tandem_requests_running              vllm:num_requests_running             gauge: admitted, holding KV blocks
//	tandem_requests_waiting              vllm:num_requests_waiting             gauge: waiting for admission or preempted
//	tandem_kv_cache_usage_ratio          vllm:kv_cache_usage_perc              gauge: fraction of KV blocks in use, 0 to 1
//	tandem_preemptions_total             vllm:num_preemptions_total            counter: requests sent back to waiting
//
// Buckets (vLLM's): time to first token 0.001 to 2560 s (22), inter-token
// latency 0.01 to 80 s (19), the request times 0.3 to 7680 s (21). The
// latency, queue, prefill, decode and inference histograms count the
// requests that finished with a reason; abort counts requests that ended
// without (the client left, the pipeline failed). Token times are when
// the token's step came back to the scheduler. No secret is exported.
//
// # Usage
//
//	cfg, err := daemon.LoadConfig("/etc/tandem/tandemd.toml")
//	...
//	d, err := daemon.New(cfg, slog.Default())
//	...
//	err = d.Run(ctx) // until ctx is cancelled; then drains and returns
//
// testdata/tandemd.toml is a commented example configuration.
//
// # Concurrency
//
// New starts nothing. Run owns the daemon: it starts the gRPC server, the
// HTTP servers of listen.metrics and listen.http (scrapes read the
// supervisor's snapshot and the state under Daemon.mu; each API request
// runs on its handler's goroutine), the membership, the supervisor (its
// loop alone decides leadership and builds, switches and closes
// pipelines; its engine's sched.Loop is the only user of the current
// pipeline's driver; Generate calls and API requests submit requests to
// it and read their token streams, so it never waits on a client; see
// package supervise), and the stage slot (per assigned stage one
// goroutine; see package stagehost). A stage's GPU is driven through its
// gpu.Device goroutine. Daemon.mu guards the state shared with RPC
// handlers. When Run returns, every goroutine it started has ended.
package daemon
