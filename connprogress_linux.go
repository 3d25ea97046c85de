//go:build linux

package caddysse

import (
	"net"
	"syscall"

	"golang.org/x/sys/unix"
)

// connAcked returns how many bytes the peer of c has acknowledged so far
// (TCP_INFO's bytes_acked), looking through the wrappers that expose the
// connection under them (TLS); false where it cannot be read. A client
// that takes nothing acknowledges nothing: its receive window is closed.
func connAcked(c net.Conn) (uint64, bool) {
	for range 8 {
		if sc, ok := c.(syscall.Conn); ok {
			raw, err := sc.SyscallConn()
			if err != nil {
				return 0, false
			}
			var info *unix.TCPInfo
			var infoErr error
			if err := raw.Control(func(fd uintptr) {
				info, infoErr = unix.GetsockoptTCPInfo(int(fd), unix.IPPROTO_TCP, unix.TCP_INFO)
			}); err != nil || infoErr != nil {
				return 0, false
			}
			return info.Bytes_acked, true
		}
		u, ok := c.(interface{ NetConn() net.Conn })
		if !ok {
			return 0, false
		}
		c = u.NetConn()
	}
	return 0, false
}
