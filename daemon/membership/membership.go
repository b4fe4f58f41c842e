package membership

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
)

// Config configures a Membership. The zero value of every field but
// NodeName and Meta.Backend is usable.
type Config struct {
	// NodeName is this node's unique name in the cluster.
	NodeName string
	// BindAddr is the gossip listen address (TCP and UDP); empty means
	// 127.0.0.1.
	BindAddr string
	// BindPort is the gossip port; 0 picks a free one (see LocalAddr).
	BindPort int
	// AdvertiseAddr and AdvertisePort are what peers should dial, when
	// they differ from the bound address (NAT, a wildcard bind). Empty and
	// 0 mean the bound address and port.
	AdvertiseAddr string
	AdvertisePort int
	// Seeds are the host:port gossip addresses of other members to join
	// through. Empty means this node starts a cluster of its own.
	Seeds []string
	// SecretKey, when set, is the AES key (16, 24 or 32 bytes) encrypting
	// all gossip; peers without it cannot join. It is never logged.
	SecretKey []byte
	// Meta is the metadata this node gossips at start.
	Meta Meta
	// Logger receives memberlist's log lines at their levels; nil means
	// slog.Default().
	Logger *slog.Logger
	// Fast selects loopback timings (probes every 200 ms, short
	// suspicion), so a killed node is declared dead within about two
	// seconds. Otherwise the timings are memberlist's LAN defaults, where
	// detection takes several seconds.
	Fast bool
}

// String describes the configuration without the secret key.
func (c Config) String() string {
	return fmt.Sprintf("membership.Config{NodeName:%q BindAddr:%q BindPort:%d Seeds:%q Encrypted:%t Fast:%t}",
		c.NodeName, c.BindAddr, c.BindPort, c.Seeds, len(c.SecretKey) > 0, c.Fast)
}

// LogValue keeps the secret key out of structured logs.
func (c Config) LogValue() slog.Value {
	return slog.GroupValue(
		slog.String("node", c.NodeName),
		slog.String("bind", net.JoinHostPort(c.BindAddr, strconv.Itoa(c.BindPort))),
		slog.Any("seeds", c.Seeds),
		slog.Bool("encrypted", len(c.SecretKey) > 0),
		slog.Bool("fast", c.Fast),
	)
}

// deadRetention is how long Members keeps reporting a dead or departed
// member, so an operator can see what went away.
const deadRetention = 5 * time.Minute

// eventBuffer is the capacity of the Events channel.
const eventBuffer = 256

// updateWait bounds how long UpdateMeta waits for its broadcast.
const updateWait = 5 * time.Second

// Membership is this node's view of the cluster, kept by gossip.
type Membership struct {
	cfg Config
	log *slog.Logger

	// life serialises Start, UpdateMeta, Leave and Shutdown; delegates
	// never take it, so holding it across memberlist calls is safe.
	life     sync.Mutex
	ml       *memberlist.Memberlist
	started  bool
	shutdown bool
	cancel   context.CancelFunc
	wg       sync.WaitGroup
	joined   chan struct{}
	addr     atomic.Pointer[string] // LocalAddr, set by Start
	stopping atomic.Bool            // set by Shutdown; quiets closed-socket lines

	// metaMu guards the encoded local metadata read by the meta delegate.
	metaMu  sync.Mutex
	local   Meta
	leaving bool
	meta    []byte

	// evMu guards the member table and the events channel. Delegates take
	// it while memberlist holds its own locks, so no memberlist method is
	// ever called with evMu held.
	evMu    sync.Mutex
	members map[string]*Member
	events  chan Event
	closed  bool
	dropped atomic.Uint64
	// nowForTest replaces time.Now in tests of the dead-member retention.
	nowForTest func() time.Time
	// mlConfigForTest, when set before Start, adjusts memberlist's
	// configuration (a lossy transport, no periodic push/pull).
	mlConfigForTest func(*memberlist.Config) error
}

// New validates cfg and returns a Membership that has not started: nothing
// is bound until Start.
func New(cfg Config) (*Membership, error) {
	if cfg.NodeName == "" {
		return nil, errors.New("membership config: empty node name")
	}
	if cfg.BindAddr == "" {
		cfg.BindAddr = "127.0.0.1"
	}
	if ip := net.ParseIP(cfg.BindAddr); ip == nil {
		return nil, fmt.Errorf("membership config: bind address %q is not an IP address", cfg.BindAddr)
	}
	for _, p := range []struct {
		name string
		v    int
	}{{"bind port", cfg.BindPort}, {"advertise port", cfg.AdvertisePort}} {
		if p.v < 0 || p.v > 65535 {
			return nil, fmt.Errorf("membership config: %s %d out of range", p.name, p.v)
		}
	}
	if cfg.AdvertiseAddr != "" && net.ParseIP(cfg.AdvertiseAddr) == nil {
		return nil, fmt.Errorf("membership config: advertise address %q is not an IP address", cfg.AdvertiseAddr)
	}
	for _, s := range cfg.Seeds {
		if _, _, err := net.SplitHostPort(s); err != nil {
			return nil, fmt.Errorf("membership config: seed %q: %w", s, err)
		}
	}
	switch len(cfg.SecretKey) {
	case 0, 16, 24, 32:
	default:
		return nil, fmt.Errorf("membership config: secret key is %d bytes, want 16, 24 or 32", len(cfg.SecretKey))
	}
	cfg.SecretKey = slices.Clone(cfg.SecretKey)
	cfg.Seeds = slices.Clone(cfg.Seeds)
	m := &Membership{
		cfg:     cfg,
		log:     cmp.Or(cfg.Logger, slog.Default()),
		joined:  make(chan struct{}),
		members: make(map[string]*Member),
		events:  make(chan Event, eventBuffer),
	}
	if err := m.setMeta(cfg.Meta); err != nil {
		return nil, fmt.Errorf("membership config: %w", err)
	}
	return m, nil
}

// setMeta validates and encodes meta as the local metadata.
func (m *Membership) setMeta(meta Meta) error {
	if meta.Name == "" {
		meta.Name = m.cfg.NodeName
	}
	if meta.Name != m.cfg.NodeName {
		return fmt.Errorf("meta name %q differs from node name %q", meta.Name, m.cfg.NodeName)
	}
	if err := meta.validate(); err != nil {
		return err
	}
	m.metaMu.Lock()
	defer m.metaMu.Unlock()
	b, err := encodeMeta(meta, m.leaving)
	if err != nil {
		return err
	}
	m.local, m.meta = meta, b
	return nil
}

// mlConfig builds memberlist's configuration.
func (m *Membership) mlConfig() *memberlist.Config {
	var c *memberlist.Config
	if m.cfg.Fast {
		c = memberlist.DefaultLocalConfig()
		c.ProbeInterval = 200 * time.Millisecond
		c.ProbeTimeout = 100 * time.Millisecond
		c.SuspicionMult = 3
		c.SuspicionMaxTimeoutMult = 2
		c.GossipInterval = 50 * time.Millisecond
		c.PushPullInterval = 2 * time.Second
		c.TCPTimeout = 500 * time.Millisecond
		c.GossipToTheDeadTime = 2 * time.Second
		c.DeadNodeReclaimTime = time.Second
	} else {
		c = memberlist.DefaultLANConfig()
		// A daemon restarted on a new port may take its name back once
		// its old incarnation has been dead this long.
		c.DeadNodeReclaimTime = 30 * time.Second
	}
	c.Name = m.cfg.NodeName
	c.BindAddr = m.cfg.BindAddr
	c.BindPort = m.cfg.BindPort
	c.AdvertiseAddr = m.cfg.AdvertiseAddr
	c.AdvertisePort = m.cfg.AdvertisePort
	if m.cfg.AdvertisePort == 0 {
		c.AdvertisePort = m.cfg.BindPort
	}
	c.SecretKey = m.cfg.SecretKey
	c.Delegate = metaDelegate{m}
	c.Events = eventDelegate{m}
	c.Logger = newStdLogger(m.log, &m.stopping)
	// Resolve seed host names with the Go resolver only, not memberlist's
	// extra DNS-over-TCP query to the servers of resolv.conf.
	c.DNSConfigPath = ""
	return c
}

// Start binds the gossip listeners and joins the cluster through the
// seeds. It returns once this node is listening and one join attempt has
// been made: when no seed answers, it keeps retrying in the background
// (with backoff) until one does, ctx is done or Shutdown is called. Joined
// reports the first successful join. Once joined it keeps exchanging state
// with its seeds now and then (see resync), so that a seed that restarted
// (the leader, whose stages are its seeds' joiners) finds this node again.
// ctx bounds only these join attempts; Shutdown stops the membership.
func (m *Membership) Start(ctx context.Context) error {
	m.life.Lock()
	defer m.life.Unlock()
	if m.shutdown {
		return errors.New("membership start: already shut down")
	}
	if m.started {
		return errors.New("membership start: already started")
	}
	c := m.mlConfig()
	if m.mlConfigForTest != nil {
		if err := m.mlConfigForTest(c); err != nil {
			return fmt.Errorf("membership start: %w", err)
		}
	}
	ml, err := memberlist.Create(c)
	if err != nil {
		return fmt.Errorf("membership start: gossip on %s: %w",
			net.JoinHostPort(m.cfg.BindAddr, strconv.Itoa(m.cfg.BindPort)), err)
	}
	m.ml, m.started = ml, true
	local := ml.LocalNode().Address()
	m.addr.Store(&local)
	seeds := slices.DeleteFunc(slices.Clone(m.cfg.Seeds), func(s string) bool { return s == local })
	m.log.Info("gossip started", "node", m.cfg.NodeName, "addr", local,
		"encrypted", len(m.cfg.SecretKey) > 0, "seeds", seeds)
	if len(seeds) == 0 {
		close(m.joined)
		return nil
	}
	joined := m.join(seeds)
	jctx, cancel := context.WithCancel(ctx)
	m.cancel = cancel
	m.wg.Go(func() {
		if !joined && !m.retryJoin(jctx, seeds) {
			return
		}
		m.resync(jctx, seeds)
	})
	return nil
}

// join makes one attempt through the seeds and closes joined when a seed
// answered.
func (m *Membership) join(seeds []string) bool {
	n, err := m.ml.Join(seeds)
	if n == 0 {
		m.log.Warn("join failed: no seed answered", "node", m.cfg.NodeName, "seeds", seeds, "err", err)
		return false
	}
	if err != nil {
		m.log.Info("joined through some seeds", "node", m.cfg.NodeName, "contacted", n, "err", err)
	}
	close(m.joined)
	return true
}

// retryJoin retries join with exponential backoff until it succeeds
// (true) or ctx is done (false).
func (m *Membership) retryJoin(ctx context.Context, seeds []string) bool {
	wait, ceiling := 500*time.Millisecond, 10*time.Second
	if m.cfg.Fast {
		wait, ceiling = 100*time.Millisecond, time.Second
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return false
		case <-t.C:
		}
		if m.join(seeds) {
			return true
		}
		wait = min(2*wait, ceiling)
		t.Reset(wait)
	}
}

// Intervals of resync: loopback timings (Fast) and memberlist's LAN ones.
const (
	resyncFast = time.Second
	resyncLAN  = 5 * time.Second
)

// resync exchanges state with every seed (memberlist's Join: a push/pull
// over TCP) every few seconds, until ctx is done. A seed that restarted
// knows nobody (a leader has no seeds of its own): the exchange tells it
// of this node and of every member this node knows, so members find each
// other again after any restart, in any order, within an interval. Gossip
// alone would not: a dead member is not probed, and a restarted one that
// answers in time to its old incarnation's probes learns of the others
// only at the next periodic push/pull (30s on a LAN). A seed down costs a
// failed dial, logged at debug.
func (m *Membership) resync(ctx context.Context, seeds []string) {
	every := resyncLAN
	if m.cfg.Fast {
		every = resyncFast
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if n, err := m.ml.Join(seeds); n == 0 {
			m.log.Debug("resync with the seeds: none answered", "node", m.cfg.NodeName, "seeds", seeds, "err", err)
		}
	}
}

// Joined is closed once this node has joined through a seed (at once when
// it has none).
func (m *Membership) Joined() <-chan struct{} { return m.joined }

// LocalAddr is the gossip host:port peers reach this node at: the
// advertised address, with the port actually bound when BindPort was 0.
// It is empty before Start.
func (m *Membership) LocalAddr() string {
	if a := m.addr.Load(); a != nil {
		return *a
	}
	return ""
}

// Members returns the members this node knows, sorted by name, this node
// included: the live ones, and those dead or departed within the last
// five minutes (State says which). A member that comes back replaces its
// dead entry.
func (m *Membership) Members() []Member {
	m.evMu.Lock()
	defer m.evMu.Unlock()
	now := m.now()
	out := make([]Member, 0, len(m.members))
	for name, mb := range m.members {
		if mb.State != Alive && now.Sub(mb.Since) > deadRetention {
			delete(m.members, name)
			continue
		}
		out = append(out, *mb)
	}
	slices.SortFunc(out, func(a, b Member) int { return cmp.Compare(a.Name, b.Name) })
	return out
}

// Events delivers membership changes, this node's own join included. The
// channel is buffered; when the consumer falls behind, the oldest
// undelivered event is dropped (Dropped counts them), since memberlist
// must never wait on a consumer. A consumer that sees drops should resync
// from Members. The channel is closed by Shutdown.
func (m *Membership) Events() <-chan Event { return m.events }

// Dropped is the number of events dropped because the consumer of Events
// fell behind.
func (m *Membership) Dropped() uint64 { return m.dropped.Load() }

// syncPeers hands this node's state to every live peer by a push/pull
// exchange over TCP (memberlist's Join), waiting until each is done or
// deadline. Leave calls it twice: for the leaving flag, then for the
// departure itself, since gossip guarantees neither. A broadcast counts as
// sent once it went out memberlist's retransmit limit of times (twice in a
// small cluster), whoever it went to: a member dead for less than
// GossipToTheDeadTime is still a gossip target, and queued broadcasts also
// ride on the pings this node sends when a peer asks it to probe a dead
// member indirectly. So the update may reach no live peer, or reach one
// after the departure (a peer would then take a graceful leave for a
// failure and abort the requests in flight instead of draining them), and
// the departure may reach no live peer at all (it would keep the node as
// alive until it stops answering). The exchanges run on goroutines that
// Shutdown waits for; a peer that does not answer costs at most the TCP
// timeout.
func (m *Membership) syncPeers(deadline time.Time) {
	var addrs []string
	for _, n := range m.ml.Members() {
		if n.Name != m.cfg.NodeName {
			addrs = append(addrs, n.Address())
		}
	}
	done := make(chan struct{}, len(addrs))
	for _, addr := range addrs {
		m.wg.Go(func() {
			if _, err := m.ml.Join([]string{addr}); err != nil {
				m.log.Debug("leave: state exchange with a peer", "addr", addr, "err", err)
			}
			done <- struct{}{}
		})
	}
	wait := time.NewTimer(time.Until(deadline))
	defer wait.Stop()
	for range addrs {
		select {
		case <-done:
		case <-wait.C:
			return
		}
	}
}

// UpdateMeta replaces this node's metadata. Once started, it gossips the
// change and waits (up to five seconds) until the broadcast has gone out;
// an error after the wait means the change is applied locally and still
// queued for gossip.
func (m *Membership) UpdateMeta(meta Meta) error {
	m.life.Lock()
	defer m.life.Unlock()
	if m.shutdown {
		return errors.New("update meta: membership shut down")
	}
	if err := m.setMeta(meta); err != nil {
		return fmt.Errorf("update meta: %w", err)
	}
	if !m.started {
		return nil
	}
	if err := m.ml.UpdateNode(updateWait); err != nil {
		return fmt.Errorf("update meta: %w", err)
	}
	return nil
}

// Leave announces that this node is leaving, so peers see a Leave event
// rather than a Fail: it gossips the leaving flag, hands it to every live
// peer in a push/pull exchange, gossips the departure and hands that to
// every live peer the same way. It waits up to timeout for all this
// (timeout must be positive), unless no peer is left to hear it. The node
// keeps gossiping until Shutdown.
func (m *Membership) Leave(timeout time.Duration) error {
	m.life.Lock()
	defer m.life.Unlock()
	if !m.started || m.shutdown {
		return errors.New("leave: membership not running")
	}
	if timeout <= 0 {
		return fmt.Errorf("leave: timeout %v, want > 0", timeout)
	}
	deadline := time.Now().Add(timeout)
	if m.cancel != nil {
		m.cancel() // no more joins: this node is going
	}
	m.metaMu.Lock()
	m.leaving = true
	b, err := encodeMeta(m.local, true)
	if err == nil {
		m.meta = b
	}
	m.metaMu.Unlock()
	if err != nil {
		return fmt.Errorf("leave: %w", err)
	}
	// Peers must learn the leaving flag before the departure itself, or
	// they would take the departure for a failure.
	if err := m.ml.UpdateNode(time.Until(deadline)); err != nil {
		if m.ml.NumMembers() <= 1 {
			// The last peers left meanwhile (a whole cluster stopping at
			// once), so the update had nobody to go to: nobody is left to
			// tell either.
			return nil
		}
		return fmt.Errorf("leave: announce: %w", err)
	}
	m.syncPeers(deadline)
	// memberlist's Leave marks this node left and queues the departure;
	// its wait ends once the departure was sent its retransmit limit of
	// times, which may all have gone to dead members (see syncPeers). It
	// waits without bound for a timeout that is not positive.
	leaveErr := m.ml.Leave(max(time.Until(deadline), time.Nanosecond))
	// This node's state now lists it as left, which a peer merges as a
	// graceful departure; without this exchange a live peer may never
	// hear of it (once GossipToTheDeadTime has passed, this node drops
	// its own entry and no later push/pull carries it).
	m.syncPeers(deadline)
	if leaveErr != nil {
		return fmt.Errorf("leave: %w", leaveErr)
	}
	return nil
}

// Shutdown stops gossip without announcing a departure (call Leave first
// for a graceful exit), stops this package's goroutines and closes Events.
// memberlist's own connection handlers may take a moment more to return.
// It is idempotent.
func (m *Membership) Shutdown() error {
	m.life.Lock()
	defer m.life.Unlock()
	if m.shutdown {
		return nil
	}
	m.shutdown = true
	m.stopping.Store(true)
	if m.cancel != nil {
		m.cancel()
	}
	var err error
	if m.ml != nil {
		if err = m.ml.Shutdown(); err != nil {
			err = fmt.Errorf("membership shutdown: %w", err)
		}
	}
	m.wg.Wait()
	m.evMu.Lock()
	m.closed = true
	close(m.events)
	m.evMu.Unlock()
	return err
}

func (m *Membership) now() time.Time {
	if m.nowForTest != nil {
		return m.nowForTest()
	}
	return time.Now()
}
