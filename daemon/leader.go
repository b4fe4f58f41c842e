package daemon

import (
	"context"
	"io"
	"time"

	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/tandem-llm/tandem/daemon/nodewire"
	"github.com/tandem-llm/tandem/daemon/placement"
	"github.com/tandem-llm/tandem/daemon/supervise"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// cpuDTypeBytes is the size of a weight element on the CPU backend (it
// computes in float32).
const cpuDTypeBytes = 4

// newSupervisor configures the leader's supervision (package supervise)
// from the daemon's configuration: the core's placement and timings, how
// pipelines are built, how stage nodes are reached and probed.
func (d *Daemon) newSupervisor() *supervise.Supervisor {
	var ranges []placement.Range
	for _, r := range d.cfg.Plan {
		ranges = append(ranges, placement.Range{Node: r.Node, Lo: r.Layers[0], Hi: r.Layers[1]})
	}
	return supervise.New(supervise.Config{
		Core: supervise.CoreConfig{
			Name: d.cfg.Name, Leader: d.cfg.Cluster.Leader, ModelID: d.ckpt.Identity(), Protocol: nodewire.Protocol,
			ExpectStages: d.cfg.Cluster.ExpectStages, Plan: ranges, Place: d.place,
			RecoveryTimeout: time.Duration(d.cfg.Cluster.RecoveryTimeout), AutoRebalance: *d.cfg.Cluster.AutoRebalance,
			BalanceAfter: time.Duration(d.cfg.Cluster.BalanceByTimeAfter),
		},
		Builder: supervise.BuilderConfig{
			Leader: d.cfg.Name, Model: d.ckpt.Config(), ModelID: d.ckpt.Identity(),
			MaxBatchTokens: d.cfg.Stage.MaxBatchTokens, MaxSeqs: d.cfg.Stage.MaxSeqs, BlockSize: d.cfg.Stage.BlockSize,
			Handoff: *d.cfg.Stage.Handoff, Admission: d.cfg.admission(), GraphMode: d.cfg.graphMode(), NewDispatcher: d.cfg.newDispatcher,
			Nodes: nodeDialer{d.dialOpts}, Credential: d.sec.cred, StepTimeout: time.Duration(d.cfg.Cluster.StepTimeout),
			Counters: &d.counters, GraphSteps: &d.graphSteps,
		},
		Probe:         d.probe,
		OnStatus:      d.onStatus,
		RetireTimeout: time.Duration(d.cfg.Cluster.DrainTimeout),
		Log:           d.log,
	}, d.memb)
}

// place places the model over nodes: after ranges, or balanced over their
// memory, costed for the CUDA backend when every node runs it, else
// (conservatively) for the CPU backend; KV capacity beyond what a full
// batch at the model's context uses counts for nothing in choosing the
// nodes.
func (d *Daemon) place(nodes []placement.Node, ranges []placement.Range) (placement.Plan, error) {
	backend := BackendCUDA
	for _, n := range nodes {
		if n.Backend != BackendCUDA {
			backend = BackendCPU
		}
	}
	cost := backendCost(d.ckpt.Config(), backend, d.cfg.Stage.MaxBatchTokens, d.cfg.Stage.MaxSeqs)
	cost.MaxKVTokens = placement.UsableKVTokens(d.ckpt.Config(), d.cfg.Stage.MaxSeqs, d.cfg.Stage.BlockSize)
	if len(ranges) == 0 {
		return placement.Balance(nodes, cost)
	}
	return placement.Explicit(nodes, ranges, cost)
}

// nodeDialer reaches other nodes' Node service over gRPC.
type nodeDialer struct{ opts []grpc.DialOption }

func (n nodeDialer) DialNode(addr string) (tandemv1.NodeClient, io.Closer, error) {
	c, err := grpc.NewClient(addr, n.opts...)
	if err != nil {
		return nil, nil, err
	}
	return tandemv1.NewNodeClient(c), c, nil
}

// probe checks that the node at addr answers its gRPC health service.
func (d *Daemon) probe(ctx context.Context, addr string) error {
	c, err := grpc.NewClient(addr, d.dialOpts...)
	if err != nil {
		return err
	}
	defer c.Close()
	_, err = healthpb.NewHealthClient(c).Check(ctx, &healthpb.HealthCheckRequest{})
	return err
}

// onStatus follows the supervisor: health is SERVING while a pipeline this
// node leads serves, and systemd hears READY=1 once one does.
func (d *Daemon) onStatus(s supervise.Snapshot) {
	d.leaders.set(s.Leader.Name)
	d.mu.Lock()
	serving := s.Epoch != 0 && !d.draining
	changed := serving != d.serving
	d.serving = serving
	d.mu.Unlock()
	if !changed {
		return
	}
	d.setHealth(serving)
	if serving {
		d.notifyReady("leading a pipeline")
	}
}
