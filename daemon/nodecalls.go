package daemon

import (
	"context"
	"sync"
	"time"

	"github.com/tandem-llm/tandem/daemon/apierr"
	"github.com/tandem-llm/tandem/daemon/nodeauth"
	"github.com/tandem-llm/tandem/daemon/nodewire"
	"google.golang.org/grpc"
)

// The Node service (this node's stage slot) serves only the leader: every
// call must prove it comes from the cluster (package nodeauth, with the
// cluster credential when a secret is configured) and come from the node
// that this node's membership says leads. Membership views converge
// within a gossip round or two, so a call from a node that is not (yet)
// the leader here waits up to leaderAgreeWait for the view to agree
// before it is refused.

// leaderAgreeWait bounds how long a Node call waits for this node's
// membership to name its caller the leader.
const leaderAgreeWait = 2 * time.Second

// leaderWatch follows the leader this node's supervisor sees.
type leaderWatch struct {
	mu      sync.Mutex
	name    string
	changed chan struct{} // closed when name changes
}

// set records the leader's name ("" while there is none).
func (w *leaderWatch) set(name string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.changed == nil {
		w.changed = make(chan struct{})
	}
	if name != w.name {
		w.name = name
		close(w.changed)
		w.changed = make(chan struct{})
	}
}

// get returns the leader's name and a channel closed when it changes.
func (w *leaderWatch) get() (string, <-chan struct{}) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.changed == nil {
		w.changed = make(chan struct{})
	}
	return w.name, w.changed
}

// await returns nil once caller is the leader, within wait (and ctx);
// else an error naming the leader.
func (w *leaderWatch) await(ctx context.Context, wait time.Duration, node, caller, method string) error {
	timer := time.NewTimer(wait)
	defer timer.Stop()
	for {
		leader, changed := w.get()
		if leader == caller {
			return nil
		}
		select {
		case <-changed:
			continue
		case <-timer.C:
		case <-ctx.Done():
		}
		if leader == "" {
			return apierr.Forbiddenf("%s from node %q: node %s knows no leader, and takes plans only from the leader", method, caller, node)
		}
		return apierr.Forbiddenf("%s from node %q: node %s takes plans only from the leader, which its membership says is %q", method, caller, node, leader)
	}
}

// nodeVerifier checks the Node calls this node serves.
func (d *Daemon) nodeVerifier() *nodeauth.Verifier {
	return nodeauth.NewVerifier(nodeauth.VerifierConfig{
		Protocol:   nodewire.Protocol,
		Credential: d.sec.cred,
		Authorize: func(ctx context.Context, caller, method string) error {
			return d.leaders.await(ctx, leaderAgreeWait, d.cfg.Name, caller, method)
		},
	})
}

// nodeSigner signs this node's calls of other nodes' Node service.
func nodeSigner(name string, sec secrets) grpc.DialOption {
	return grpc.WithChainUnaryInterceptor(nodeauth.Signer{Node: name, Protocol: nodewire.Protocol, Credential: sec.cred}.Unary)
}
