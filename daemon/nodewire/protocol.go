package nodewire

import (
	"fmt"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/pipeline"
)

// NodeVersion is the version of the Node service's conventions: its
// messages and the authentication of its calls (package nodeauth).
const NodeVersion = 1

// Protocol names the versions of the internal protocols a node speaks:
// the Node service, the control links (pipeline.ControlVersion) and the
// TCP data links (collective.ProtocolVersion). Members gossip it, the
// leader places only stage nodes that speak the same, and Node calls
// carry it; a node of other versions is refused with both named.
var Protocol = fmt.Sprintf("node/%d control/%d data/%d", NodeVersion, pipeline.ControlVersion, collective.ProtocolVersion)

// ControlLink names the control link from the leader to the stage on node,
// bound into the link's handshake (with the epoch), so that a proof made
// for one node's link is worth nothing on another's.
func ControlLink(node string) string { return "control->" + node }
