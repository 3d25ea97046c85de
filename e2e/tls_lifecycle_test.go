package e2e

import (
	"bufio"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"
)

// A reload tells HTTP/1.1-over-TLS, HTTP/2 and HTTP/3 streams
// server_closing (reason reload) exactly once, then ends them, and the
// reload returns promptly (SPEC S8).
func TestTLSReloadClosesEveryProtocolOnce(t *testing.T) {
	p, port := tlsServer(t)
	h1, base := tlsClient(t, port, false)
	h2, _ := tlsClient(t, port, true)
	h3 := h3Client(t, port)
	streams := []*sseConn{
		openTLSStream(t, h1, base+"?channels=news", 1),
		openTLSStream(t, h1, base+"?channels=news", 1),
		openTLSStream(t, h2, base+"?channels=news", 2),
		openTLSStream(t, h2, base+"?channels=news", 2),
		openTLSStream(t, h3, base+"?channels=news", 3),
		openTLSStream(t, h3, base+"?channels=news", 3),
	}
	publish(t, h1, base, testSecret, "news", "before")
	deadline := time.Now().Add(waitFor)
	forAll(t, streams, func(_ int, c *sseConn) error { return c.expectData(deadline, "before") })
	began := time.Now()
	took := p.reload()
	t.Logf("reload returned in %s", took)
	deadline = time.Now().Add(waitFor)
	forAll(t, streams, func(_ int, c *sseConn) error {
		if _, err := c.expectClosing(deadline, "reload", closeJitter); err != nil {
			return err
		}
		return c.expectEnd(deadline)
	})
	if d := time.Since(began); d > 5*time.Second {
		t.Errorf("streams ended %s after the reload began", d)
	}
	waitOpenStreams(t, p, 0)
}

// stallTLS opens a stalled TLS HTTP/1.1 stream and publishes large events
// until the server can no longer write to it (its socket buffers are full).
func stallTLS(t *testing.T, p *caddyProc, port int, client *http.Client, base string) net.Conn {
	t.Helper()
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	cfg := &tls.Config{InsecureSkipVerify: true, ServerName: "localhost", NextProtos: []string{"http/1.1"}}
	stalled := openStalledTLSStream(t, addr, cfg, "/events?channels=news")
	payload := strings.Repeat("y", 60<<10)
	for i := range 120 { // ~7 MiB: more than loopback socket buffers hold
		publish(t, client, base, testSecret, "news", fmt.Sprintf("%d-%s", i, payload))
	}
	return stalled
}

// A reload with a stalled TLS HTTP/1.1 client open returns promptly, the
// healthy streams beside it get server_closing once, and the stalled one
// is ended within lastWordsTimeout (1 s) plus a margin, not the
// slow-client timeout (30 s by default).
func TestTLSReloadWithStalledClientIsBounded(t *testing.T) {
	p, port := tlsServer(t)
	client, base := tlsClient(t, port, false)
	healthy := openTLSStream(t, client, base+"?channels=other", 1)
	stalled := stallTLS(t, p, port, client, base)
	_ = stalled
	waitOpenStreams(t, p, 2)
	began := time.Now()
	took := p.reload()
	t.Logf("reload returned in %s", took)
	deadline := time.Now().Add(waitFor)
	if _, err := healthy.expectClosing(deadline, "reload", closeJitter); err != nil {
		t.Fatal(err)
	}
	if err := healthy.expectEnd(deadline); err != nil {
		t.Fatal(err)
	}
	for {
		n, err := openStreamCount(p.adminAddr)
		if err == nil && n == 0 {
			break
		}
		if time.Since(began) > 4*time.Second {
			t.Fatalf("%d streams still open %s after the reload began (a stalled client must be ended within lastWordsTimeout)", n, time.Since(began))
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("all streams ended %s after the reload began", time.Since(began))
}

// A stop with a stalled TLS HTTP/1.1 client exits promptly.
func TestTLSStopWithStalledClientIsBounded(t *testing.T) {
	p, port := tlsServer(t)
	client, base := tlsClient(t, port, false)
	healthy := openTLSStream(t, client, base+"?channels=other", 1)
	_ = stallTLS(t, p, port, client, base)
	waitOpenStreams(t, p, 2)
	began := time.Now()
	p.signal(syscall.SIGTERM)
	expectShutdown(t, p, []*sseConn{healthy}, began)
}

// Caddy's `timeouts { write }` does not cut TLS streams: HTTP/1.1 (taken
// over or not), HTTP/2 and HTTP/3, silent or with heartbeats (SPEC S2).
func TestTLSWriteTimeoutDoesNotCutStreams(t *testing.T) {
	for _, tc := range []struct{ name, timeouts, heartbeat string }{
		{"heartbeats", "write 500ms", "200ms"},
		{"silent", "write 500ms", "off"},
		{"no idle writer, heartbeats", "write 500ms\n\t\t\twrite_idle -1s", "200ms"},
		{"no idle writer, silent", "write 500ms\n\t\t\twrite_idle -1s", "off"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, port := tlsServerWithGlobals(t, "servers {\n\t\ttimeouts {\n\t\t\t"+tc.timeouts+"\n\t\t}\n\t}", "heartbeat "+tc.heartbeat)
			_ = p
			h1, base := tlsClient(t, port, false)
			h2, _ := tlsClient(t, port, true)
			h3 := h3Client(t, port)
			streams := []*sseConn{
				openTLSStream(t, h1, base+"?channels=news", 1),
				openTLSStream(t, h2, base+"?channels=news", 2),
				openTLSStream(t, h3, base+"?channels=news", 3),
			}
			time.Sleep(2 * time.Second)
			publish(t, h1, base, testSecret, "news", "late")
			deadline := time.Now().Add(waitFor)
			forAll(t, streams, func(_ int, c *sseConn) error { return c.expectData(deadline, "late") })
		})
	}
}

// A stalled HTTP/2 or HTTP/3 client (it reads nothing) while large
// events are published is cut off as slow (and throttled), and a stream
// beside it on another connection keeps getting every event.
func TestStalledH2H3ClientIsCutAsSlow(t *testing.T) {
	for _, proto := range []int{2, 3} {
		t.Run(fmt.Sprintf("HTTP/%d", proto), func(t *testing.T) {
			p, port := tlsServer(t, "slow_client_timeout 1s", "throttle 30s")
			pub, base := tlsClient(t, port, false)
			var stallClient *http.Client
			if proto == 2 {
				stallClient, _ = tlsClient(t, port, true)
			} else {
				stallClient = h3Client(t, port)
			}
			// opened and never read beyond its preamble
			req, _ := http.NewRequest(http.MethodGet, base+"?channels=news", nil)
			var resp *http.Response
			deadline := time.Now().Add(waitFor)
			for {
				var err error
				resp, err = stallClient.Do(req)
				if err == nil {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal(err)
				}
				time.Sleep(100 * time.Millisecond)
			}
			t.Cleanup(func() { resp.Body.Close() })
			if resp.ProtoMajor != proto {
				t.Fatalf("served over %s", resp.Proto)
			}
			_, _ = bufio.NewReader(io.LimitReader(resp.Body, 16)).ReadString('\n')
			waitOpenStreams(t, p, 1)
			payload := strings.Repeat("z", 32<<10)
			deadline = time.Now().Add(3 * waitFor)
			for i := 0; ; i++ {
				n, _ := openStreamCount(p.adminAddr)
				if n == 0 {
					t.Logf("cut after %d events", i)
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("stalled HTTP/%d client not cut after %d events", proto, i)
				}
				publish(t, pub, base, testSecret, "news", fmt.Sprintf("%d-%s", i, payload))
				time.Sleep(5 * time.Millisecond)
			}
			r2, err := pub.Get(base + "?channels=news")
			if err != nil {
				t.Fatal(err)
			}
			r2.Body.Close()
			if r2.StatusCode != http.StatusTooManyRequests {
				t.Fatalf("reconnect: %d, want 429 (throttled as slow)", r2.StatusCode)
			}
		})
	}
}

// Streams over TLS (HTTP/1.1, taken over or not, HTTP/2, HTTP/3) whose
// small queue overflows again and again while concurrent publishers send
// large events get every event exactly once, in the channel's order, with
// nothing lost across the catch-ups from the history (SPEC S7).
func TestTLSOverflowLosesAndDuplicatesNothing(t *testing.T) {
	p, port := tlsServer(t, "queue 2", "history 2000", "history_bytes 67108864")
	h1, base := tlsClient(t, port, false)
	h2, _ := tlsClient(t, port, true)
	h3 := h3Client(t, port)
	streams := []*sseConn{
		openTLSStream(t, h1, base+"?channels=news", 1),
		openTLSStream(t, h1, base+"?channels=news", 1),
		openTLSStream(t, h2, base+"?channels=news", 2),
		openTLSStream(t, h3, base+"?channels=news", 3),
	}
	const publishers, each = 8, 40
	payload := strings.Repeat("p", 30<<10)
	done := make(chan struct{})
	pubClient, _ := tlsClient(t, port, true)
	for w := range publishers {
		go func() {
			defer func() { done <- struct{}{} }()
			for i := range each {
				publish(t, pubClient, base, testSecret, "news", fmt.Sprintf("%d-%d-%s", w, i, payload))
			}
		}()
	}
	deadline := time.Now().Add(3 * waitFor)
	forAll(t, streams, func(_ int, c *sseConn) error {
		seen := map[string]bool{}
		last := [publishers]int{-1, -1, -1, -1, -1, -1, -1, -1}
		for len(seen) < publishers*each {
			ev, err := c.next(deadline)
			if err != nil {
				return fmt.Errorf("after %d events: %v", len(seen), err)
			}
			if ev.Type != "message" {
				return fmt.Errorf("after %d events: got %v", len(seen), ev.Type)
			}
			key := ev.Data[:strings.LastIndexByte(ev.Data[:min(len(ev.Data), 16)], '-')]
			if seen[key] {
				return fmt.Errorf("event %s twice", key)
			}
			seen[key] = true
			var w, i int
			fmt.Sscanf(key, "%d-%d", &w, &i)
			if i != last[w]+1 {
				return fmt.Errorf("publisher %d: event %d after %d (lost or out of order)", w, i, last[w])
			}
			last[w] = i
		}
		return nil
	})
	for range publishers {
		<-done
	}
	if n := strings.Count(p.out.String(), "sse_queue_full"); n == 0 {
		t.Fatal("no queue overflowed: the test did not test catch-ups")
	} else {
		t.Logf("%d overflows", n)
	}
}

func serverGoroutines(t *testing.T, adminAddr string) int {
	resp, err := http.Get("http://" + adminAddr + "/debug/pprof/goroutine?debug=1")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	line, _ := bufio.NewReader(resp.Body).ReadString('\n')
	var n int
	fmt.Sscanf(line, "goroutine profile: total %d", &n)
	return n
}

func serverFDs(p *caddyProc) int {
	ents, _ := osReadDir(fmt.Sprintf("/proc/%d/fd", p.cmd.Process.Pid))
	return ents
}

// TLS streams that end (the client leaves, or a reload closes them) leave
// no goroutine and no descriptor behind in the server.
func TestTLSStreamsLeakNothing(t *testing.T) {
	p, port := tlsServer(t, "heartbeat 50ms")
	h1, base := tlsClient(t, port, false)
	h2, _ := tlsClient(t, port, true)
	warm := openTLSStream(t, h1, base+"?channels=w", 1)
	publish(t, h1, base, testSecret, "w", "x")
	_ = warm.expectData(time.Now().Add(waitFor), "x")
	warm.close()
	h1.CloseIdleConnections()
	waitOpenStreams(t, p, 0)
	time.Sleep(500 * time.Millisecond)
	baseG, baseFD := serverGoroutines(t, p.adminAddr), serverFDs(p)
	for round := range 3 {
		var leaving, staying []*sseConn
		for i := range 10 {
			c := openTLSStream(t, h1, base+"?channels=news", 1)
			if i%2 == 0 {
				leaving = append(leaving, c)
			} else {
				staying = append(staying, c)
			}
		}
		staying = append(staying, openTLSStream(t, h2, base+"?channels=news", 2))
		publish(t, h1, base, testSecret, "news", "r")
		for _, c := range leaving {
			c.close()
		}
		p.reload()
		deadline := time.Now().Add(waitFor)
		forAll(t, staying, func(_ int, c *sseConn) error {
			for {
				ev, err := c.next(deadline)
				if err != nil {
					return err
				}
				if ev.Type == "server_closing" {
					return c.expectEnd(deadline)
				}
			}
		})
		_ = round
	}
	h1.CloseIdleConnections()
	h2.CloseIdleConnections()
	waitOpenStreams(t, p, 0)
	var g, fds int
	for range 50 {
		time.Sleep(100 * time.Millisecond)
		g, fds = serverGoroutines(t, p.adminAddr), serverFDs(p)
		if g <= baseG+2 && fds <= baseFD {
			t.Logf("goroutines %d (base %d), fds %d (base %d)", g, baseG, fds, baseFD)
			return
		}
	}
	t.Fatalf("after the TLS streams ended: %d goroutines (%d before), %d descriptors (%d before)", g, baseG, fds, baseFD)
}

func osReadDir(dir string) (int, error) {
	ents, err := os.ReadDir(dir)
	return len(ents), err
}
