package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/reflection"

	"github.com/tandem-llm/tandem/daemon/apierr"
	"github.com/tandem-llm/tandem/daemon/frontend"
	"github.com/tandem-llm/tandem/daemon/membership"
	"github.com/tandem-llm/tandem/daemon/nodewire"
	"github.com/tandem-llm/tandem/daemon/placement"
	"github.com/tandem-llm/tandem/daemon/sdnotify"
	"github.com/tandem-llm/tandem/daemon/stagehost"
	"github.com/tandem-llm/tandem/daemon/supervise"
	"github.com/tandem-llm/tandem/graphs"
	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/chat"
	"github.com/tandem-llm/tandem/model/tokenizer"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
	"github.com/tandem-llm/tandem/sched"
)

// Version is the daemon's software version, gossiped to the other members
// (the main module's version, or "dev").
var Version = func() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	return "dev"
}()

// Timings of the daemon.
const (
	// stallLimit is how long the supervisor may go without a tick before
	// the watchdog stops being fed.
	stallLimit = 10 * time.Second
	// leaveTimeout bounds the gossip of this node's departure.
	leaveTimeout = 3 * time.Second
	// stopGrace bounds the graceful stop of the gRPC server once requests
	// have drained.
	stopGrace = 5 * time.Second
)

// Addrs are the addresses a running daemon listens on (Metrics and HTTP
// are empty while those endpoints are off).
type Addrs struct {
	GRPC, Gossip, Metrics, HTTP string
}

// Daemon is one tandemd node: a cluster member with a stage slot, and the
// leader's pipeline and request loop when it is chosen leader.
type Daemon struct {
	cfg       Config
	sec       secrets
	log       *slog.Logger // with the node's name
	baseLog   *slog.Logger
	listening chan struct{}
	addrs     Addrs

	// Set up by Run.
	ckpt   *model.Checkpoint
	tok    *tokenizer.Tokenizer
	gen    *model.GenerationConfig // generation_config.json's defaults
	chat   *chat.Set               // the chat templates
	loaded time.Time               // when the model was opened
	fe     *frontend.Server
	// reqMetrics are the request-level metrics the frontend records;
	// counters count every scheduler's preemptions. Both outlive the
	// pipelines.
	reqMetrics *frontend.Metrics
	counters   sched.Counters
	graphSteps graphs.Stats // every pipeline's CUDA-graph dispatches
	memb       *membership.Membership
	slot       *stagehost.Slot
	dev        *stagehost.Device // what the stage runs on (nil without a stage)
	usable     uint64            // memory the stage may use (0 without a stage)
	health     *health.Server
	dialOpts   []grpc.DialOption
	meta       membership.Meta
	sup        *supervise.Supervisor
	leaders    leaderWatch // the leader the supervisor sees, for Node calls

	mu         sync.Mutex
	draining   bool
	serving    bool // health says SERVING: a pipeline this node leads serves
	notified   bool // READY=1 sent
	stageReady bool // this node's stage is serving in a pipeline
}

// New validates the configuration and reads the secrets it names; it starts
// nothing. log receives the daemon's logs (nil: slog.Default()).
func New(cfg Config, log *slog.Logger) (*Daemon, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	if log == nil {
		log = slog.Default()
	}
	sec, err := cfg.readSecrets()
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	dialOpts, err := clientCreds(cfg.Security, sec.adminToken)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	dialOpts = append(dialOpts, nodeSigner(cfg.Name, sec))
	return &Daemon{cfg: cfg, sec: sec, log: log.With("node", cfg.Name), baseLog: log, listening: make(chan struct{}), dialOpts: dialOpts}, nil
}

// Listening is closed once Run has bound its listeners; Addrs is then set.
func (d *Daemon) Listening() <-chan struct{} { return d.listening }

// Addrs are the bound addresses (valid once Listening is closed).
func (d *Daemon) Addrs() Addrs { return d.addrs }

// Run serves until ctx is cancelled, then drains and stops: health turns
// NOT_SERVING, requests in flight finish (within the drain timeout), the
// node leaves the cluster, and every goroutine the daemon started ends
// before Run returns. It returns nil after a clean stop.
func (d *Daemon) Run(ctx context.Context) (err error) {
	if err := d.openModel(); err != nil {
		return err
	}
	defer d.ckpt.Close()
	lis, err := net.Listen("tcp", d.cfg.Listen.GRPC)
	if err != nil {
		return fmt.Errorf("listen for gRPC on %s: %w", d.cfg.Listen.GRPC, err)
	}
	creds, err := serverCreds(d.cfg.Security)
	if err != nil {
		lis.Close()
		return err
	}
	auth := tokenAuth{token: d.sec.adminToken}
	rec := recovery{log: d.log}
	srv := grpc.NewServer(grpc.Creds(creds), grpc.MaxConcurrentStreams(d.cfg.maxStreams()), grpc.MaxRecvMsgSize(d.maxRecvMsg()),
		grpc.KeepaliveParams(keepalive.ServerParameters{MaxConnectionIdle: time.Duration(d.cfg.Listen.IdleTimeout)}),
		grpc.ChainUnaryInterceptor(rec.unary, auth.unary, d.nodeVerifier().Unary),
		grpc.ChainStreamInterceptor(rec.stream, auth.stream))
	d.health = health.NewServer()
	d.setHealth(false)
	slotCfg := stagehost.Config{
		Name:        d.cfg.Name,
		Checkpoint:  d.ckpt,
		ControlAddr: d.cfg.Listen.Control,
		DataAddr:    d.cfg.Listen.Data,
		Advertise:   d.cfg.Listen.Advertise,
		Cost: func(backend string, maxBatchTokens, maxSeqs int) placement.Cost {
			return backendCost(d.ckpt.Config(), backend, maxBatchTokens, maxSeqs)
		},
		Credential: d.sec.cred,
		OnServing:  d.onStageServing,
		Log:        d.log,
		Progress:   d.cfg.Progress,
		WrapStage:  d.cfg.WrapStage,
	}
	if *d.cfg.Stage.Enabled {
		if d.dev, err = stagehost.OpenDevice(d.cfg.Stage.Backend, d.cfg.Stage.Device, d.log); err != nil {
			lis.Close()
			return err
		}
		defer d.dev.Close()
		if slotCfg.Usable, err = d.dev.Usable(uint64(d.cfg.Stage.Memory)); err != nil {
			lis.Close()
			return err
		}
		slotCfg.Device = d.dev
		if d.dev.Backend == BackendCUDA {
			// The graphs' memory is held back before the KV cache is sized.
			g := uint64(d.cfg.Stage.GraphMemory)
			if slotCfg.Usable <= g {
				lis.Close()
				return fmt.Errorf("stage memory %v leaves nothing beside the %v held back for CUDA graphs (stage.graph_memory)", ByteSize(slotCfg.Usable), ByteSize(g))
			}
			slotCfg.Usable -= g
			slotCfg.GraphMemory = int64(g)
			slotCfg.CacheDir = d.cfg.Stage.CacheDir
			slotCfg.CompensatedTokens = d.cfg.Stage.CompensatedTokens
		}
	}
	d.usable = slotCfg.Usable
	// The slot's assignments outlive requests, not the daemon.
	d.slot = stagehost.New(slotCfg)
	defer d.slot.Stop()
	if *d.cfg.Stage.Enabled {
		tandemv1.RegisterNodeServer(srv, d.slot)
	}
	d.reqMetrics = frontend.NewMetrics(frontend.MetricsConfig{
		ModelName: d.cfg.ModelName,
		VLLMNames: d.cfg.Metrics.VLLMNames,
		Engine:    d.schedStats,
		Counters:  &d.counters,
	})
	d.fe = frontend.New(frontend.Config{
		Model:      d.ckpt.Config(),
		Tokenizer:  d.tok,
		Generation: d.gen,
		Chat:       d.chat,
		Name:       d.cfg.ModelName,
		Created:    d.loaded,
		Engines:    d,
		Metrics:    d.reqMetrics,
	})
	tandemv1.RegisterInferenceServer(srv, d.fe)
	tandemv1.RegisterAdminServer(srv, &adminServer{d: d})
	healthpb.RegisterHealthServer(srv, d.health)
	reflection.Register(srv)

	d.addrs.GRPC = lis.Addr().String()
	metrics, api, err := d.listenHTTP()
	if err != nil {
		lis.Close()
		return err
	}
	d.addrs.Metrics, d.addrs.HTTP = metrics.addr(), api.addr()
	if err := d.startMembership(ctx); err != nil {
		lis.Close()
		metrics.abandon()
		api.abandon()
		return err
	}
	d.addrs.Gossip = d.memb.LocalAddr()
	d.sup = d.newSupervisor()
	if exposed := d.cfg.exposedListeners(); len(exposed) > 0 && d.sec.cred == nil {
		d.log.Warn("insecure: listening beyond loopback without a cluster secret: whoever reaches these ports can drive this node's stage and join its cluster; configure cluster.key_file", "listeners", exposed)
	}
	d.log.Info("daemon listening", "grpc", d.addrs.GRPC, "gossip", d.addrs.Gossip, "metrics", d.addrs.Metrics, "http", d.addrs.HTTP, "config", d.cfg)
	close(d.listening)

	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	metrics.start()
	api.start()
	// The watchdog is fed through the drain too: it is bounded.
	stopWatchdog, err := sdnotify.StartWatchdog(context.Background(), d.healthy, d.log)
	if err != nil {
		d.log.Warn("systemd watchdog off", "err", err)
		stopWatchdog = func() {}
	}
	defer stopWatchdog()

	d.sup.Run(ctx)

	// Drain and stop.
	d.log.Info("draining")
	errs := []error{sdnotify.Stopping()}
	d.mu.Lock()
	d.draining = true
	d.serving = false
	d.mu.Unlock()
	d.setHealth(false)
	d.sup.Stop(time.Duration(d.cfg.Cluster.DrainTimeout), fmt.Sprintf("node %s is draining", d.cfg.Name))
	if err := d.memb.Leave(leaveTimeout); err != nil {
		d.log.Warn("leave the cluster", "err", err)
	}
	d.waitStageIdle(time.Duration(d.cfg.Cluster.DrainTimeout))
	d.slot.Stop()
	stopped := make(chan struct{})
	go func() { srv.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(stopGrace):
		srv.Stop()
		<-stopped
	}
	if err := <-served; err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		errs = append(errs, fmt.Errorf("serve gRPC: %w", err))
	}
	errs = append(errs, metrics.stop(stopGrace), api.stop(stopGrace))
	errs = append(errs, d.memb.Shutdown())
	d.log.Info("stopped")
	return errors.Join(errs...)
}

func (d *Daemon) openModel() error {
	ckpt, err := model.Open(d.cfg.Model)
	if err != nil {
		return err
	}
	tok, err := tokenizer.Load(filepath.Join(d.cfg.Model, "tokenizer.json"))
	if err != nil {
		ckpt.Close()
		return fmt.Errorf("model %s: %w", d.cfg.Model, err)
	}
	gen, err := model.LoadGenerationConfig(d.cfg.Model, ckpt.Config().VocabSize)
	if err != nil {
		ckpt.Close()
		return err
	}
	set, err := chat.Load(d.cfg.Model, nil)
	if err != nil {
		ckpt.Close()
		return err
	}
	d.ckpt, d.tok, d.gen, d.chat, d.loaded = ckpt, tok, gen, set, time.Now()
	return nil
}

func (d *Daemon) startMembership(ctx context.Context) error {
	host, port, err := splitHostPort(d.cfg.Listen.Gossip)
	if err != nil {
		return fmt.Errorf("listen.gossip: %w", err)
	}
	dev := d.dev
	if dev == nil {
		dev = stagehost.CPUDevice()
	}
	d.meta = membership.Meta{
		Name:           d.cfg.Name,
		Backend:        dev.Backend,
		Device:         dev.Name,
		MemTotal:       max(dev.Total, d.usable),
		MemFree:        d.usable,
		GRPCAddr:       nodewire.Advertised(d.addrs.GRPC, d.cfg.Listen.Advertise),
		Version:        Version,
		ModelID:        d.ckpt.Identity(),
		LeaderEligible: *d.cfg.Cluster.LeaderEligible,
		Protocol:       nodewire.Protocol,
	}
	if *d.cfg.Stage.Enabled {
		d.meta.DataAddr = nodewire.Advertised(d.cfg.Listen.Data, d.cfg.Listen.Advertise)
	}
	d.memb, err = membership.New(membership.Config{
		NodeName:      d.cfg.Name,
		BindAddr:      host,
		BindPort:      port,
		AdvertiseAddr: d.cfg.Listen.Advertise,
		Seeds:         d.cfg.Cluster.Seeds,
		SecretKey:     d.sec.gossipKey,
		Meta:          d.meta,
		Logger:        d.baseLog,
		Fast:          d.cfg.Cluster.FastFailureDetection,
	})
	if err != nil {
		return err
	}
	// Joining is retried in the background until Shutdown.
	if err := d.memb.Start(context.WithoutCancel(ctx)); err != nil {
		d.memb.Shutdown()
		return err
	}
	return nil
}

func splitHostPort(addr string) (string, int, error) {
	host, p, err := net.SplitHostPort(addr)
	if err != nil {
		return "", 0, err
	}
	port, err := strconv.Atoi(p)
	if err != nil {
		return "", 0, fmt.Errorf("port %q: %w", p, err)
	}
	return host, port, nil
}

// setHealth publishes whether this node serves Generate.
func (d *Daemon) setHealth(serving bool) {
	st := healthpb.HealthCheckResponse_NOT_SERVING
	if serving {
		st = healthpb.HealthCheckResponse_SERVING
	}
	d.health.SetServingStatus("", st)
	d.health.SetServingStatus(tandemv1.Inference_ServiceDesc.ServiceName, st)
}

// healthy feeds the systemd watchdog: the supervisor is ticking, or the
// daemon is draining (which the drain timeout bounds).
func (d *Daemon) healthy() bool {
	d.mu.Lock()
	draining := d.draining
	d.mu.Unlock()
	return draining || d.sup == nil || time.Since(d.sup.LastTick()) < stallLimit
}

// onStageServing records that this node's stage joined or left a
// pipeline, and tells systemd once it is ready.
func (d *Daemon) onStageServing(serving bool) {
	d.mu.Lock()
	d.stageReady = serving
	d.mu.Unlock()
	if serving {
		d.notifyReady("stage serving")
	}
}

// notifyReady sends READY=1 once: when this node's stage or, on the
// leader, the pipeline is serving.
func (d *Daemon) notifyReady(status string) {
	d.mu.Lock()
	first := !d.notified
	d.notified = true
	d.mu.Unlock()
	if err := sdnotify.Status(status); err != nil {
		d.log.Warn("notify systemd", "err", err)
	}
	if first {
		if err := sdnotify.Ready(); err != nil {
			d.log.Warn("notify systemd", "err", err)
		}
	}
}

// waitStageIdle waits until this node's stage is out of any pipeline (the
// leader drains it after seeing this node leave), at most timeout.
func (d *Daemon) waitStageIdle(timeout time.Duration) {
	deadline := time.Now().Add(timeout)
	for d.slot.Busy() && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
}

// schedStats is the leader's scheduler state, for the metrics; false
// while this node does not lead.
func (d *Daemon) schedStats() (sched.Stats, bool) {
	if d.sup == nil {
		return sched.Stats{}, false
	}
	snap := d.sup.Snapshot()
	return snap.Sched, snap.Leading
}

// Engine implements frontend.Engines: the leader's engine, which queues
// requests while a pipeline serves or is being rebuilt, and refuses them
// otherwise.
func (d *Daemon) Engine() (frontend.Engine, error) {
	d.mu.Lock()
	draining := d.draining
	d.mu.Unlock()
	snap := d.sup.Snapshot()
	switch {
	case draining:
		return nil, apierr.Unavailablef("node %s is draining", d.cfg.Name)
	case !snap.Leading:
		return nil, frontend.NotLeader(snap.Leader.Name, snap.Leader.Meta.GRPCAddr)
	}
	return d.sup.Engine(), nil
}

// Ready implements frontend.Engines: nil while a pipeline this node leads
// serves (gRPC health SERVING), else why not.
func (d *Daemon) Ready() error {
	if _, err := d.Engine(); err != nil {
		return err
	}
	d.mu.Lock()
	serving := d.serving
	d.mu.Unlock()
	if !serving {
		return apierr.Unavailablef("no pipeline is ready: %s", d.sup.Snapshot().Reason)
	}
	return nil
}
