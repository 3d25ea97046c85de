package e2e

import (
	"crypto/tls"
	"fmt"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/h2stall"
)

// dialStalledH2 opens an HTTP/2-over-TLS stream of path on a connection it
// then never reads (h2stall).
func dialStalledH2(t *testing.T, addr, path string) net.Conn {
	t.Helper()
	conn, err := tls.DialWithDialer(h2stall.Dialer(), "tcp", addr, &tls.Config{InsecureSkipVerify: true, ServerName: "localhost", NextProtos: []string{"h2"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	if conn.ConnectionState().NegotiatedProtocol != "h2" {
		t.Fatalf("negotiated %q", conn.ConnectionState().NegotiatedProtocol)
	}
	h2stall.OpenStream(t, conn, "https", "localhost", path)
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
