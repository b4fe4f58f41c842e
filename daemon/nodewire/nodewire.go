package nodewire

import "net"

// EpochTrailer is the gRPC trailer in which a node refusing a stale
// leader epoch says the newest epoch it has accepted, so the leader's
// next attempt uses a newer one.
const EpochTrailer = "tandem-epoch"

// Advertised rewrites the host of a bound address to the advertised host,
// when one is configured.
func Advertised(addr, host string) string {
	if host == "" {
		return addr
	}
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	return net.JoinHostPort(host, port)
}

// Short abbreviates a model identity for messages.
func Short(id string) string {
	if len(id) > 12 {
		return id[:12]
	}
	return id
}
