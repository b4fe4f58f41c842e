package membership

// metaDelegate is the memberlist.Delegate: it supplies this node's encoded
// metadata. The user-message and state-exchange hooks are unused: all
// cluster state this package shares travels in the metadata.
type metaDelegate struct{ m *Membership }

// NodeMeta returns the encoded local metadata; setMeta has already
// checked that it fits memberlist.MetaMaxSize, the only limit memberlist
// passes.
func (d metaDelegate) NodeMeta(limit int) []byte {
	d.m.metaMu.Lock()
	defer d.m.metaMu.Unlock()
	return d.m.meta
}

func (metaDelegate) NotifyMsg([]byte)                           {}
func (metaDelegate) GetBroadcasts(overhead, limit int) [][]byte { return nil }
func (metaDelegate) LocalState(join bool) []byte                { return nil }
func (metaDelegate) MergeRemoteState(buf []byte, join bool)     {}
