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

// stageCandidates are the live members offering a stage of the model.
func stageCandidates(members []membership.Member, modelID string) []membership.Member {
	var out []membership.Member
	for _, m := range members {
		if liveStageNode(m) && m.Meta.ModelID == modelID {
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
// model directory that differs from the leader's), which an operator
// would otherwise only find by comparing identities in the member table.
func waitingReason(members []membership.Member, modelID string, have, want int) string {
	reason := fmt.Sprintf("waiting for stage nodes: %d of %d up", have, want)
	var other []string
	for _, m := range members {
		if liveStageNode(m) && m.Meta.ModelID != modelID {
			other = append(other, fmt.Sprintf("%s has model %s", m.Name, nodewire.Short(m.Meta.ModelID)))
		}
	}
	if len(other) > 0 {
		reason += fmt.Sprintf(" (left out: %s; the leader has model %s)", strings.Join(other, ", "), nodewire.Short(modelID))
	}
	return reason
}
