//go:build !linux

package caddysse

import "net"

// connAcked cannot tell a connection's progress here: a stream stuck past
// its deadline has its connection closed (see breakIfStuck).
func connAcked(net.Conn) (uint64, bool) { return 0, false }
