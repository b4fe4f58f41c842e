package daemon

import (
	"bytes"
	"encoding/base64"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/pelletier/go-toml/v2"

	"github.com/tandem-llm/tandem/daemon/openai"
	"github.com/tandem-llm/tandem/daemon/stagehost"
	"github.com/tandem-llm/tandem/daemon/supervise"
	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/linkauth"
	"github.com/tandem-llm/tandem/progress"
	"github.com/tandem-llm/tandem/sched"
	"github.com/tandem-llm/tandem/stage"
	"github.com/tandem-llm/tandem/stage/cuda"
)

// Config is a daemon's configuration, read from a TOML file by LoadConfig
// (unknown keys are errors) and overridden by flags. Secrets are named by
// file (admin token, gossip key, TLS key), so the configuration itself can
// be logged: LogValue leaves secrets out.
type Config struct {
	// Name is the node's name, unique in the cluster (default: the host
	// name).
	Name string `toml:"name"`
	// Model is the local Hugging Face model directory. Every node needs its
	// own copy: the leader checks that the identities match.
	Model string `toml:"model"`
	// ModelName is the model's name in the OpenAI API ("model" of
	// requests, /v1/models; default: the model directory's name).
	ModelName string `toml:"model_name"`

	Listen   ListenConfig   `toml:"listen"`
	Metrics  MetricsConfig  `toml:"metrics"`
	Cluster  ClusterConfig  `toml:"cluster"`
	Stage    StageConfig    `toml:"stage"`
	Security SecurityConfig `toml:"security"`
	// Plan, when set, places the layers explicitly instead of balancing
	// them over the members' memory.
	Plan []PlanRange `toml:"plan"`

	// Progress shows how loading a stage's weights, compiling its kernels
	// and capturing its graphs advance: bars on a terminal, or lines to
	// the daemon's logger (nil: lines). Not read from the file: tandemd
	// serve sets it from --progress.
	Progress *progress.Reporter `toml:"-"`
	// WrapStage, when set, wraps each stage this node serves before its
	// pipeline worker runs it: a test seam (tandemd's multi-process tests
	// put an emulated device around CPU stages). Not read from the file.
	WrapStage func(stage.Stage) stage.Stage `toml:"-"`
}

// ListenConfig are the addresses the daemon listens on (host:port; port 0
// picks a free port). They default to loopback.
type ListenConfig struct {
	// GRPC serves Inference, Admin, Node, health and reflection.
	GRPC string `toml:"grpc"`
	// Gossip is memberlist's address (TCP and UDP).
	Gossip string `toml:"gossip"`
	// Control accepts the leader's per-step control link to this node's
	// stage; Data the previous stage's activations.
	Control string `toml:"control"`
	Data    string `toml:"data"`
	// Advertise is the host other nodes reach this one at (default: the
	// host of each listen address; required when listening on 0.0.0.0).
	Advertise string `toml:"advertise"`
	// Metrics serves Prometheus metrics over HTTP at /metrics (default
	// empty: off). Only Prometheus dials it, so it may listen on every
	// interface without listen.advertise.
	Metrics string `toml:"metrics"`
	// HTTP serves the OpenAI-compatible API on the leader (/v1/...,
	// /health, /tokenize, /detokenize) and /metrics (default empty: off).
	// Only clients dial it, so it may listen on every interface without
	// listen.advertise.
	HTTP string `toml:"http"`
	// IdleTimeout closes a client's connection to the gRPC or HTTP
	// listeners after this long without a request in flight (default 5m),
	// so that connections nobody uses do not hold the node's memory and
	// file descriptors (about 17 KB each on gRPC); a client reconnects on
	// its next request. The HTTP listener's keep-alive connections close
	// this long after their last request.
	IdleTimeout Duration `toml:"idle_timeout"`
}

// MetricsConfig shapes the metrics the daemon exports.
type MetricsConfig struct {
	// VLLMNames also exports the request-level metrics under vLLM's names
	// (vllm:time_to_first_token_seconds, ...) with vLLM's labels, for
	// dashboards and routers that read only those (default false).
	VLLMNames bool `toml:"vllm_names"`
}

// ClusterConfig is how the node finds its cluster and its leader.
type ClusterConfig struct {
	// Seeds are gossip addresses of other members to join through.
	Seeds []string `toml:"seeds"`
	// Leader fixes the leader's name; empty chooses the leader-eligible
	// live member with the smallest name (so a member joining with a
	// smaller name takes the leadership over: fix the leader to avoid it).
	Leader string `toml:"leader"`
	// LeaderEligible lets this node be chosen as leader (default true).
	LeaderEligible *bool `toml:"leader_eligible"`
	// ExpectStages is how many stage nodes the leader waits for before it
	// places the model (default 1).
	ExpectStages int `toml:"expect_stages"`
	// FastFailureDetection tunes gossip for loopback and tests: a dead node
	// is noticed within a few seconds.
	FastFailureDetection bool `toml:"fast_failure_detection"`
	// GossipKeyFile holds a base64 AES key of 16, 24 or 32 bytes; gossip is
	// encrypted when set. Without KeyFile, it is also the cluster secret.
	GossipKeyFile string `toml:"gossip_key_file"`
	// KeyFile holds the cluster secret, base64, at least 16 bytes
	// (`openssl rand -base64 32`), the same on every node: Node calls,
	// control links and data links prove with it that they come from the
	// cluster, and, without GossipKeyFile, gossip is encrypted with a key
	// derived from it. Without it the gossip key is the secret; with
	// neither, every listener must be on loopback unless
	// security.insecure.
	KeyFile string `toml:"key_file"`
	// DrainTimeout bounds how long shutdown waits for requests in flight
	// (default 30s).
	DrainTimeout Duration `toml:"drain_timeout"`
	// RecoveryTimeout bounds how long the leader's accepted requests wait
	// for a new pipeline once a stage is lost (default 60s): then they
	// fail with UNAVAILABLE naming why, and new requests fail at once
	// until a pipeline serves. Until then new requests queue.
	RecoveryTimeout Duration `toml:"recovery_timeout"`
	// StepTimeout fails a pipeline step whose result does not come within
	// it (a stopped or hung stage), so the leader rebuilds the pipeline
	// instead of waiting for gossip to declare the stage dead (default
	// 30s; it must exceed the longest step, a full prefill batch).
	StepTimeout Duration `toml:"step_timeout"`
	// AutoRebalance moves the pipeline, once the membership has been
	// stable for a few seconds, when the placement over the live stage
	// nodes restores a node lost or undrained (a restarted daemon rejoins
	// the pipeline) or raises the KV capacity by 10% or more (default
	// true).
	AutoRebalance *bool `toml:"auto_rebalance"`
	// BalanceByTimeAfter, when set, has the leader divide the layers anew
	// so that the stages take even times, as `tandemctl rebalance
	// --by-time` does, once every stage of the serving pipeline has spent
	// this long in its steps (device time on a CUDA stage), if that makes
	// the slowest stage 10% faster or more; the placement is then kept
	// until the membership changes (default 0: never, only when asked).
	BalanceByTimeAfter Duration `toml:"balance_by_time_after"`
}

// StageConfig is the stage this node offers, and how the leader runs the
// pipeline (batch bounds, CUDA graphs, hand-off).
type StageConfig struct {
	// Enabled offers a stage (default true); a node without one only leads.
	Enabled *bool `toml:"enabled"`
	// Backend is "cpu", "cuda" (fail when no GPU can be used) or "auto"
	// (the default: cuda when a CUDA driver and device are found, else cpu,
	// said at start-up with the reason).
	Backend string `toml:"backend"`
	// Device is the ordinal of the GPU a cuda stage runs on, among those
	// CUDA_VISIBLE_DEVICES shows (default 0).
	Device int `toml:"device"`
	// Memory is what the stage may use, such as "8GiB" (default: 90% of the
	// host's available memory at start, or of the GPU's free memory).
	Memory ByteSize `toml:"memory"`
	// MaxBatchTokens and MaxSeqs bound one step's batch (defaults 512, 64).
	MaxBatchTokens int `toml:"max_batch_tokens"`
	MaxSeqs        int `toml:"max_seqs"`
	// BlockSize is the positions of one paged KV-cache block (default 16,
	// at most 1024): the leader's block tables and every stage's cache use
	// it. Smaller blocks waste less of a sequence's last block; larger
	// ones make shorter tables.
	BlockSize int `toml:"block_size"`
	// GraphMode is the CUDA-graph mode the leader asks for (default
	// FULL_AND_PIECEWISE; NONE, PIECEWISE, FULL, FULL_DECODE_ONLY): it is
	// reduced to what the weakest stage supports, so a pipeline with a CPU
	// stage runs eagerly.
	GraphMode string `toml:"graph_mode"`
	// CaptureSizes are the token counts CUDA graphs are captured for
	// (default 1, 2, 4, then every multiple of 8 up to MaxCaptureSize).
	CaptureSizes []int `toml:"capture_sizes"`
	// MaxCaptureSize bounds the capture sizes (default: the largest of
	// CaptureSizes, else the smaller of 512 and max_batch_tokens).
	MaxCaptureSize int `toml:"max_capture_size"`
	// GraphMemory is the device memory a cuda stage holds back for its
	// CUDA graphs before it sizes its KV cache (default 512MiB).
	GraphMemory ByteSize `toml:"graph_memory"`
	// MaxNumWaiting bounds the requests waiting for admission on the
	// leader: more are refused with RESOURCE_EXHAUSTED (HTTP 429) (0:
	// sched.DefaultMaxNumWaiting; -1: no bound).
	MaxNumWaiting int `toml:"max_num_waiting"`
	// GrowthReserve is the least growth, in positions, admission leaves
	// room for in every running request besides its expected length (0:
	// one KV block; -1: admit whatever fits now, and preempt when it no
	// longer does).
	GrowthReserve int `toml:"growth_reserve"`
	// MaxPreemptions is how often one request may be preempted while
	// another can be in its place (0: sched.DefaultMaxPreemptions).
	MaxPreemptions int `toml:"max_preemptions"`
	// Handoff lets the last stage hand sampled tokens straight to the first
	// (default true) when the first stage can take them: the leader then
	// keeps one more step in flight than there are stages.
	Handoff *bool `toml:"handoff"`
	// CacheDir holds compiled CUDA kernels (default: $TANDEM_CACHE_DIR,
	// else systemd's $CACHE_DIRECTORY, else the user cache directory).
	CacheDir string `toml:"cache_dir"`
	// CompensatedTokens is the most token rows of a CUDA step whose GEMMs
	// carry the activations to about 16 bits (a bf16 value and its
	// rounding remainder); larger steps round them to bf16, as
	// transformers' bf16 model does (default 16, the CUDA backend's
	// cuda.DefaultCompensatedTokens; -1: every step). More rows keep
	// larger decode batches about twice as close to float32, at 4-5% of
	// their step time, and make long prefills far slower.
	CompensatedTokens int `toml:"compensated_tokens"`
}

// SecurityConfig enables TLS and the admin token.
type SecurityConfig struct {
	// TLSCertFile and TLSKeyFile make the gRPC listener serve TLS.
	TLSCertFile string `toml:"tls_cert_file"`
	TLSKeyFile  string `toml:"tls_key_file"`
	// TLSCAFile verifies the other nodes' certificates when this node calls
	// them (default: the system's roots).
	TLSCAFile string `toml:"tls_ca_file"`
	// AdminTokenFile holds the token every Admin and Node call must carry.
	AdminTokenFile string `toml:"admin_token_file"`
	// Insecure lets a node without a cluster secret (cluster.key_file or
	// cluster.gossip_key_file) listen beyond loopback, with a warning:
	// anyone who reaches its ports can then drive its stage.
	Insecure bool `toml:"insecure"`
}

// PlanRange is one stage of an explicit plan: a node and its layers [Lo,
// Hi), written layers = [lo, hi].
type PlanRange struct {
	Node   string `toml:"node"`
	Layers [2]int `toml:"layers"`
}

// Duration is a time.Duration written as a string ("30s").
type Duration time.Duration

// UnmarshalText implements encoding.TextUnmarshaler.
func (d *Duration) UnmarshalText(b []byte) error {
	v, err := time.ParseDuration(string(b))
	if err != nil {
		return err
	}
	*d = Duration(v)
	return nil
}

// MarshalText implements encoding.TextMarshaler.
func (d Duration) MarshalText() ([]byte, error) { return []byte(time.Duration(d).String()), nil }

// ByteSize is a number of bytes written as an integer or with a unit: "512MiB",
// "8GiB", "2GB".
type ByteSize uint64

var byteUnits = []struct {
	suffix string
	mult   uint64
}{
	{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40},
	{"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}, {"B", 1},
}

// ParseByteSize parses a size such as "8GiB" or "1500000".
func ParseByteSize(s string) (ByteSize, error) {
	num, mult := strings.TrimSpace(s), uint64(1)
	for _, u := range byteUnits {
		if strings.HasSuffix(num, u.suffix) {
			num, mult = strings.TrimSpace(strings.TrimSuffix(num, u.suffix)), u.mult
			break
		}
	}
	v, err := strconv.ParseFloat(num, 64)
	if err != nil || v < 0 || v*float64(mult) >= 1<<64 {
		return 0, fmt.Errorf("size %q: want a number of bytes, optionally with a unit (KiB, MiB, GiB, TiB, KB, MB, GB, TB)", s)
	}
	return ByteSize(v * float64(mult)), nil
}

// UnmarshalText implements encoding.TextUnmarshaler.
func (b *ByteSize) UnmarshalText(t []byte) error {
	v, err := ParseByteSize(string(t))
	if err != nil {
		return err
	}
	*b = v
	return nil
}

// String writes the size in the largest binary unit that divides it.
func (b ByteSize) String() string {
	for i := 3; i >= 0; i-- {
		if u := byteUnits[i]; b > 0 && uint64(b)%u.mult == 0 {
			return fmt.Sprintf("%d%s", uint64(b)/u.mult, u.suffix)
		}
	}
	return strconv.FormatUint(uint64(b), 10)
}

// Defaults of the configuration.
const (
	DefaultGRPCAddr       = "127.0.0.1:7400"
	DefaultGossipAddr     = "127.0.0.1:7401"
	DefaultMaxBatchTokens = 512
	DefaultMaxSeqs        = 64
	DefaultBlockSize      = sched.DefaultBlockSize
	maxBlockSize          = 1024
	DefaultDrainTimeout   = 30 * time.Second
	DefaultIdleTimeout    = 5 * time.Minute
	DefaultStepTimeout    = 30 * time.Second
	// DefaultRecoveryTimeout is how long requests wait for a new pipeline
	// by default.
	DefaultRecoveryTimeout = supervise.DefaultRecoveryTimeout
	DefaultGraphMemory     = 512 << 20
	// DefaultCompensatedTokens is the CUDA backend's default.
	DefaultCompensatedTokens = cuda.DefaultCompensatedTokens
)

// Stage backends of the configuration.
const (
	BackendCPU  = stagehost.BackendCPU
	BackendCUDA = stagehost.BackendCUDA
	BackendAuto = stagehost.BackendAuto
)

// LoadConfig reads a TOML configuration file. Keys it does not know are
// errors, naming the key and its line.
func LoadConfig(path string) (Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return Config{}, fmt.Errorf("read config: %w", err)
	}
	cfg, err := ParseConfig(data)
	if err != nil {
		return Config{}, fmt.Errorf("config %s: %w", path, err)
	}
	return cfg, nil
}

// ParseConfig parses a TOML configuration, rejecting unknown keys.
func ParseConfig(data []byte) (Config, error) {
	var cfg Config
	dec := toml.NewDecoder(bytes.NewReader(data)).DisallowUnknownFields()
	if err := dec.Decode(&cfg); err != nil {
		var strict *toml.StrictMissingError
		if errors.As(err, &strict) {
			var errs []error
			for _, e := range strict.Errors {
				row, _ := e.Position()
				errs = append(errs, fmt.Errorf("line %d: unknown key %s", row, strings.Join(e.Key(), ".")))
			}
			return Config{}, errors.Join(errs...)
		}
		var de *toml.DecodeError
		if errors.As(err, &de) {
			row, col := de.Position()
			return Config{}, fmt.Errorf("line %d column %d: %w", row, col, err)
		}
		return Config{}, err
	}
	return cfg, nil
}

// withDefaults fills in every default and validates the result.
func (c Config) withDefaults() (Config, error) {
	if c.Name == "" {
		h, err := os.Hostname()
		if err != nil {
			return c, fmt.Errorf("config: no name, and the host name is unknown: %w", err)
		}
		c.Name = h
	}
	def := func(s *string, v string) {
		if *s == "" {
			*s = v
		}
	}
	if c.ModelName == "" && c.Model != "" {
		c.ModelName = filepath.Base(c.Model)
	}
	def(&c.Listen.GRPC, DefaultGRPCAddr)
	def(&c.Listen.Gossip, DefaultGossipAddr)
	def(&c.Listen.Control, "127.0.0.1:0")
	def(&c.Listen.Data, "127.0.0.1:0")
	def(&c.Stage.Backend, BackendAuto)
	def(&c.Stage.GraphMode, graphs.DefaultMode.String())
	if c.Cluster.LeaderEligible == nil {
		c.Cluster.LeaderEligible = ptr(true)
	}
	if c.Stage.Enabled == nil {
		c.Stage.Enabled = ptr(true)
	}
	if c.Stage.Handoff == nil {
		c.Stage.Handoff = ptr(true)
	}
	if c.Stage.GraphMemory == 0 {
		c.Stage.GraphMemory = DefaultGraphMemory
	}
	if c.Cluster.ExpectStages == 0 {
		c.Cluster.ExpectStages = 1
	}
	if c.Cluster.DrainTimeout == 0 {
		c.Cluster.DrainTimeout = Duration(DefaultDrainTimeout)
	}
	if c.Listen.IdleTimeout == 0 {
		c.Listen.IdleTimeout = Duration(DefaultIdleTimeout)
	}
	if c.Cluster.RecoveryTimeout == 0 {
		c.Cluster.RecoveryTimeout = Duration(DefaultRecoveryTimeout)
	}
	if c.Cluster.StepTimeout == 0 {
		c.Cluster.StepTimeout = Duration(DefaultStepTimeout)
	}
	if c.Cluster.AutoRebalance == nil {
		c.Cluster.AutoRebalance = ptr(true)
	}
	if c.Stage.MaxBatchTokens == 0 {
		c.Stage.MaxBatchTokens = DefaultMaxBatchTokens
	}
	if c.Stage.MaxSeqs == 0 {
		c.Stage.MaxSeqs = DefaultMaxSeqs
	}
	if c.Stage.BlockSize == 0 {
		c.Stage.BlockSize = DefaultBlockSize
	}
	if c.Stage.CompensatedTokens == 0 {
		c.Stage.CompensatedTokens = DefaultCompensatedTokens
	}
	if c.Stage.MaxCaptureSize == 0 {
		if len(c.Stage.CaptureSizes) > 0 {
			c.Stage.MaxCaptureSize = slices.Max(c.Stage.CaptureSizes)
		} else {
			c.Stage.MaxCaptureSize = min(graphs.DefaultMaxCaptureSize, c.Stage.MaxBatchTokens)
		}
	}
	return c, c.validate()
}

func ptr[T any](v T) *T { return &v }

func (c *Config) validate() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if c.Model == "" {
		bad("model: the model directory is required")
	}
	for key, addr := range map[string]string{"listen.grpc": c.Listen.GRPC, "listen.gossip": c.Listen.Gossip, "listen.control": c.Listen.Control, "listen.data": c.Listen.Data} {
		host, _, err := net.SplitHostPort(addr)
		ip := net.ParseIP(host)
		switch {
		case err != nil:
			bad("%s %q: %v", key, addr, err)
		case c.Listen.Advertise == "" && (host == "" || (ip != nil && ip.IsUnspecified())):
			bad("%s %q listens on every interface: set listen.advertise, the host other nodes reach this one at", key, addr)
		}
	}
	for key, addr := range map[string]string{"listen.metrics": c.Listen.Metrics, "listen.http": c.Listen.HTTP} {
		if addr == "" {
			continue
		}
		if _, _, err := net.SplitHostPort(addr); err != nil {
			bad("%s %q: %v", key, addr, err)
		}
	}
	if exposed := c.exposedListeners(); len(exposed) > 0 && !c.hasClusterSecret() && !c.Security.Insecure {
		bad("%s: listening beyond loopback needs a cluster secret (cluster.key_file or cluster.gossip_key_file, --cluster-key-file), so that only the cluster can drive this node; or security.insecure (--insecure) to run without one", strings.Join(exposed, ", "))
	}
	for _, s := range c.Cluster.Seeds {
		if _, _, err := net.SplitHostPort(s); err != nil {
			bad("cluster.seeds: %q: %v", s, err)
		}
	}
	switch c.Stage.Backend {
	case BackendCPU, BackendCUDA, BackendAuto:
	default:
		bad("stage.backend %q: want %s, %s or %s", c.Stage.Backend, BackendCPU, BackendCUDA, BackendAuto)
	}
	if c.Stage.Device < 0 {
		bad("stage.device %d: want a GPU ordinal, at least 0", c.Stage.Device)
	}
	if _, err := graphs.ParseMode(c.Stage.GraphMode); err != nil {
		bad("stage.graph_mode: %v", err)
	}
	if _, err := c.newDispatcher(graphs.None); err != nil {
		bad("stage.capture_sizes %v, stage.max_capture_size %d: %v", c.Stage.CaptureSizes, c.Stage.MaxCaptureSize, err)
	} else if c.Stage.MaxCaptureSize > c.Stage.MaxBatchTokens {
		bad("stage.max_capture_size %d exceeds stage.max_batch_tokens %d: a graph cannot hold more tokens than a batch", c.Stage.MaxCaptureSize, c.Stage.MaxBatchTokens)
	}
	for key, d := range map[string]Duration{"listen.idle_timeout": c.Listen.IdleTimeout, "cluster.drain_timeout": c.Cluster.DrainTimeout, "cluster.recovery_timeout": c.Cluster.RecoveryTimeout, "cluster.step_timeout": c.Cluster.StepTimeout, "cluster.balance_by_time_after": c.Cluster.BalanceByTimeAfter} {
		if d < 0 {
			bad("%s %v: want a positive duration", key, time.Duration(d))
		}
	}
	if c.Cluster.ExpectStages < 1 {
		bad("cluster.expect_stages %d: want at least 1", c.Cluster.ExpectStages)
	}
	if c.Stage.MaxBatchTokens < 1 || c.Stage.MaxSeqs < 1 {
		bad("stage.max_batch_tokens %d and stage.max_seqs %d: want at least 1", c.Stage.MaxBatchTokens, c.Stage.MaxSeqs)
	}
	if err := c.admission().CheckAdmission(); err != nil {
		bad("stage.max_num_waiting %d, stage.growth_reserve %d, stage.max_preemptions %d: %v", c.Stage.MaxNumWaiting, c.Stage.GrowthReserve, c.Stage.MaxPreemptions, err)
	}
	if c.Stage.BlockSize < 1 || c.Stage.BlockSize > maxBlockSize {
		bad("stage.block_size %d: want 1 to %d positions", c.Stage.BlockSize, maxBlockSize)
	}
	if c.Stage.CompensatedTokens < -1 {
		bad("stage.compensated_tokens %d: want a number of token rows, or -1 for every step", c.Stage.CompensatedTokens)
	}
	if (c.Security.TLSCertFile == "") != (c.Security.TLSKeyFile == "") {
		bad("security: tls_cert_file and tls_key_file go together")
	}
	for i, p := range c.Plan {
		if p.Node == "" || p.Layers[0] < 0 || p.Layers[0] >= p.Layers[1] {
			bad("plan[%d]: node %q layers %v: want a node and layers [lo, hi] with lo < hi", i, p.Node, p.Layers)
		}
	}
	if len(c.Plan) > 0 && c.Cluster.BalanceByTimeAfter > 0 {
		bad("cluster.balance_by_time_after %v with a plan: the plan fixes the layers, the balance would move them; give one", time.Duration(c.Cluster.BalanceByTimeAfter))
	}
	return errors.Join(errs...)
}

// hasClusterSecret reports whether a cluster secret is configured.
func (c *Config) hasClusterSecret() bool {
	return c.Cluster.KeyFile != "" || c.Cluster.GossipKeyFile != ""
}

// exposedListeners are the listeners configured beyond loopback, as
// "key addr", in a fixed order.
func (c *Config) exposedListeners() []string {
	var out []string
	for _, l := range []struct{ key, addr string }{
		{"listen.grpc", c.Listen.GRPC}, {"listen.gossip", c.Listen.Gossip}, {"listen.control", c.Listen.Control},
		{"listen.data", c.Listen.Data}, {"listen.metrics", c.Listen.Metrics}, {"listen.http", c.Listen.HTTP},
	} {
		if l.addr != "" && !loopback(l.addr) {
			out = append(out, fmt.Sprintf("%s %s", l.key, l.addr))
		}
	}
	return out
}

// loopback reports whether addr (host:port) binds a loopback address
// only: "localhost" or a loopback IP. Any other name, and the empty host
// (every interface), are not.
func loopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// LogValue implements slog.LogValuer: the configuration without secrets
// (only the files that hold them are named).
func (c Config) LogValue() slog.Value {
	return slog.GroupValue(
		slog.String("name", c.Name),
		slog.String("model", c.Model),
		slog.String("grpc", c.Listen.GRPC),
		slog.String("gossip", c.Listen.Gossip),
		slog.String("metrics", c.Listen.Metrics),
		slog.String("http", c.Listen.HTTP),
		slog.String("model_name", c.ModelName),
		slog.Bool("vllm_metric_names", c.Metrics.VLLMNames),
		slog.Any("seeds", c.Cluster.Seeds),
		slog.String("leader", c.Cluster.Leader),
		slog.Int("expect_stages", c.Cluster.ExpectStages),
		slog.Bool("auto_rebalance", c.Cluster.AutoRebalance != nil && *c.Cluster.AutoRebalance),
		slog.String("backend", c.Stage.Backend),
		slog.String("graph_mode", c.Stage.GraphMode),
		slog.Bool("handoff", c.Stage.Handoff != nil && *c.Stage.Handoff),
		slog.Bool("tls", c.Security.TLSCertFile != ""),
		slog.Bool("admin_token", c.Security.AdminTokenFile != ""),
		slog.Bool("gossip_encrypted", c.hasClusterSecret()),
		slog.Bool("cluster_secret", c.hasClusterSecret()),
		slog.Bool("insecure", c.Security.Insecure),
	)
}

// secrets are the contents of the files the configuration names, and
// what is derived from them.
type secrets struct {
	adminToken string
	// gossipKey encrypts gossip: the gossip key file's, else derived from
	// the cluster key file's secret.
	gossipKey []byte
	// cred is the cluster credential (nil: no secret configured).
	cred *linkauth.Credential
}

// gossipKeyInfo derives the gossip encryption key from the cluster secret
// when no gossip key is configured (linkauth.DeriveKey).
const gossipKeyInfo = "tandem gossip encryption v1"

func (c *Config) readSecrets() (secrets, error) {
	var s secrets
	if f := c.Security.AdminTokenFile; f != "" {
		b, err := os.ReadFile(f)
		if err != nil {
			return s, fmt.Errorf("security.admin_token_file: %w", err)
		}
		s.adminToken = strings.TrimSpace(string(b))
		if s.adminToken == "" {
			return s, fmt.Errorf("security.admin_token_file %s: empty", f)
		}
	}
	if f := c.Cluster.GossipKeyFile; f != "" {
		b, err := os.ReadFile(f)
		if err != nil {
			return s, fmt.Errorf("cluster.gossip_key_file: %w", err)
		}
		key, err := base64.StdEncoding.DecodeString(strings.TrimSpace(string(b)))
		if err != nil {
			return s, fmt.Errorf("cluster.gossip_key_file %s: not base64: %w", f, err)
		}
		if n := len(key); n != 16 && n != 24 && n != 32 {
			return s, fmt.Errorf("cluster.gossip_key_file %s: key of %d bytes, want 16, 24 or 32", f, n)
		}
		s.gossipKey = key
	}
	secret := s.gossipKey
	if f := c.Cluster.KeyFile; f != "" {
		b, err := os.ReadFile(f)
		if err != nil {
			return s, fmt.Errorf("cluster.key_file: %w", err)
		}
		if secret, err = base64.StdEncoding.DecodeString(strings.TrimSpace(string(b))); err != nil {
			return s, fmt.Errorf("cluster.key_file %s: not base64: %w", f, err)
		}
		if len(secret) < linkauth.MinSecret {
			return s, fmt.Errorf("cluster.key_file %s: a secret of %d bytes, want at least %d (openssl rand -base64 32)", f, len(secret), linkauth.MinSecret)
		}
		if s.gossipKey == nil {
			if s.gossipKey, err = linkauth.DeriveKey(secret, gossipKeyInfo, 32); err != nil {
				return s, fmt.Errorf("cluster.key_file %s: %w", f, err)
			}
		}
	}
	if secret != nil {
		var err error
		if s.cred, err = linkauth.NewCredential(secret); err != nil {
			return s, fmt.Errorf("cluster secret: %w", err)
		}
	}
	return s, nil
}

// minMaxStreams is the least bound maxStreams sets on a connection's
// concurrent streams.
const minMaxStreams = 256

// maxStreams bounds the concurrent streams of one gRPC connection to this
// node (grpc.MaxConcurrentStreams): twice what the leader holds at once,
// its waiting queue and a full batch running, so that one client can fill
// the queue and be told RESOURCE_EXHAUSTED for the rest, while the
// leader's memory for streams stays bounded however many requests a
// client sends at once (its further streams wait in the client). Without
// a queue bound (-1), neither are streams bounded.
func (c *Config) maxStreams() uint32 {
	waiting := c.Stage.MaxNumWaiting
	switch waiting {
	case -1:
		return math.MaxUint32
	case 0:
		waiting = sched.DefaultMaxNumWaiting
	}
	return uint32(max(minMaxStreams, 2*(waiting+c.Stage.MaxSeqs)))
}

// Bounds of maxRecvMsg.
const (
	grpcMaxRecvMsg = 4 << 20 // gRPC's default
	minRecvMsg     = 1 << 20
)

// maxRecvMsg bounds the messages the gRPC server reads
// (grpc.MaxRecvMsgSize): twice the largest valid Generate request, the
// longest text prompt of the context (tokenizer.MaxTextBytes) and as many
// token ids, at least 1 MiB (the Node service's messages) and at most
// gRPC's default of 4 MiB. A larger request is refused by gRPC before it
// is read whole (RESOURCE_EXHAUSTED naming both sizes).
func (d *Daemon) maxRecvMsg() int {
	ctx := d.ckpt.Config().MaxPositions
	return min(grpcMaxRecvMsg, max(minRecvMsg, 2*(d.tok.MaxTextBytes(ctx)+5*ctx)))
}

// maxHTTPBody bounds the OpenAI API's request bodies: six times the
// longest text prompt of the context (JSON may escape a byte as \u00XX),
// at least 1 MiB and at most openai.DefaultMaxBodyBytes. A larger body is
// refused with 413 before it is read whole.
func (d *Daemon) maxHTTPBody() int64 {
	return min(openai.DefaultMaxBodyBytes, max(minRecvMsg, 6*int64(d.tok.MaxTextBytes(d.ckpt.Config().MaxPositions))))
}

// admission is the scheduler's admission policy the configuration sets
// (zeros: the scheduler's defaults).
func (c *Config) admission() sched.Config {
	return sched.Config{MaxNumWaiting: c.Stage.MaxNumWaiting, GrowthReserve: c.Stage.GrowthReserve, MaxPreemptions: c.Stage.MaxPreemptions}
}

// graphMode is the configured CUDA-graph mode (validated by withDefaults).
func (c *Config) graphMode() graphs.Mode {
	m, err := graphs.ParseMode(c.Stage.GraphMode)
	if err != nil {
		return graphs.None
	}
	return m
}

// newDispatcher builds the leader's CUDA-graph dispatcher for the resolved
// mode from the configured capture sizes.
func (c *Config) newDispatcher(mode graphs.Mode) (*graphs.Dispatcher, error) {
	return graphs.NewDispatcher(graphs.Config{
		Mode:           mode,
		CaptureSizes:   c.Stage.CaptureSizes,
		MaxCaptureSize: c.Stage.MaxCaptureSize,
		MaxNumSeqs:     c.Stage.MaxSeqs,
	})
}
