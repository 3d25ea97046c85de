package e2e

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"syscall"
	"testing"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"
)

// tlsServer starts caddy with an HTTPS site on localhost with a
// certificate from Caddy's internal CA, kept in a temporary storage (not
// in $HOME, and never installed in a trust store). Caddy serves HTTP/1.1
// and HTTP/2 over TCP and HTTP/3 over UDP on the same port.
func tlsServer(t *testing.T) (p *caddyProc, port int) {
	t.Helper()
	adminPort, httpPort := freePort(t, false), freePort(t, false)
	port = freePort(t, true)
	storage := t.TempDir()
	p = startCaddy(t, fmt.Sprintf("127.0.0.1:%d", adminPort), fmt.Sprintf(`{
	admin 127.0.0.1:%d
	storage file_system %s
	local_certs
	skip_install_trust
	http_port %d
	https_port %d
	auto_https disable_redirects
}

https://localhost:%d {
	tls internal
	sse /events {
		channel {query.channels}
		close_jitter 2s
		publish {
			secret %s
		}
	}
}
`, adminPort, storage, httpPort, port, port, testSecret))
	return p, port
}

// openTLSStream opens a stream, retrying while the server may still be
// getting its certificate, and checks the protocol it was served with.
func openTLSStream(t *testing.T, client *http.Client, url string, protoMajor int) *sseConn {
	t.Helper()
	deadline := time.Now().Add(waitFor)
	for {
		c, err := tryOpenStream(client, url, "", deadline)
		if err == nil {
			t.Cleanup(c.close)
			if c.resp.ProtoMajor != protoMajor {
				t.Fatalf("stream served over %s, want HTTP/%d", c.resp.Proto, protoMajor)
			}
			checkPreamble(t, c)
			return c
		}
		if time.Now().After(deadline) {
			t.Fatalf("opening an HTTP/%d stream: %v", protoMajor, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestStopClosesHTTP2Streams: an HTTP/2 stream is told server_closing with
// reason shutdown on SIGTERM, and the process exits promptly (Go's HTTP/2
// server waits for open streams in its graceful shutdown).
func TestStopClosesHTTP2Streams(t *testing.T) {
	p, port := tlsServer(t)
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	var dialer net.Dialer
	tr := &http.Transport{
		TLSClientConfig:   &tls.Config{InsecureSkipVerify: true, ServerName: "localhost"},
		ForceAttemptHTTP2: true,
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return dialer.DialContext(ctx, network, addr)
		},
	}
	t.Cleanup(tr.CloseIdleConnections)
	client := &http.Client{Transport: tr}
	base := fmt.Sprintf("https://localhost:%d/events", port)

	streams := []*sseConn{
		openTLSStream(t, client, base+"?channels=news", 2),
		openTLSStream(t, client, base+"?channels=news", 2), // same connection, second stream
	}
	publish(t, client, base, testSecret, "news", "over-h2")
	deadline := time.Now().Add(waitFor)
	forAll(t, streams, func(_ int, c *sseConn) error { return c.expectData(deadline, "over-h2") })

	began := time.Now()
	p.signal(syscall.SIGTERM)
	expectShutdown(t, p, streams, began)
}

// TestStopClosesHTTP3Streams: the same over HTTP/3 (QUIC on the same port).
// quic-go's HTTP/3 server waits in its graceful shutdown until clients
// close their connections, which a client does once its requests are done:
// the streams must end for the process to exit.
func TestStopClosesHTTP3Streams(t *testing.T) {
	p, port := tlsServer(t)
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	tr := &http3.Transport{
		TLSClientConfig: &tls.Config{InsecureSkipVerify: true, ServerName: "localhost"},
		Dial: func(ctx context.Context, _ string, tlsCfg *tls.Config, cfg *quic.Config) (*quic.Conn, error) {
			return quic.DialAddrEarly(ctx, addr, tlsCfg, cfg)
		},
	}
	t.Cleanup(func() { _ = tr.Close() })
	client := &http.Client{Transport: tr}
	base := fmt.Sprintf("https://localhost:%d/events", port)

	streams := []*sseConn{
		openTLSStream(t, client, base+"?channels=news", 3),
		openTLSStream(t, client, base+"?channels=news", 3), // same connection, second stream
	}
	publish(t, client, base, testSecret, "news", "over-h3")
	deadline := time.Now().Add(waitFor)
	forAll(t, streams, func(_ int, c *sseConn) error { return c.expectData(deadline, "over-h3") })

	began := time.Now()
	p.signal(syscall.SIGTERM)
	expectShutdown(t, p, streams, began)
}
