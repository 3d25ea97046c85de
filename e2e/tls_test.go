package e2e

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strings"
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
func tlsServer(t *testing.T, directives ...string) (p *caddyProc, port int) {
	t.Helper()
	return tlsServerWithGlobals(t, "", directives...)
}

// tlsServerWithGlobals is tlsServer with extra global options.
func tlsServerWithGlobals(t *testing.T, globals string, directives ...string) (p *caddyProc, port int) {
	t.Helper()
	return startTLSCaddy(t, globals, func(port int) string {
		return fmt.Sprintf(`https://localhost:%d {
	tls internal
	sse /events {
		channel {query.channels}
		close_jitter 2s
		%s
		publish {
			secret %s
		}
	}
}
`, port, strings.Join(directives, "\n\t\t"), testSecret)
	})
}

// startTLSCaddy starts Caddy on free ports with a local CA (nothing
// installed), the extra global options, and the sites that site gives for
// the HTTPS port.
func startTLSCaddy(t *testing.T, globals string, site func(port int) string) (*caddyProc, int) {
	t.Helper()
	adminPort, httpPort := freePort(t, false), freePort(t, false)
	port := freePort(t, true)
	p := startCaddy(t, fmt.Sprintf("127.0.0.1:%d", adminPort), fmt.Sprintf(`{
	admin 127.0.0.1:%d
	storage file_system %s
	local_certs
	skip_install_trust
	http_port %d
	https_port %d
	auto_https disable_redirects
	%s
}

%s`, adminPort, t.TempDir(), httpPort, port, globals, site(port)))
	return p, port
}

// tlsClient returns a client of the TLS site on port (127.0.0.1, named
// localhost, its certificate not checked) and the site's stream URL: HTTP/2
// if h2, else HTTP/1.1 only.
func tlsClient(t *testing.T, port int, h2 bool) (*http.Client, string) {
	t.Helper()
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	var dialer net.Dialer
	tr := &http.Transport{
		TLSClientConfig:   &tls.Config{InsecureSkipVerify: true, ServerName: "localhost"},
		ForceAttemptHTTP2: h2,
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return dialer.DialContext(ctx, network, addr)
		},
	}
	if !h2 {
		tr.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
	}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}, fmt.Sprintf("https://localhost:%d/events", port)
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
	client, base := tlsClient(t, port, true)

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

// TestTLSHTTP1Streams: HTTP/1.1 streams over TLS (which the takeover writer
// takes over too, writing through crypto/tls from goroutines) get every
// event in order, a client that leaves is released, and on SIGTERM the
// others are told server_closing and the process exits promptly.
func TestTLSHTTP1Streams(t *testing.T) {
	p, port := tlsServer(t)
	client, base := tlsClient(t, port, false)

	leaving := openTLSStream(t, client, base+"?channels=news", 1)
	streams := []*sseConn{
		openTLSStream(t, client, base+"?channels=news", 1),
		openTLSStream(t, client, base+"?channels=news", 1),
	}
	waitOpenStreams(t, p, 3)
	leaving.close()
	waitOpenStreams(t, p, 2)

	var want []string
	for i := range 50 {
		want = append(want, fmt.Sprintf("over-tls-%d", i))
		publish(t, client, base, testSecret, "news", want[i])
	}
	deadline := time.Now().Add(waitFor)
	forAll(t, streams, func(_ int, c *sseConn) error { return c.expectData(deadline, want...) })

	began := time.Now()
	p.signal(syscall.SIGTERM)
	expectShutdown(t, p, streams, began)
}

// TestTLSHTTP1SlowClient: a TLS HTTP/1.1 client that stops reading (small
// receive buffer) while large events are published is cut off after the
// slow-client timeout and throttled; a stream beside it on the same channel
// gets every event, in order.
func TestTLSHTTP1SlowClient(t *testing.T) {
	p, port := tlsServer(t, "slow_client_timeout 1s", "throttle 30s")
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	tlsConfig := &tls.Config{InsecureSkipVerify: true, ServerName: "localhost", NextProtos: []string{"http/1.1"}}
	client, base := tlsClient(t, port, false)
	healthy := openTLSStream(t, client, base+"?channels=news", 1)

	stalled := openStalledTLSStream(t, addr, tlsConfig, "/events?channels=news")
	waitOpenStreams(t, p, 2)
	payload := strings.Repeat("x", 8<<10)
	deadline := time.Now().Add(2 * waitFor)
	published := 0
	for open := 2; open == 2; open, _ = openStreamCount(p.adminAddr) {
		if time.Now().After(deadline) {
			t.Fatalf("the stalled client was not cut off after %d events", published)
		}
		// the healthy stream reads each event as it comes, in order
		want := fmt.Sprintf("%d-%s", published, payload)
		publish(t, client, base, testSecret, "news", want)
		published++
		if err := healthy.expectData(deadline, want); err != nil {
			t.Fatalf("the healthy stream, event %d: %.200v", published, err)
		}
	}
	_ = stalled.Close()
	// throttled: the same client (no principal: the address) is refused
	resp, err := client.Get(base + "?channels=news")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("reconnect after being cut off: status %d, Retry-After %q; want 429 with Retry-After", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
}

// TestTLSHTTP1Heartbeat: an idle TLS HTTP/1.1 stream gets heartbeats (the
// takeover writer writes them from a goroutine of their own).
func TestTLSHTTP1Heartbeat(t *testing.T) {
	_, port := tlsServer(t, "heartbeat 200ms")
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	config := &tls.Config{InsecureSkipVerify: true, ServerName: "localhost", NextProtos: []string{"http/1.1"}}
	var conn *tls.Conn
	deadline := time.Now().Add(waitFor)
	for {
		var err error
		if conn, err = tls.Dial("tcp", addr, config); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond) // the certificate may not be ready yet
	}
	t.Cleanup(func() { _ = conn.Close() })
	_ = conn.SetDeadline(deadline)
	fmt.Fprintf(conn, "GET /events?channels=news HTTP/1.1\r\nHost: localhost\r\nAccept: text/event-stream\r\n\r\n")
	r := bufio.NewReader(conn)
	beats := 0
	for beats < 3 {
		line, err := r.ReadString('\n')
		if err != nil {
			t.Fatalf("after %d heartbeats: %v", beats, err)
		}
		if strings.Contains(line, ": heartbeat") {
			beats++
		}
	}
}

// openStalledTLSStream opens a stream with a 4 KiB receive buffer, reads
// its response head and then nothing more.
func openStalledTLSStream(t *testing.T, addr string, config *tls.Config, path string) net.Conn {
	t.Helper()
	dialer := net.Dialer{Control: func(_, _ string, c syscall.RawConn) error {
		return c.Control(func(fd uintptr) {
			_ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096)
		})
	}}
	conn, err := tls.DialWithDialer(&dialer, "tcp", addr, config)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	_ = conn.SetDeadline(time.Now().Add(waitFor))
	fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: localhost\r\nAccept: text/event-stream\r\n\r\n", path)
	head, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil || !strings.Contains(head, " 200 ") {
		t.Fatalf("stalled stream: %q, %v", head, err)
	}
	return conn
}

// waitOpenStreams waits until the admin API counts n open streams.
func waitOpenStreams(t *testing.T, p *caddyProc, n int) {
	t.Helper()
	deadline := time.Now().Add(waitFor)
	for {
		open, err := openStreamCount(p.adminAddr)
		if err == nil && open == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("open streams: %d (%v), want %d", open, err, n)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func openStreamCount(adminAddr string) (int, error) {
	resp, err := http.Get("http://" + adminAddr + "/sse/stats")
	if err != nil {
		return -1, err
	}
	defer resp.Body.Close()
	var stats struct {
		OpenStreams int `json:"open_streams"`
	}
	err = json.NewDecoder(resp.Body).Decode(&stats)
	return stats.OpenStreams, err
}

// h3Client speaks HTTP/3 (QUIC) to the TLS site on port.
func h3Client(t *testing.T, port int) *http.Client {
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	tr := &http3.Transport{
		TLSClientConfig: &tls.Config{InsecureSkipVerify: true, ServerName: "localhost"},
		Dial: func(ctx context.Context, _ string, tlsCfg *tls.Config, cfg *quic.Config) (*quic.Conn, error) {
			return quic.DialAddrEarly(ctx, addr, tlsCfg, cfg)
		},
	}
	t.Cleanup(func() { _ = tr.Close() })
	return &http.Client{Transport: tr}
}

// TestStopClosesHTTP3Streams: the same over HTTP/3 (QUIC on the same port).
// quic-go's HTTP/3 server waits in its graceful shutdown until clients
// close their connections, which a client does once its requests are done:
// the streams must end for the process to exit.
func TestStopClosesHTTP3Streams(t *testing.T) {
	p, port := tlsServer(t)
	client := h3Client(t, port)
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

// TestHTTP2StreamsDeliverInOrder: HTTP/2 streams (whose steps run on
// goroutines of their own) get every event in order, with ids, and a
// reconnect with the last id resumes exactly after it.
func TestHTTP2StreamsDeliverInOrder(t *testing.T) {
	_, port := tlsServer(t, "heartbeat 100ms")
	client, base := tlsClient(t, port, true)
	first := openTLSStream(t, client, base+"?channels=news", 2)
	var want []string
	for i := range 50 {
		want = append(want, fmt.Sprintf("h2-%d", i))
		publish(t, client, base, testSecret, "news", want[i])
	}
	deadline := time.Now().Add(waitFor)
	if err := first.expectData(deadline, want[:25]...); err != nil {
		t.Fatal(err)
	}
	lastID := first.lastEventID()
	first.close()
	resumed := openStream(t, client, base+"?channels=news", lastID)
	if err := resumed.expectData(deadline, want[25:]...); err != nil {
		t.Fatalf("resuming after %q: %v", lastID, err)
	}
}
