package caddysse

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/pubsub"
	"github.com/caddy-sse/caddy-sse/wire"
)

func TestHeartbeatOnIdleStream(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	sse /events {
		channel a
		heartbeat 100ms
	}
}
`)
	c := srv.subscribe("/events", nil)
	c.comment("ok")
	for range 3 { // and again: heartbeats continue while the stream is idle
		c.comment("heartbeat")
	}
}

func TestIdempotencyKeyPublishesOnce(t *testing.T) {
	srv := startCaddy(t, basicSite)
	c := srv.subscribe("/events?channels=a", nil)
	body := mustJSON(t, map[string]any{"channel": "a", "data": "once"})
	key := header("Idempotency-Key", "k-1")
	s1, r1 := srv.post("/events", "application/json", body, key)
	s2, r2 := srv.post("/events", "application/json", body, key)
	if s1 != 200 || s2 != 200 || string(r1) != string(r2) {
		t.Fatalf("first %d %s, retry %d %s: the retry must return the first reply", s1, r1, s2, r2)
	}
	s3, r3 := srv.post("/events", "application/json", mustJSON(t, map[string]any{"channel": "a", "data": "other"}), key)
	if s3 != 422 || !strings.Contains(string(r3), "idempotency_key_reused") {
		t.Fatalf("reused key with another body: %d %s, want 422", s3, r3)
	}
	// the event type is part of the request too: a retry is the same request
	s4, r4 := srv.post("/events", "application/json", mustJSON(t, map[string]any{"channel": "a", "event": "other", "data": "once"}), key)
	if s4 != 422 || !strings.Contains(string(r4), "idempotency_key_reused") {
		t.Fatalf("reused key with another event type: %d %s, want 422", s4, r4)
	}
	srv.publish("/events", map[string]any{"channel": "a", "data": "sentinel"})
	if got := c.nextData(2); fmt.Sprint(got) != "[once sentinel]" {
		t.Fatalf("got %v: the retry was published again", got)
	}
}

func TestIdempotencyKeyConcurrentRetries(t *testing.T) {
	srv := startCaddy(t, basicSite)
	c := srv.subscribe("/events?channels=a", nil)
	body := mustJSON(t, map[string]any{"channel": "a", "data": "once"})
	var wg sync.WaitGroup
	replies := make([]string, 20)
	for i := range replies {
		wg.Add(1)
		go func() {
			defer wg.Done()
			status, reply := srv.post("/events", "application/json", body, header("Idempotency-Key", "same"))
			if status != 200 {
				t.Errorf("status %d %s", status, reply)
			}
			replies[i] = string(reply)
		}()
	}
	wg.Wait()
	for _, r := range replies[1:] {
		if r != replies[0] {
			t.Fatalf("replies differ: %q vs %q", r, replies[0])
		}
	}
	srv.publish("/events", map[string]any{"channel": "a", "data": "sentinel"})
	if got := c.nextData(2); fmt.Sprint(got) != "[once sentinel]" {
		t.Fatalf("got %v", got)
	}
}

// Caddy's encode must leave the stream alone: not compressed (the client
// asked for gzip) and not buffered (events arrive one by one).
func TestEncodeLeavesStreamUncompressedAndUnbuffered(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	encode gzip zstd
	sse /events {
		channel a
		publish {
			secret `+testSecret+`
		}
	}
	respond /text "`+strings.Repeat("compress me ", 200)+`"
}
`)
	// the route does compress other responses
	resp := do(t, http.MethodGet, srv.base+"/text", header("Accept-Encoding", "gzip"), "")
	resp.Body.Close()
	if resp.Header.Get("Content-Encoding") != "gzip" {
		t.Fatal("encode is not active in this route; the test proves nothing")
	}
	c := srv.subscribe("/events", header("Accept-Encoding", "gzip"))
	if enc := c.resp.Header.Get("Content-Encoding"); enc != "" {
		t.Fatalf("stream has Content-Encoding %q", enc)
	}
	c.comment("ok")
	for i := range 3 { // each small event arrives before the next is published
		srv.publish("/events", map[string]any{"channel": "a", "data": fmt.Sprint(i)})
		if ev := c.next(); ev.Data != fmt.Sprint(i) {
			t.Fatalf("got %+v", ev)
		}
	}
}

// A server-wide write timeout must not cut streams (SPEC S2): they outlive
// it, and still receive events after it has passed.
func TestServerWriteTimeoutDoesNotCutStreams(t *testing.T) {
	for _, tc := range []struct{ name, timeouts string }{
		{"write timeout", "write 300ms"},
		{"write timeout without idle writer", "write 300ms\n\t\t\twrite_idle -1s"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := startCaddy(t, `
:{PORT} {
	sse /events {
		channel a
		heartbeat 100ms
		publish {
			secret `+testSecret+`
		}
	}
}
`, "servers {\n\t\ttimeouts {\n\t\t\t"+tc.timeouts+"\n\t\t}\n\t}")
			c := srv.subscribe("/events", nil)
			outlive := time.Now().Add(900 * time.Millisecond)
			for time.Now().Before(outlive) {
				c.comment("heartbeat")
			}
			srv.publish("/events", map[string]any{"channel": "a", "data": "still here"})
			if ev := c.next(); ev.Data != "still here" {
				t.Fatalf("got %+v", ev)
			}
		})
	}
}

// guards the test above: the same write timeout does cut another kind of
// long response (a proxied stream), so the option is really in effect; and
// the handler lifts it for its own streams only (README, "Server write
// timeouts"): in the same site, with one of its streams open, the proxied
// response is still cut
func TestServerWriteTimeoutCutsOtherStreamingResponses(t *testing.T) {
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for i := range 20 {
			fmt.Fprintf(w, "chunk %d\n", i)
			w.(http.Flusher).Flush()
			select {
			case <-time.After(100 * time.Millisecond):
			case <-r.Context().Done():
				return
			}
		}
	}))
	defer upstream.Close()
	srv := startCaddy(t, `
:{PORT} {
	sse /events {
		channel a
	}
	reverse_proxy `+strings.TrimPrefix(upstream.URL, "http://")+` {
		flush_interval -1
	}
}
`, "servers {\n\t\ttimeouts {\n\t\t\twrite 300ms\n\t\t}\n\t}")
	srv.subscribe("/events", nil).comment("ok")
	resp := do(t, http.MethodGet, srv.base+"/", nil, "")
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if strings.Contains(string(body), "chunk 19") {
		t.Fatal("the write timeout did not cut a 2 s response; it is not in effect")
	}
}

// rawStream opens a stream over a bare TCP connection: no client-side
// goroutine, so that goroutine counts measure the server alone.
func rawStream(t testing.TB, addr, path string) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: test\r\n\r\n", path)
	r := bufio.NewReader(conn)
	status, err := r.ReadString('\n')
	if err != nil || !strings.Contains(status, " 200 ") {
		t.Fatalf("raw stream: %q %v", status, err)
	}
	// read until the preamble's ": ok" so the handler is in its loop
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasPrefix(line, ": ok") {
			return conn
		}
	}
}

// gate holds a response body's reads back until it is opened: a client
// that stops reading for a while.
type gate struct {
	io.ReadCloser
	open chan struct{}
}

func (g *gate) Read(p []byte) (int, error) {
	<-g.open
	return g.ReadCloser.Read(p)
}

// A client that stops reading while far more is published than its queue
// and the sockets can hold overflows its queue; once it reads again it
// catches up from the history and gets every event, in order, with no hole.
func TestStalledClientCatchesUpWithoutHole(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	sse /events {
		channel a
		queue 5
		max_event_size 2KiB
		queue_bytes 8KiB
		history 40000
		history_bytes 128MiB
		slow_client_timeout 2m
		publish {
			secret `+testSecret+`
		}
	}
}
`)
	client := smallReceiveBuffer()
	c := openStreamGated(t, srv.base+"/events", client)

	// 12 MiB: three times what the server's send buffer (at most
	// net.ipv4.tcp_wmem's 4 MiB here) and the client's 4 KiB can hold
	const events = 12 * 1024
	payload := strings.Repeat("x", 1000)
	var wg sync.WaitGroup
	for p := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := p; i < events; i += 4 {
				status, body := srv.post("/events", "application/json", mustJSON(t, map[string]any{"channel": "a", "data": payload}), nil)
				if status != 200 {
					t.Errorf("publish %d: %d %s", i, status, body)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(c.gate.open)
	for want := uint64(1); want <= events; want++ {
		ev := c.next()
		if got := seqOf(t, ev.ID).Seq; got != want {
			t.Fatalf("event seq %d, want %d: a hole or a duplicate", got, want)
		}
	}
}

type gatedClient struct {
	*sseClient
	gate *gate
}

func openStreamGated(t *testing.T, url string, client *http.Client) gatedClient {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := client.Do(req)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("GET %s: %v", url, err)
	}
	g := &gate{ReadCloser: resp.Body, open: make(chan struct{})}
	resp.Body = g
	c := &sseClient{t: t, resp: resp, cancel: func() {},
		events: make(chan sseEvent, 100000), comments: make(chan string, 100), done: make(chan struct{})}
	go c.read()
	t.Cleanup(func() {
		select {
		case <-g.open:
		default:
			close(g.open)
		}
		c.close()
	})
	return gatedClient{c, g}
}

// A stream whose response is not chunked (a header handler set
// Transfer-Encoding: identity) is written as such by either writer: no
// chunk framing ever appears in its body.
func TestIdentityTransferEncodingStream(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	header Transfer-Encoding identity
	sse /events {
		channel a
		publish {
			secret `+testSecret+`
		}
	}
}
`)
	conn, err := net.Dial("tcp", strings.TrimPrefix(srv.base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "GET /events HTTP/1.1\r\nHost: test\r\n\r\n")
	r := bufio.NewReader(conn)
	_ = conn.SetReadDeadline(time.Now().Add(waitFor))
	var lines []string
	published := false
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			t.Fatalf("reading the stream: %v (so far %q)", err, lines)
		}
		lines = append(lines, line)
		if strings.HasPrefix(line, ": ok") && !published {
			published = true
			srv.publish("/events", map[string]any{"channel": "a", "data": "plain"})
		}
		if strings.HasPrefix(line, "data: plain") {
			break
		}
	}
	for _, line := range lines {
		if strings.EqualFold(strings.TrimSpace(line), "Transfer-Encoding: chunked") || isChunkSize(line) {
			t.Fatalf("chunk framing in an identity response: %q", lines)
		}
	}
}

func isChunkSize(line string) bool {
	line = strings.TrimRight(line, "\r\n")
	if line == "" {
		return false
	}
	for _, c := range line {
		if !strings.ContainsRune("0123456789abcdefABCDEF", c) {
			return false
		}
	}
	return true
}

// The largest event a publish accepts reaches every live stream and stays
// in the history, whatever its data: a kilobyte of line breaks is one
// "data:" line each, a frame seven times max_event_size, over queue_bytes
// and history_bytes (which need only hold max_event_size with its type and
// an entry's cost). In Redis mode the publish function must accept it too.
func TestLargestEventIsDeliveredAndKept(t *testing.T) {
	limits := []string{"max_event_size 1KiB", fmt.Sprintf("history_bytes %d", 1024+wire.MaxEventTypeLen+pubsub.EntryOverhead), "queue_bytes 1KiB"}
	sites := map[string]func(t *testing.T) string{
		"embedded": func(*testing.T) string {
			return `
:{PORT} {
	sse /events {
		channel {query.channels}
		` + strings.Join(limits, "\n\t\t") + `
		publish {
			secret ` + testSecret + `
		}
	}
}
`
		},
		"redis": func(t *testing.T) string { return redisSite(redistest.Start(t).URL(), limits...) },
	}
	for name, site := range sites {
		t.Run(name, func(t *testing.T) {
			srv := startCaddy(t, site(t))
			live := srv.subscribe("/events?channels=a", nil)
			var ids []string
			for _, data := range []string{strings.Repeat("x", 1024), strings.Repeat("\n", 1024)} {
				status, reply := srv.post("/events", "application/json", mustJSON(t, map[string]any{"channel": "a", "event": strings.Repeat("t", wire.MaxEventTypeLen), "data": data}), nil)
				if status != http.StatusOK {
					t.Fatalf("publish of max_event_size: %d %s", status, reply)
				}
				var ok struct{ IDs map[string]string }
				if err := json.Unmarshal(reply, &ok); err != nil || ok.IDs["a"] == "" {
					t.Fatalf("reply %s: %v", reply, err)
				}
				ids = append(ids, ok.IDs["a"])
				if ev := live.next(); ev.Data != data {
					t.Fatalf("live: got %d bytes of data (%q...), want %d", len(ev.Data), ev.Data[:min(len(ev.Data), 20)], len(data))
				}
			}
			// the history is over its cap with the newest event alone: it
			// is kept, and a stream that missed only it gets it
			resumed := srv.subscribe("/events?channels=a", header("Last-Event-ID", ids[0]))
			if ev := resumed.next(); ev.Type == wire.TypeTruncated || ev.ID != ids[1] || ev.Data != strings.Repeat("\n", 1024) {
				t.Fatalf("resuming after the first large event: %s %s, want the second one, not truncated", ev.Type, ev.ID)
			}
		})
	}
}

// A stalled client whose missed events are no longer all in the history
// when it reads again gets what it was written, then the end of the body
// (the last chunk): its stream ends because of the gap, not because the
// connection broke, on either writer. A reader of the body sees EOF, not an
// unexpected EOF, and its reconnect is told it was truncated.
func TestStreamEndedByAHistoryGapEndsItsBody(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	sse /events {
		channel a
		queue 5
		max_event_size 2KiB
		queue_bytes 8KiB
		history 10
		slow_client_timeout 2m
		heartbeat off
		publish {
			secret `+testSecret+`
		}
	}
}
`)
	client := smallReceiveBuffer()
	resp, err := client.Get(srv.base + "/events")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("GET: %v", err)
	}
	defer resp.Body.Close()
	// 8 MiB, not read meanwhile: more than the sockets hold, so the queue
	// overflows and the history (10 events) no longer covers the gap
	srv.publishConcurrently(strings.Repeat("x", 1000), 8<<10, 4)
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading the stream: %v after %d bytes, ending %q", err, len(body), body[max(0, len(body)-80):])
	}
	last := ""
	for _, line := range strings.Split(string(body), "\n") {
		if id, ok := strings.CutPrefix(line, "id: "); ok {
			last = id
		}
	}
	if last == "" {
		t.Fatal("no event was written before the end")
	}
	again := srv.subscribe("/events", header("Last-Event-ID", last))
	if again.resp.Header.Get("X-Replay-Truncated") != "true" {
		t.Fatalf("the reconnect after the gap was not told it was truncated")
	}
}

// startIdleCuttingProxy forwards TCP connections to a server and closes
// any whose server has sent nothing for idle: a load balancer's idle
// timeout.
func startIdleCuttingProxy(t *testing.T, target string, idle time.Duration) *tcpProxy {
	return startTCPProxy(t, target, plainPipe, func(server, client net.Conn) {
		cutWhenIdle(server, client, idle)
	})
}

// cutWhenIdle copies what the server sends to the client until the server
// has been silent for idle, then cuts both.
func cutWhenIdle(server, client net.Conn, idle time.Duration) {
	defer client.Close()
	defer server.Close()
	buf := make([]byte, 32<<10)
	for {
		_ = server.SetReadDeadline(time.Now().Add(idle))
		n, err := server.Read(buf)
		if n > 0 {
			if _, werr := client.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// Seed 002: "Idle streams emit a heartbeat and survive intermediary idle
// timeouts". Behind a proxy that cuts connections idle for 1.5 s, a quiet
// stream without heartbeats is cut (the proxy does what load balancers
// do), and one with heartbeats every 300 ms stays open and still gets the
// next event, on the same connection, after several idle timeouts.
func TestHeartbeatsKeepAStreamThroughAnIdleTimeout(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	sse /beating {
		channel a
		heartbeat 300ms
		publish {
			secret `+testSecret+`
		}
	}
	sse /quiet {
		channel a
		heartbeat off
	}
}
`)
	const idle = 1500 * time.Millisecond
	proxy := startIdleCuttingProxy(t, srv.base[len("http://"):], idle)
	beating := openStream(t, proxy.url()+"/beating", nil, nil)
	quiet := openStream(t, proxy.url()+"/quiet", nil, nil)
	for _, c := range []*sseClient{beating, quiet} {
		if c.resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d", c.resp.StatusCode)
		}
	}
	began := time.Now()
	quiet.expectEnd() // cut by the proxy after idle
	if cut := time.Since(began); cut < idle/2 {
		t.Fatalf("the quiet stream ended after %v, before the proxy's idle timeout", cut)
	}
	select { // held through several idle timeouts
	case <-beating.done:
		t.Fatalf("the stream with heartbeats was cut after %v", time.Since(began))
	case <-time.After(3*idle - time.Since(began)):
	}
	srv.publish("/beating", map[string]any{"channel": "a", "data": "still here"})
	if ev := beating.next(); ev.Data != "still here" {
		t.Fatalf("got %+v", ev)
	}
}

// "A `: heartbeat` comment whenever a stream has been silent this long"
// (README): a user sets heartbeat a little under the idle timeout of the
// load balancer in front (2 s under 2.4 s here), and the stream must never
// be silent longer than that. The shared ticker runs at a quarter of the
// interval; a stream it finds silent for a heartbeat minus one tick gets
// its heartbeat then, so silence stays within the interval instead of
// reaching it plus a tick (2.5 s here, 18.75 s with the default 15 s).
func TestHeartbeatComesWithinItsInterval(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	sse /events {
		channel a
		heartbeat 2s
	}
}
`)
	const idle = 2400 * time.Millisecond
	proxy := startIdleCuttingProxy(t, srv.base[len("http://"):], idle)
	c := openStream(t, proxy.url()+"/events", nil, nil)
	if c.resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d", c.resp.StatusCode)
	}
	began := time.Now()
	select { // several heartbeats, each due before the proxy's timeout
	case <-c.done:
		t.Fatalf("the stream was cut as idle after %v with heartbeat 2s", time.Since(began).Round(time.Millisecond))
	case <-time.After(4 * idle):
	}
}

// Seed 003: "Fan-out must not block the ingestion pipeline". A subscriber
// that stopped reading (its socket full, its queue overflowing) holds no
// publish up: each is answered at once, long before the slow-client timeout
// could free it, and a subscriber beside it gets every event.
func TestPublishingDoesNotWaitForAStalledSubscriber(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	sse /events {
		channel a
		queue 4
		max_event_size 16KiB
		history 100000
		history_bytes 512MiB
		slow_client_timeout 1m
		publish {
			secret `+testSecret+`
		}
	}
}
`)
	stalled, tap := openValved(t, srv.base+"/events", smallReceiveBuffer())
	healthy := srv.subscribe("/events", nil)
	srv.publish("/events", map[string]any{"channel": "a", "data": "warm"})
	stalled.next()
	healthy.next()
	tap.stall()
	payload := strings.Repeat("x", 16000)
	const n = 600 // ~9.6 MB: more than the sockets hold
	var slowest time.Duration
	began := time.Now()
	for i := range n {
		t0 := time.Now()
		srv.publish("/events", map[string]any{"channel": "a", "data": fmt.Sprint(i, payload)})
		slowest = max(slowest, time.Since(t0))
	}
	t.Logf("%d publishes in %v, the slowest %v", n, time.Since(began).Round(time.Millisecond), slowest.Round(time.Millisecond))
	if slowest > 5*time.Second {
		t.Fatalf("a publish took %v while a subscriber was stalled", slowest)
	}
	if got := len(stalled.events); got > n/10 {
		t.Fatalf("the stalled subscriber read %d of %d events: it was not stalled", got, n)
	}
	for i := range n {
		if ev := healthy.next(); ev.Data != fmt.Sprint(i, payload) {
			t.Fatalf("the healthy subscriber's event %d: %.20q", i, ev.Data)
		}
	}
}

// Idempotency keys are per namespace: two tenants (or sites) on one hub
// that happen to send the same key with the same body both publish, each to
// its own channel. A key shared across them would answer the second with
// the first's reply, and its event would never be published.
func TestIdempotencyKeysArePerNamespace(t *testing.T) {
	srv := startCaddy(t, namespacedSite)
	x := srv.subscribe("/x/events?channels=a", nil)
	y := srv.subscribe("/y/events?channels=a", nil)
	body := mustJSON(t, map[string]any{"channel": "a", "data": "hello"})
	key := header("Idempotency-Key", "order-1")
	for _, path := range []string{"/x/events", "/y/events"} {
		status, reply := srv.post(path, "application/json", body, key)
		if status != 200 {
			t.Fatalf("POST %s: %d %s", path, status, reply)
		}
	}
	if ev := x.next(); ev.Data != "hello" {
		t.Fatalf("namespace x got %+v", ev)
	}
	if ev := y.next(); ev.Data != "hello" {
		t.Fatalf("namespace y got %+v", ev)
	}
}

// Heartbeats come when a stream was silent for the interval, not more
// often (SPEC S7: "a comment whenever a stream was silent for heartbeat"):
// the shared ticker runs at a quarter of the interval, and a stream that
// wrote since is not due. Many idle streams (mobile clients among them)
// would otherwise be woken four times as often, and busy ones get comments
// between their events.
func TestHeartbeatsAreNotSentMoreOftenThanTheInterval(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	sse /events {
		channel a
		heartbeat 800ms
	}
}
`)
	const heartbeat = 800 * time.Millisecond
	c := srv.subscribe("/events", nil)
	c.comment("ok")
	var last time.Time
	for i := range 5 {
		c.comment("heartbeat")
		now := time.Now()
		// the ticker may make one a quarter early; half the interval
		// leaves room for a client that read the previous one late
		if i > 0 && now.Sub(last) < heartbeat/2 {
			t.Fatalf("heartbeat %d came %v after the previous one, with heartbeat %v", i+1, now.Sub(last).Round(time.Millisecond), heartbeat)
		}
		last = now
	}
}
