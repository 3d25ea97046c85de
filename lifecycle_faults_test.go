package caddysse

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// cappedRetryNowSite caps each principal at one stream and tells its streams
// to come back at once (retry: 0) when it closes them; extra lines go into
// the handler (e.g. a redis setting).
func cappedRetryNowSite(extra string) string {
	return `
:{PORT} {
	sse /events {
		channel a
		principal {query.user}
		max_connections_per_principal 1
		close_jitter off
		` + extra + `
		publish {
			secret ` + testSecret + `
		}
	}
}
`
}

// An EventSource reconnects as soon as its stream ends (after retry: 0
// here). A stream the server ended itself (server_closing on a reload) must
// have given back its share of its principal's cap by then: otherwise the
// reconnect of a principal at its cap is refused 429 too_many_connections
// by its own old stream, and an EventSource gives up for good on a non-200
// (SPEC S8: "reconnects with their cursor lose nothing").
func TestReconnectAfterReloadIsNotRefusedByItsOwnLease(t *testing.T) {
	t.Run("embedded", func(t *testing.T) { testReconnectAfterReload(t, cappedRetryNowSite("")) })
	t.Run("redis", func(t *testing.T) {
		testReconnectAfterReload(t, cappedRetryNowSite("redis "+redistest.Start(t).URL()))
	})
	// each reload changes a connection setting, so the new config has a hub
	// (and leases) of its own: as when the stream's instance stops and its
	// client reconnects to another one
	t.Run("redis, a new hub each reload", func(t *testing.T) {
		url := redistest.Start(t).URL()
		pool := func(n int) string {
			return cappedRetryNowSite("redis {\n\t\t\turl " + url + "\n\t\t\tpool_size " + itoa(n) + "\n\t\t}")
		}
		testReconnectAfterReload(t, pool(3), pool(4))
	})
}

// testReconnectAfterReload reloads between sites in turn (one site: the
// same config again).
func testReconnectAfterReload(t *testing.T, sites ...string) {
	srv := startCaddy(t, sites[0])
	client := &http.Client{Transport: &http.Transport{DisableCompression: true}}
	c := srv.subscribe("/events?user=u", nil)
	c.comment("ok")
	refused := 0
	const rounds = 30
	for i := range rounds {
		srv.reload(sites[(i+1)%len(sites)])
		if ev := c.next(); ev.Type != "server_closing" || ev.Retry != 0 {
			t.Fatalf("round %d: got %+v, want server_closing with retry 0", i, ev)
		}
		c.expectEnd()
		// reconnect at once, as EventSource does with retry: 0
		next := openStream(t, srv.base+"/events?user=u", nil, client)
		if next.resp.StatusCode != http.StatusOK {
			body, _ := io.ReadAll(next.resp.Body)
			refused++
			t.Logf("round %d: reconnect refused: %d %s", i, next.resp.StatusCode, strings.TrimSpace(string(body)))
			next.close()
			// come back a little later: the old stream's lease is gone by then
			eventually(t, "reconnect admitted", func() bool {
				next = openStream(t, srv.base+"/events?user=u", nil, client)
				if next.resp.StatusCode == http.StatusOK {
					return true
				}
				next.close()
				return false
			})
		}
		next.comment("ok")
		c = next
	}
	if refused > 0 {
		t.Fatalf("%d of %d immediate reconnects after server_closing were refused by the stream that had just ended", refused, rounds)
	}
}

// The same when the clients reconnect while the reload that told them is
// still under way, as EventSource does on server_closing with retry 0: each
// of many principals at its cap of one gets back in. Where the reload
// replaces the hub (a connection setting changed), the new config's leases
// know nothing of the old one's, as when a client's instance stops and it
// reconnects to another.
func TestReconnectsDuringAReloadAreNotRefusedByTheirOwnLeases(t *testing.T) {
	t.Run("redis", func(t *testing.T) {
		site := cappedRetryNowSite("redis " + redistest.Start(t).URL())
		testReconnectsDuringAReload(t, site, site, func() {})
	})
	t.Run("redis, a new hub", func(t *testing.T) {
		url := redistest.Start(t).URL()
		pool := func(n int) string {
			return cappedRetryNowSite("redis {\n\t\t\turl " + url + "\n\t\t\tpool_size " + itoa(n) + "\n\t\t}")
		}
		testReconnectsDuringAReload(t, pool(3), pool(4), func() {})
	})
	// the old hub's removal of the leases is slow (a busy Redis, a slow
	// network): a stream says server_closing only once its lease is gone,
	// or its client, back at once, would still be counted
	t.Run("redis, a new hub, the leases' removal slow", func(t *testing.T) {
		rds := redistest.Start(t)
		proxy := startDelayingProxy(t, rds.Addr(), 100*time.Millisecond, "zrem", "lease:") // go-redis sends commands in lower case
		pool := func(n int) string {
			return cappedRetryNowSite("redis {\n\t\t\turl redis://" + proxy.addr() + "\n\t\t\tpool_size " + itoa(n) + "\n\t\t}")
		}
		testReconnectsDuringAReload(t, pool(3), pool(4), proxy.arm)
		select {
		case <-proxy.stalled:
		default:
			t.Fatal("no removal of a lease was slowed: the test did not test it")
		}
	})
}

// testReconnectsDuringAReload opens streams on before, calls opened, and
// reloads to after while their clients reconnect at once.
func testReconnectsDuringAReload(t *testing.T, before, after string, opened func()) {
	srv := startCaddy(t, before)
	const n = 50
	streams := make([]*sseClient, n)
	for i := range streams {
		streams[i] = srv.subscribe("/events?user=u"+itoa(i), nil)
		streams[i].comment("ok")
	}
	opened()
	failures := make(chan string, n)
	var wg sync.WaitGroup
	for i, c := range streams {
		wg.Go(func() {
			select {
			case ev, ok := <-c.events:
				if !ok || ev.Type != "server_closing" {
					failures <- fmt.Sprintf("stream %d: got %+v, want server_closing", i, ev)
					return
				}
			case <-time.After(20 * time.Second):
				failures <- fmt.Sprintf("stream %d: no server_closing", i)
				return
			}
			select {
			case <-c.done:
			case <-time.After(20 * time.Second):
				failures <- fmt.Sprintf("stream %d did not end", i)
				return
			}
			if status, err := reconnectOnce(srv.port, "/events?user=u"+itoa(i)); err != nil {
				failures <- err.Error()
			} else if status != "200" {
				failures <- fmt.Sprintf("stream %d's reconnect: status %s", i, status)
			}
		})
	}
	srv.reload(after)
	wg.Wait()
	noFailures(t, failures, n, "immediate reconnects")
}

// The counts return to zero once every stream of an old config is gone:
// the gauge, the census and the stats' principals.
func TestCountsReturnToZeroAfterReloads(t *testing.T) {
	site := `
:{PORT} {
	metrics /metrics
	sse /events {
		channel {query.channels}
		principal {query.user}
		max_connections_per_principal 3
		close_jitter off
		publish {
			secret ` + testSecret + `
		}
	}
}
`
	srv := startCaddy(t, site)
	var streams []*sseClient
	for i := range 6 {
		c := srv.subscribe("/events?channels=a&user=u"+itoa(i%2), nil)
		c.comment("ok")
		streams = append(streams, c)
	}
	if got := metric(t, srv.scrape(), "caddy_sse_streams_open"); got != 6 {
		t.Fatalf("streams_open %v, want 6", got)
	}
	srv.reload(site)
	for _, c := range streams {
		if ev := c.next(); ev.Type != "server_closing" {
			t.Fatalf("got %+v", ev)
		}
		c.expectEnd()
	}
	eventually(t, "streams_open back to 0", func() bool {
		return metric(t, srv.scrape(), "caddy_sse_streams_open") == 0
	})
	hub, key, err := acquireHub(nil, "")
	if err != nil {
		t.Fatal(err)
	}
	defer releaseHub(key)
	eventually(t, "census back to 0", func() bool {
		top, n := hub.Census().TopPrincipals(10)
		return hub.Census().Total() == 0 && n == 0 && len(top) == 0
	})
	if got := metric(t, srv.scrape(), "caddy_sse_streams_opened_total"); got != 6 {
		t.Fatalf("streams_opened_total %v after a reload, want 6 (counters run on across reloads)", got)
	}
	// the principals may open their full cap again
	for i := range 6 {
		c := srv.subscribe("/events?channels=a&user=u"+itoa(i%2), nil)
		c.comment("ok")
	}
	_ = time.Second
}

// h2cClient speaks HTTP/2 without TLS (prior knowledge).
func h2cClient() *http.Client {
	tr := &http.Transport{DisableCompression: true, Protocols: new(http.Protocols)}
	tr.Protocols.SetUnencryptedHTTP2(true)
	return &http.Client{Transport: tr}
}

const h2cGlobals = "servers {\n\t\tprotocols h1 h2c\n\t}"

// An HTTP/2 stream is told server_closing on a reload, ends, and resumes
// with its cursor on the new config without a loss (SPEC S8).
func TestReloadClosesHTTP2Streams(t *testing.T) {
	site := `
:{PORT} {
	sse /events {
		channel {query.channels}
		close_jitter 1s
		publish {
			secret ` + testSecret + `
		}
	}
}
`
	srv := startCaddy(t, site, h2cGlobals)
	client := h2cClient()
	c := openStream(t, srv.base+"/events?channels=a", nil, client)
	if c.resp.ProtoMajor != 2 {
		t.Fatalf("served over %s", c.resp.Proto)
	}
	srv.publish("/events", map[string]any{"channel": "a", "data": "before"})
	last := c.next()
	srv.reload(site, h2cGlobals)
	ev := c.next()
	if ev.Type != "server_closing" || ev.Data != `{"reason":"reload"}` || ev.Retry < 0 || ev.Retry > 1000 {
		t.Fatalf("got %+v, want server_closing for a reload with retry within 1s", ev)
	}
	c.expectEnd()
	srv.publish("/events", map[string]any{"channel": "a", "data": "during"})
	// a new connection: on the old one, a request sent before its GOAWAY
	// arrives is served by the old config, told server_closing at once
	// (3 runs in 150), and a browser would simply come back after retry
	r := openStream(t, srv.base+"/events?channels=a", header("Last-Event-ID", last.ID), h2cClient())
	if got := r.next(); got.Data != "during" {
		t.Fatalf("got %+v", got)
	}
}

// Caddy's server write timeout does not cut an HTTP/2 stream, idle or not
// (SPEC S2), with and without Caddy's idle writer.
func TestServerWriteTimeoutDoesNotCutHTTP2Streams(t *testing.T) {
	for _, tc := range []struct{ name, timeouts, heartbeat string }{
		{"write timeout, heartbeats", "write 300ms", "100ms"},
		{"write timeout, silent", "write 300ms", "off"},
		{"write timeout without idle writer, heartbeats", "write 300ms\n\t\t\twrite_idle -1s", "100ms"},
		{"write timeout without idle writer, silent", "write 300ms\n\t\t\twrite_idle -1s", "off"},
		{"short idle writer, silent", "write_idle 300ms", "off"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			globals := "servers {\n\t\tprotocols h1 h2c\n\t\ttimeouts {\n\t\t\t" + tc.timeouts + "\n\t\t}\n\t}"
			srv := startCaddy(t, `
:{PORT} {
	sse /events {
		channel a
		heartbeat `+tc.heartbeat+`
		publish {
			secret `+testSecret+`
		}
	}
}
`, globals)
			c := openStream(t, srv.base+"/events", nil, h2cClient())
			if c.resp.ProtoMajor != 2 {
				t.Fatalf("served over %s", c.resp.Proto)
			}
			c.comment("ok")
			srv.publish("/events", map[string]any{"channel": "a", "data": "first"})
			if ev := c.next(); ev.Data != "first" {
				t.Fatalf("got %+v", ev)
			}
			time.Sleep(900 * time.Millisecond) // outlive the timeout
			srv.publish("/events", map[string]any{"channel": "a", "data": "still here"})
			if ev := c.next(); ev.Data != "still here" {
				t.Fatalf("got %+v", ev)
			}
		})
	}
}

// The same over HTTP/1.1 for a silent stream (heartbeat off) and a short
// write_idle: the idle writer's deadline must not cut it between writes.
func TestServerWriteTimeoutDoesNotCutSilentHTTP1Streams(t *testing.T) {
	for _, tc := range []struct{ name, timeouts string }{
		{"write timeout", "write 300ms"},
		{"write timeout without idle writer", "write 300ms\n\t\t\twrite_idle -1s"},
		{"short idle writer", "write_idle 300ms"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := startCaddy(t, `
:{PORT} {
	sse /events {
		channel a
		heartbeat off
		publish {
			secret `+testSecret+`
		}
	}
}
`, "servers {\n\t\ttimeouts {\n\t\t\t"+tc.timeouts+"\n\t\t}\n\t}")
			c := srv.subscribe("/events", nil)
			c.comment("ok")
			time.Sleep(900 * time.Millisecond)
			srv.publish("/events", map[string]any{"channel": "a", "data": "still here"})
			if ev := c.next(); ev.Data != "still here" {
				t.Fatalf("got %+v", ev)
			}
		})
	}
}

func openFDCount(t *testing.T) int {
	t.Helper()
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skip("no /proc/self/fd")
	}
	return len(entries)
}

// Reloads with streams open (HTTP/1.1 and HTTP/2) leave no goroutine and no
// descriptor behind once the streams are gone; switching writers back and
// forth neither.
func TestReloadsLeakNothing(t *testing.T) {
	site := func(writer string) string {
		return `
:{PORT} {
	metrics /metrics
	sse /events {
		channel {query.channels}
		close_jitter off
		heartbeat 50ms
		writer ` + writer + `
		publish {
			secret ` + testSecret + `
		}
	}
}
`
	}
	// the writer given in the site wins over SSE_TEST_WRITER: drop it
	t.Setenv("SSE_TEST_WRITER", "")
	srv := startCaddy(t, site("net_http"), h2cGlobals)
	h2 := h2cClient()
	warm := srv.subscribe("/events?channels=warm", nil)
	warm.comment("ok")
	srv.publish("/events", map[string]any{"channel": "warm", "data": "x"})
	warm.close()
	h2.CloseIdleConnections()
	baseG, baseFD := steadyGoroutines(), openFDCount(t)
	baseStacks := make([]byte, 1<<20)
	baseStacks = baseStacks[:runtime.Stack(baseStacks, true)]

	writers := []string{"takeover", "net_http", "takeover", "takeover", "net_http", "net_http"}
	var open []*sseClient
	for round, w := range writers {
		open = open[:0]
		for i := range 4 {
			var c *sseClient
			if i%2 == 0 {
				c = srv.subscribe("/events?channels=r"+itoa(i), nil)
			} else {
				c = openStream(t, srv.base+"/events?channels=r"+itoa(i), nil, h2)
			}
			c.comment("ok")
			open = append(open, c)
		}
		srv.publish("/events", map[string]any{"channel": "r0", "data": "x"})
		began := time.Now()
		srv.reload(site(w), h2cGlobals)
		if d := time.Since(began); d > 2*time.Second {
			t.Errorf("round %d: the reload to %s took %v", round, w, d)
		}
		for _, c := range open {
			for {
				ev := c.next()
				if ev.Type == "server_closing" {
					break
				}
			}
			c.expectEnd()
			c.close()
		}
		_ = round
	}
	h2.CloseIdleConnections()
	eventually(t, "streams_open back to 0", func() bool {
		return metric(t, srv.scrape(), "caddy_sse_streams_open") == 0
	})
	// end on the writer it started with
	srv.reload(site("net_http"), h2cGlobals)
	h2.CloseIdleConnections()
	loopRefs, loopsLive := loopsPool.References(loopsKey)
	hubRefs, _ := hubs.References(embeddedHubKey)
	metricRefs, _ := metricsPool.References(metricsKey)
	t.Logf("after the reloads: loops pool %d (%v), hub %d, metrics %d", loopRefs, loopsLive, hubRefs, metricRefs)
	if loopsLive || hubRefs != 1 || metricRefs != 1 {
		t.Errorf("pool references after the reloads: loops %d (%v), hub %d, metrics %d; want no loops, one hub and one metrics user", loopRefs, loopsLive, hubRefs, metricRefs)
	}
	if n := settleGoroutines(baseG); n > baseG {
		buf := make([]byte, 1<<20)
		t.Fatalf("goroutines: %d after the reloads, %d before (%d event-loop poll goroutines left in epoll_wait, none expected: no takeover config is left)\nBEFORE\n%s\nAFTER\n%s", n, baseG, pollGoroutines(), baseStacks, buf[:runtime.Stack(buf, true)])
	}
	deadline := time.Now().Add(waitFor)
	for openFDCount(t) > baseFD && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if n := openFDCount(t); n > baseFD {
		t.Fatalf("descriptors: %d after the reloads, %d before", n, baseFD)
	}
}

// pollGoroutines counts the goroutines blocked in an event loop's
// epoll_wait (takeover writer).
func pollGoroutines() int {
	buf := make([]byte, 8<<20)
	buf = buf[:runtime.Stack(buf, true)]
	return strings.Count(string(buf), "caddysse.(*pollLoop).poll(")
}

// A reload that stops using the takeover writer stops its event loops
// (their pool's last user is gone): every loop's epoll goroutine ends with
// it. (A loop once closed its descriptors while shutdown's wake-up was
// still to come: the poll goroutine stayed in epoll_wait for good, holding
// an OS thread, and the wake-up could go to a reused descriptor.)
func TestStoppedTakeoverLoopsLeaveNoPollGoroutine(t *testing.T) {
	t.Setenv("SSE_TEST_WRITER", "")
	site := func(writer string) string {
		return `
:{PORT} {
	sse /events {
		channel a
		close_jitter off
		heartbeat 20ms
		writer ` + writer + `
	}
}
`
	}
	srv := startCaddy(t, site("net_http"), h2cGlobals)
	h2 := h2cClient()
	if pollGoroutines() != 0 {
		t.Fatalf("%d poll goroutines before the test", pollGoroutines())
	}
	const rounds = 60
	for range rounds {
		srv.reload(site("takeover"), h2cGlobals)
		var open []*sseClient
		for i := range 4 {
			var c *sseClient
			if i%2 == 0 {
				c = srv.subscribe("/events", nil) // the first starts the loops
			} else {
				c = openStream(t, srv.base+"/events", nil, h2) // stays on net/http
			}
			c.comment("ok")
			open = append(open, c)
		}
		srv.reload(site("net_http"), h2cGlobals) // the loops' last user goes
		for _, c := range open {
			// what the stream gets is checked elsewhere
			// (TestHijackedStreamGetsServerClosingOnce): wait for its end
			for range c.events {
			}
			c.close()
		}
	}
	deadline := time.Now().Add(waitFor)
	for pollGoroutines() > 0 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if n := pollGoroutines(); n > 0 {
		t.Fatalf("%d event-loop poll goroutines still in epoll_wait after %d takeover configs were replaced (%d loops each)", n, rounds, runtime.GOMAXPROCS(0))
	}
}

// A taken-over stream that the event loop cannot watch (its connection is
// not a bare *net.TCPConn, here behind Caddy's proxy_protocol listener
// wrapper) is written by a goroutine (serveHijacked). Told to close by a
// reload it sends server_closing once, then ends (SPEC S8). (run wrote it,
// and endConn once wrote it again.)
func TestHijackedStreamGetsServerClosingOnce(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("the takeover writer is Linux only")
	}
	t.Setenv("SSE_TEST_WRITER", "")
	site := `
:{PORT} {
	sse /events {
		channel a
		close_jitter off
		writer takeover
		publish {
			secret ` + testSecret + `
		}
	}
}
`
	globals := "servers {\n\t\tlistener_wrappers {\n\t\t\tproxy_protocol {\n\t\t\t\tallow 127.0.0.1/32\n\t\t\t}\n\t\t}\n\t}"
	srv := startCaddy(t, site, globals)
	c := srv.subscribe("/events", nil)
	c.comment("ok")
	srv.publish("/events", map[string]any{"channel": "a", "data": "live"})
	if ev := c.next(); ev.Data != "live" {
		t.Fatalf("got %+v", ev)
	}
	srv.reload(site, globals)
	if ev := c.next(); ev.Type != "server_closing" {
		t.Fatalf("got %+v, want server_closing", ev)
	}
	select {
	case ev, ok := <-c.events:
		if ok {
			t.Fatalf("a second event after server_closing: %+v", ev)
		}
	case <-time.After(waitFor):
		t.Fatal("the stream did not end")
	}
}

func rawStreamThrough(t *testing.T, addr string) (net.Conn, *bufio.Reader, string) {
	t.Helper()
	deadline := time.Now().Add(waitFor)
	for {
		if time.Now().After(deadline) {
			t.Fatal("no stream within the deadline")
		}
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			time.Sleep(20 * time.Millisecond)
			continue
		}
		fmt.Fprintf(conn, "GET /events HTTP/1.1\r\nHost: test\r\n\r\n")
		r := bufio.NewReader(conn)
		var head strings.Builder
		ok := false
		for {
			line, err := r.ReadString('\n')
			head.WriteString(line)
			if err != nil {
				break
			}
			if strings.HasPrefix(line, ": ok") {
				ok = true
				break
			}
		}
		if ok {
			return conn, r, head.String()
		}
		conn.Close()
		time.Sleep(20 * time.Millisecond)
	}
}

// A reload that replaces a takeover config with a net_http one stops the
// event loops once the old handler's Cleanup has waited for its taken-over
// streams (waitTakenOver). A stream that is being handed over at that moment
// (hijacked, not yet adopted: waitTakenOver does not see it) finds the
// loop closed, or no loop: either way it gets exactly one server_closing and
// the end (SPEC S8). (It was once closed without a word, or told twice.)
// rawStreamThrough returns as soon as the preamble is read, which is when
// the handler is handing the stream over.
func TestStreamHandedOverDuringReloadGetsServerClosingOnce(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("the takeover writer is Linux only")
	}
	t.Setenv("SSE_TEST_WRITER", "")
	site := func(writer string) string {
		return `
:{PORT} {
	sse /events {
		channel a
		close_jitter off
		writer ` + writer + `
	}
}
`
	}
	srv := startCaddy(t, site("net_http"))
	for round := range 30 {
		srv.reload(site("takeover"))
		conn, r, head := rawStreamThrough(t, strings.TrimPrefix(srv.base, "http://"))
		srv.reload(site("net_http"))
		_ = conn.SetReadDeadline(time.Now().Add(3 * time.Second))
		b, err := io.ReadAll(r)
		if strings.Count(string(b), "server_closing") != 1 || err != nil {
			t.Errorf("round %d: after the preamble %q the stream sent %q (%d server_closing, want 1), then %v", round, head[len(head)-8:], b, strings.Count(string(b), "server_closing"), err)
		}
		conn.Close()
	}
}

// A reload away from a Redis (or a stop) while that Redis hangs returns
// promptly although streams hold leases of a per-principal cap: giving the
// leases back is best effort (they lapse within lease_ttl), and the hub's
// close waited for it, 10 s, holding the reload and the process exit
// (SPEC S8: it exits promptly).
func TestReloadAwayFromAHungRedisIsPrompt(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, cappedRetryNowSite("redis "+rds.URL()))
	for _, user := range []string{"u", "v"} {
		c := srv.subscribe("/events?user="+user, nil)
		c.comment("ok")
		defer c.close()
	}
	rds.Pause()
	defer rds.Resume()
	base := runtime.NumGoroutine()
	start := time.Now()
	srv.reload(cappedRetryNowSite(""))
	if took := time.Since(start); took > 3*time.Second {
		t.Errorf("the reload away from the hung Redis took %v", took)
	}
	if n := settleGoroutines(base); n > base {
		t.Errorf("goroutines: %d after closing the hub, %d before", n, base)
	}
}

// A stream of a capped principal that opens while a reload replaces its
// Redis hub (a connection setting changed) takes its lease as the old
// hub's leases close: the lease reached Redis after they closed, and was
// dropped without being removed. No stream held it, nobody renewed or
// removed it, and the client, told server_closing, was refused 429
// too_many_connections by it on the new config until it lapsed (lease_ttl)
// — an EventSource gives up for good on a 429 (SPEC S8, S10).
func TestALeaseTakenAsAReloadClosesItsHubIsGivenBack(t *testing.T) {
	rds := redistest.Start(t)
	proxy := startDelayingProxy(t, rds.Addr(), 400*time.Millisecond, "lease:")
	site := func(pool int) string {
		return cappedRetryNowSite("lease_ttl 10s\n\t\tredis {\n\t\t\turl redis://" + proxy.addr() + "\n\t\t\tpool_size " + itoa(pool) + "\n\t\t}")
	}
	srv := startCaddy(t, site(3))
	warm := srv.subscribe("/events?user=w", nil) // the lease script is loaded
	warm.comment("ok")
	warm.close()
	proxy.arm() // the next lease call is slow: it reaches Redis after the reload began
	first := make(chan string, 1)
	go func() {
		status, err := reconnectOnce(srv.port, "/events?user=u")
		first <- fmt.Sprint(status, err)
	}()
	<-proxy.stalled
	time.Sleep(50 * time.Millisecond)
	srv.reload(site(4)) // a new hub: the old one closes while the lease is on its way
	proxy.armed.Store(false)
	t.Logf("the stream opening during the reload: %s", <-first)
	time.Sleep(500 * time.Millisecond) // the slowed call has reached Redis
	if status, err := reconnectOnce(srv.port, "/events?user=u"); err != nil || status != "200" {
		t.Errorf("the principal (cap 1, no stream open) after the reload: %s %v, want 200; its leases in Redis: %s",
			status, err, rds.MustCLI("ZRANGE", "sse:lease:{u}", "0", "-1"))
	}
}
