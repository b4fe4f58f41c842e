package stagehost

import (
	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/daemon/nodewire"
	"github.com/tandem-llm/tandem/pipeline"
)

// A stage's links are authenticated with the cluster credential
// (Config.Credential, package linkauth): the leader's control link into
// the stage, named for this node, and the TCP links between stages, named
// for the layer they enter, each bound to the assignment's epoch. A
// connection that cannot prove it holds the credential for that link and
// epoch is refused and logged, and the listener waits for the right peer.
// Without a credential (loopback, or --insecure) links are named and
// epoch-checked only.

// controlConfig is the control link of this node's stage of epoch.
func (s *Slot) controlConfig(epoch uint64) pipeline.ControlConfig {
	return pipeline.ControlConfig{Link: nodewire.ControlLink(s.cfg.Name), Epoch: epoch, Credential: s.cfg.Credential, Logger: s.log}
}

// listenConfig is the TCP link named link coming into the stage of epoch.
func (s *Slot) listenConfig(link string, epoch uint64) collective.ListenConfig {
	return collective.ListenConfig{Link: link, Epoch: epoch, Credential: s.cfg.Credential, Logger: s.log}
}

// dialConfig is the TCP link named link going out of the stage of epoch.
func (s *Slot) dialConfig(link string, epoch uint64) collective.DialConfig {
	return collective.DialConfig{Link: link, Epoch: epoch, Credential: s.cfg.Credential}
}
