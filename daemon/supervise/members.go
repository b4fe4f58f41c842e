package supervise

import (
	"fmt"
	"strings"

	"github.com/tandem-llm/tandem/daemon/membership"
	"github.com/tandem-llm/tandem/daemon/nodewire"
)

// ChooseLeader is the configured leader when it is alive, else (with no
// leader configured) the leader-eligible live member with the smallest
// name. Every member computes the same from the same view.
func ChooseLeader(fixed string, members []membership.Member) membership.Member {
	for _, m := range members {
		if m.State != membership.Alive || m.MetaErr != nil {
			continue
		}
		if (fixed != "" && m.Name == fixed) || (fixed == "" && m.Meta.LeaderEligible) {
			return m // members are sorted by name
		}
	}
	return membership.Member{}
}

// kin is what a stage node must share with the leader to be placed: the
// model's identity and, when the leader names them, the internal
// protocol versions.
type kin struct{ modelID, protocol string }

func (c CoreConfig) kin() kin { return kin{c.ModelID, c.Protocol} }

// differs says how m differs from the leader ("": it does not).
func (k kin) differs(m membership.Member) string {
	switch {
	case m.Meta.ModelID != k.modelID:
		return fmt.Sprintf("%s has model %s", m.Name, nodewire.Short(m.Meta.ModelID))
	case k.protocol != "" && m.Meta.Protocol == "":
		return fmt.Sprintf("%s runs an older tandem (it gossips no internal protocol), the leader speaks %q", m.Name, k.protocol)
	case k.protocol != "" && m.Meta.Protocol != k.protocol:
		return fmt.Sprintf("%s speaks internal protocol %q, the leader %q", m.Name, m.Meta.Protocol, k.protocol)
	}
	return ""
}

// stageCandidates are the live members offering a stage of the model, in
// the leader's protocol.
func stageCandidates(members []membership.Member, k kin) []membership.Member {
	var out []membership.Member
	for _, m := range members {
		if liveStageNode(m) && k.differs(m) == "" {
			out = append(out, m)
		}
	}
	return out
}

// liveStageNode reports whether m is alive and offers a stage.
func liveStageNode(m membership.Member) bool {
	return m.State == membership.Alive && m.MetaErr == nil && m.Meta.DataAddr != ""
}

// waitingReason says why the leader has too few stage candidates, naming
// the live stage nodes it left out because they serve another model (a
// model directory that differs from the leader's) or speak other
// internal protocol versions (another tandem version), which an operator
// would otherwise only find by comparing the member table.
func waitingReason(members []membership.Member, k kin, have, want int) string {
	reason := fmt.Sprintf("waiting for stage nodes: %d of %d up", have, want)
	var other []string
	for _, m := range members {
		if d := k.differs(m); liveStageNode(m) && d != "" {
			other = append(other, d)
		}
	}
	if len(other) > 0 {
		reason += fmt.Sprintf(" (left out: %s; the leader has model %s)", strings.Join(other, ", "), nodewire.Short(k.modelID))
	}
	return reason
}
