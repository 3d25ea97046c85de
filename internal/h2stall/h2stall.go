// Package h2stall makes, for tests, an HTTP/2 client that stopped reading
// its connection: not one stream's flow-control window withheld, which
// the server answers with a reset at once, but the socket itself left
// unread, so that nothing the server writes on it gets through.
package h2stall

import (
	"bytes"
	"io"
	"net"
	"syscall"
	"testing"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// Dialer dials sockets with a tiny receive buffer, so that a client that
// stops reading soon blocks the server's writes.
func Dialer() *net.Dialer {
	return &net.Dialer{Control: func(_, _ string, c syscall.RawConn) error {
		return c.Control(func(fd uintptr) {
			_ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096)
		})
	}}
}

// OpenStream speaks HTTP/2 on conn (a connection of Dialer, cleartext or
// TLS with h2 negotiated): it grants the server the largest flow-control
// windows, so that only TCP can hold it back, opens a GET stream of path,
// and never reads the connection.
func OpenStream(t testing.TB, conn net.Conn, scheme, authority, path string) {
	t.Helper()
	if _, err := io.WriteString(conn, http2.ClientPreface); err != nil {
		t.Fatal(err)
	}
	fr := http2.NewFramer(conn, conn)
	_ = fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1<<31 - 1})
	_ = fr.WriteSettingsAck()
	_ = fr.WriteWindowUpdate(0, 1<<31-1-65535)
	var buf bytes.Buffer
	enc := hpack.NewEncoder(&buf)
	for _, kv := range [][2]string{{":method", "GET"}, {":scheme", scheme}, {":authority", authority}, {":path", path}} {
		_ = enc.WriteField(hpack.HeaderField{Name: kv[0], Value: kv[1]})
	}
	if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: buf.Bytes(), EndStream: true, EndHeaders: true}); err != nil {
		t.Fatal(err)
	}
}
