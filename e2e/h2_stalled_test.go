package e2e

import (
	"bytes"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// dialStalledH2 opens an HTTP/2-over-TLS connection with a tiny receive
// buffer, grants a huge flow-control window, opens one stream of path,
// reads up to its response headers, then never reads the socket again.
func dialStalledH2(t *testing.T, addr, path string) net.Conn {
	t.Helper()
	d := &net.Dialer{Control: func(_, _ string, c syscall.RawConn) error {
		return c.Control(func(fd uintptr) {
			_ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096)
		})
	}}
	conn, err := tls.DialWithDialer(d, "tcp", addr, &tls.Config{InsecureSkipVerify: true, ServerName: "localhost", NextProtos: []string{"h2"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	if conn.ConnectionState().NegotiatedProtocol != "h2" {
		t.Fatalf("negotiated %q", conn.ConnectionState().NegotiatedProtocol)
	}
	_, _ = io.WriteString(conn, http2.ClientPreface)
	fr := http2.NewFramer(conn, conn)
	_ = fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1<<31 - 1})
	_ = fr.WriteSettingsAck()
	_ = fr.WriteWindowUpdate(0, 1<<31-1-65535)
	var buf bytes.Buffer
	enc := hpack.NewEncoder(&buf)
	for _, kv := range [][2]string{{":method", "GET"}, {":scheme", "https"}, {":authority", "localhost"}, {":path", path}} {
		_ = enc.WriteField(hpack.HeaderField{Name: kv[0], Value: kv[1]})
	}
	if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: buf.Bytes(), EndStream: true, EndHeaders: true}); err != nil {
		t.Fatal(err)
	}
	return conn
}

// A SIGTERM with an HTTP/2 client open that stopped reading its connection
// (TCP, not flow control: the reset a passed write deadline sends cannot
// go out) exits promptly, and the stream beside it is told server_closing.
// It used to wait for ever: net/http's HTTP/2 server ends a stream once its
// reset is written, and Caddy's eternal grace period waits for the stream.
func TestTLSStopWithTCPStalledH2ClientIsBounded(t *testing.T) {
	p, port := tlsServer(t, "max_event_size 256KiB", "history_bytes 256MiB")
	client, base := tlsClient(t, port, false)
	healthy := openTLSStream(t, client, base+"?channels=other", 1)
	_ = dialStalledH2(t, fmt.Sprintf("127.0.0.1:%d", port), "/events?channels=news")
	waitOpenStreams(t, p, 2)
	payload := strings.Repeat("q", 200<<10)
	for i := range 60 { // 12 MB: more than the sockets' buffers hold
		publish(t, client, base, testSecret, "news", fmt.Sprintf("%d-%s", i, payload))
	}
	time.Sleep(time.Second)
	began := time.Now()
	p.signal(syscall.SIGTERM)
	expectShutdown(t, p, []*sseConn{healthy}, began)
}
