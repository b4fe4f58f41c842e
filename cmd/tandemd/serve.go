package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/tandem-llm/tandem/daemon"
	"github.com/tandem-llm/tandem/progress"
	"github.com/tandem-llm/tandem/sched"
	"github.com/tandem-llm/tandem/stage"
)

// serveFlags are the flags of tandemd serve; each overrides its key of the
// configuration file when given.
type serveFlags struct {
	config      string
	cfg         daemon.Config
	stage       bool
	memory      string
	seeds       []string
	graphMemory string
	handoff     bool
	progress    string
	rebalance   bool
	recovery    time.Duration
	stepTimeout time.Duration
	balance     time.Duration
	idleTimeout time.Duration
	vllmNames   bool
}

func newServeCmd() *cobra.Command {
	var o serveFlags
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Run one node of a tandem cluster",
		Long: `Run one node of a tandem cluster: join the cluster by gossip, serve a
pipeline stage when the leader assigns one, and, on the leader, serve the
gRPC API (Inference, Admin, health, reflection) and, with --http, the
OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions,
/v1/models, /health, /tokenize, /detokenize, /metrics). Prints
"listening grpc=ADDR gossip=ADDR" on stdout once listening, followed by
" http=ADDR" when the HTTP API is on. SIGTERM or SIGINT drains (requests in
flight finish), leaves the cluster and exits 0.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := o.resolve(cmd.Flags())
			if err != nil {
				return err
			}
			mode, err := progress.ParseMode(o.progress)
			if err != nil {
				return fmt.Errorf("--progress: %w", err)
			}
			return runServe(cmd.Context(), cfg, mode, cmd.OutOrStdout())
		},
	}
	o.register(cmd.Flags())
	return cmd
}

// register defines the flags of tandemd serve on f, bound to o.
func (o *serveFlags) register(f *pflag.FlagSet) {
	c := &o.cfg
	f.StringVar(&o.config, "config", "", "TOML configuration file (flags override its keys)")
	f.StringVar(&c.Name, "name", "", "node name, unique in the cluster (default: the host name)")
	f.StringVar(&c.Model, "model", "", "Hugging Face model directory")
	f.StringVar(&c.ModelName, "model-name", "", "the model's name in the OpenAI API (default: the model directory's name)")
	f.StringVar(&c.Listen.GRPC, "grpc", daemon.DefaultGRPCAddr, "gRPC listen address")
	f.StringVar(&c.Listen.Gossip, "gossip", daemon.DefaultGossipAddr, "gossip listen address (IP:port)")
	f.StringVar(&c.Listen.Control, "control", "127.0.0.1:0", "listen address of the stage's control link from the leader")
	f.StringVar(&c.Listen.Data, "data", "127.0.0.1:0", "listen address of the stage's activations from the previous stage")
	f.StringVar(&c.Listen.Advertise, "advertise", "", "host other nodes reach this one at")
	f.StringVar(&c.Listen.Metrics, "metrics", "", "Prometheus metrics listen address, served at /metrics (default: off), e.g. 127.0.0.1:9400")
	f.StringVar(&c.Listen.HTTP, "http", "", "OpenAI-compatible HTTP API listen address, with /metrics (default: off), e.g. 127.0.0.1:8000")
	f.DurationVar(&o.idleTimeout, "idle-timeout", daemon.DefaultIdleTimeout, "close a gRPC or HTTP client connection with no request in flight for this long")
	f.BoolVar(&o.vllmNames, "vllm-metric-names", false, "also export the request-level metrics under vLLM's names (vllm:...)")
	f.StringSliceVar(&o.seeds, "seeds", nil, "gossip addresses of members to join through (comma-separated)")
	f.StringVar(&c.Cluster.Leader, "leader", "", "the leader's name (default: the eligible member with the smallest name)")
	f.IntVar(&c.Cluster.ExpectStages, "expect-stages", 1, "stage nodes the leader waits for before placing the model")
	f.BoolVar(&c.Cluster.FastFailureDetection, "fast-gossip", false, "loopback gossip timings: dead nodes noticed within seconds")
	f.StringVar(&c.Cluster.GossipKeyFile, "gossip-key-file", "", "file holding the base64 gossip encryption key (also the cluster secret without --cluster-key-file)")
	f.StringVar(&c.Cluster.KeyFile, "cluster-key-file", "", "file holding the base64 cluster secret, the same on every node (openssl rand -base64 32): internal calls and links prove they come from the cluster, gossip is encrypted")
	f.DurationVar(&o.recovery, "recovery-timeout", daemon.DefaultRecoveryTimeout, "how long requests wait for a new pipeline after a stage is lost before they fail")
	f.DurationVar(&o.stepTimeout, "step-timeout", daemon.DefaultStepTimeout, "a pipeline step whose result takes longer fails the pipeline (a hung stage), which is rebuilt")
	f.BoolVar(&o.rebalance, "auto-rebalance", true, "move the pipeline when a restarted or undrained node can rejoin, or the KV capacity would rise by 10% or more")
	f.DurationVar(&o.balance, "balance-by-time-after", 0, "once every stage has spent this long in its steps, divide the layers so that the stages take even times, when that makes the slowest 10% faster or more (0: only when asked, tandemctl rebalance --by-time)")
	f.BoolVar(&o.stage, "stage", true, "offer a pipeline stage (--stage=false: only lead)")
	f.StringVar(&o.memory, "memory", "", "memory the stage may use, e.g. 8GiB (default: 90% of the available memory)")
	f.IntVar(&c.Stage.MaxBatchTokens, "max-batch-tokens", daemon.DefaultMaxBatchTokens, "most tokens in one step")
	f.IntVar(&c.Stage.MaxSeqs, "max-seqs", daemon.DefaultMaxSeqs, "most sequences in one step")
	f.IntVar(&c.Stage.BlockSize, "block-size", daemon.DefaultBlockSize, "positions of one paged KV-cache block (the leader's setting)")
	f.IntVar(&c.Stage.MaxNumWaiting, "max-num-waiting", 0, fmt.Sprintf("requests the leader queues for admission; more are refused with RESOURCE_EXHAUSTED / HTTP 429 (0: %d; -1: no bound)", sched.DefaultMaxNumWaiting))
	f.IntVar(&c.Stage.GrowthReserve, "growth-reserve", 0, "positions of growth admission leaves room for in every running request besides its expected length (0: one KV block; -1: admit whatever fits now)")
	f.IntVar(&c.Stage.MaxPreemptions, "max-preemptions", 0, fmt.Sprintf("how often one request may be preempted while another can be in its place (0: %d)", sched.DefaultMaxPreemptions))
	f.StringVar(&c.Stage.Backend, "backend", daemon.BackendAuto, "stage backend: cpu, cuda, or auto (cuda when a GPU is usable)")
	f.IntVar(&c.Stage.Device, "device", 0, "GPU ordinal of a cuda stage (among CUDA_VISIBLE_DEVICES)")
	f.StringVar(&c.Stage.GraphMode, "graph-mode", "FULL_AND_PIECEWISE", "CUDA-graph mode: NONE, PIECEWISE, FULL, FULL_DECODE_ONLY or FULL_AND_PIECEWISE")
	f.IntSliceVar(&c.Stage.CaptureSizes, "capture-sizes", nil, "token counts to capture CUDA graphs for (default 1,2,4,8,16,... up to --max-capture-size)")
	f.IntVar(&c.Stage.MaxCaptureSize, "max-capture-size", 0, "largest CUDA-graph capture size (default: min(512, --max-batch-tokens))")
	f.StringVar(&o.graphMemory, "graph-memory", "", "device memory held back for CUDA graphs (default 512MiB)")
	f.BoolVar(&o.handoff, "handoff", true, "on-device hand-off of sampled tokens from the last stage to the first (one more step in flight)")
	f.StringVar(&o.progress, "progress", string(progress.Auto), "how loading, kernel compilation and graph capture show their progress: bar (on stderr), log (lines), or auto (bar when stderr is a terminal)")
	f.StringVar(&c.Stage.CacheDir, "cache-dir", "", "compiled CUDA kernel cache (default: $TANDEM_CACHE_DIR, $CACHE_DIRECTORY or the user cache)")
	f.IntVar(&c.Stage.CompensatedTokens, "compensated-tokens", daemon.DefaultCompensatedTokens, "most token rows of a CUDA step whose GEMMs carry the activations to about 16 bits; larger steps round them to bf16 (-1: every step)")
	f.StringVar(&c.Security.TLSCertFile, "tls-cert", "", "TLS certificate file (serve TLS)")
	f.StringVar(&c.Security.TLSKeyFile, "tls-key", "", "TLS key file")
	f.StringVar(&c.Security.TLSCAFile, "tls-ca", "", "CA file verifying other nodes' certificates")
	f.StringVar(&c.Security.AdminTokenFile, "admin-token-file", "", "file holding the admin token")
	f.BoolVar(&c.Security.Insecure, "insecure", false, "allow listening beyond loopback without a cluster secret (anyone who reaches the ports can drive this node)")
}

// resolve reads the configuration file, if any, and applies the flags that
// were given.
func (o *serveFlags) resolve(fs *pflag.FlagSet) (daemon.Config, error) {
	cfg := o.cfg
	if o.config != "" {
		var err error
		if cfg, err = daemon.LoadConfig(o.config); err != nil {
			return cfg, err
		}
	}
	set := func(name string, apply func()) {
		if o.config == "" || fs.Changed(name) {
			apply()
		}
	}
	c := &o.cfg
	set("name", func() { cfg.Name = c.Name })
	set("model", func() { cfg.Model = c.Model })
	set("model-name", func() { cfg.ModelName = c.ModelName })
	set("grpc", func() { cfg.Listen.GRPC = c.Listen.GRPC })
	set("gossip", func() { cfg.Listen.Gossip = c.Listen.Gossip })
	set("control", func() { cfg.Listen.Control = c.Listen.Control })
	set("data", func() { cfg.Listen.Data = c.Listen.Data })
	set("advertise", func() { cfg.Listen.Advertise = c.Listen.Advertise })
	set("metrics", func() { cfg.Listen.Metrics = c.Listen.Metrics })
	set("http", func() { cfg.Listen.HTTP = c.Listen.HTTP })
	set("idle-timeout", func() { cfg.Listen.IdleTimeout = daemon.Duration(o.idleTimeout) })
	set("vllm-metric-names", func() { cfg.Metrics.VLLMNames = o.vllmNames })
	set("seeds", func() { cfg.Cluster.Seeds = o.seeds })
	set("leader", func() { cfg.Cluster.Leader = c.Cluster.Leader })
	set("expect-stages", func() { cfg.Cluster.ExpectStages = c.Cluster.ExpectStages })
	set("fast-gossip", func() { cfg.Cluster.FastFailureDetection = c.Cluster.FastFailureDetection })
	set("gossip-key-file", func() { cfg.Cluster.GossipKeyFile = c.Cluster.GossipKeyFile })
	set("cluster-key-file", func() { cfg.Cluster.KeyFile = c.Cluster.KeyFile })
	set("recovery-timeout", func() { cfg.Cluster.RecoveryTimeout = daemon.Duration(o.recovery) })
	set("step-timeout", func() { cfg.Cluster.StepTimeout = daemon.Duration(o.stepTimeout) })
	set("auto-rebalance", func() { cfg.Cluster.AutoRebalance = &o.rebalance })
	set("balance-by-time-after", func() { cfg.Cluster.BalanceByTimeAfter = daemon.Duration(o.balance) })
	set("stage", func() { cfg.Stage.Enabled = &o.stage })
	set("max-batch-tokens", func() { cfg.Stage.MaxBatchTokens = c.Stage.MaxBatchTokens })
	set("max-seqs", func() { cfg.Stage.MaxSeqs = c.Stage.MaxSeqs })
	set("block-size", func() { cfg.Stage.BlockSize = c.Stage.BlockSize })
	set("max-num-waiting", func() { cfg.Stage.MaxNumWaiting = c.Stage.MaxNumWaiting })
	set("growth-reserve", func() { cfg.Stage.GrowthReserve = c.Stage.GrowthReserve })
	set("max-preemptions", func() { cfg.Stage.MaxPreemptions = c.Stage.MaxPreemptions })
	set("backend", func() { cfg.Stage.Backend = c.Stage.Backend })
	set("device", func() { cfg.Stage.Device = c.Stage.Device })
	set("graph-mode", func() { cfg.Stage.GraphMode = c.Stage.GraphMode })
	set("capture-sizes", func() { cfg.Stage.CaptureSizes = c.Stage.CaptureSizes })
	set("max-capture-size", func() { cfg.Stage.MaxCaptureSize = c.Stage.MaxCaptureSize })
	set("handoff", func() { cfg.Stage.Handoff = &o.handoff })
	set("cache-dir", func() { cfg.Stage.CacheDir = c.Stage.CacheDir })
	set("compensated-tokens", func() { cfg.Stage.CompensatedTokens = c.Stage.CompensatedTokens })
	set("tls-cert", func() { cfg.Security.TLSCertFile = c.Security.TLSCertFile })
	set("tls-key", func() { cfg.Security.TLSKeyFile = c.Security.TLSKeyFile })
	set("tls-ca", func() { cfg.Security.TLSCAFile = c.Security.TLSCAFile })
	set("admin-token-file", func() { cfg.Security.AdminTokenFile = c.Security.AdminTokenFile })
	set("insecure", func() { cfg.Security.Insecure = c.Security.Insecure })
	if fs.Changed("memory") {
		m, err := daemon.ParseByteSize(o.memory)
		if err != nil {
			return cfg, fmt.Errorf("--memory: %w", err)
		}
		cfg.Stage.Memory = m
	}
	if fs.Changed("graph-memory") {
		m, err := daemon.ParseByteSize(o.graphMemory)
		if err != nil {
			return cfg, fmt.Errorf("--graph-memory: %w", err)
		}
		cfg.Stage.GraphMemory = m
	}
	return cfg, nil
}

// wrapStage, when set, wraps the stages the daemon serves
// (daemon.Config.WrapStage): nil in tandemd, set by the tests' TestMain.
var wrapStage func(stage.Stage) stage.Stage

// runServe runs the daemon until ctx is cancelled. Progress shows as the
// mode says; while bars are drawn on stderr, log lines go above them.
func runServe(ctx context.Context, cfg daemon.Config, mode progress.Mode, stdout io.Writer) error {
	cfg.Progress = progress.New(progress.Config{Mode: mode, Out: os.Stderr})
	cfg.WrapStage = wrapStage
	if cfg.Progress.Bars() {
		slog.SetDefault(newLogger(cfg.Progress.Writer()))
	}
	d, err := daemon.New(cfg, slog.Default())
	if err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	select {
	case <-d.Listening():
		a := d.Addrs()
		line := fmt.Sprintf("listening grpc=%s gossip=%s", a.GRPC, a.Gossip)
		if a.HTTP != "" {
			line += " http=" + a.HTTP
		}
		fmt.Fprintln(stdout, line)
		return <-done
	case err := <-done:
		return err
	}
}
