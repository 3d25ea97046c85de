package caddysse

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	"golang.org/x/net/http2"

	"github.com/caddy-sse/caddy-sse/pubsub"
)

// trickleWriter is a client that takes every write, but only after a
// pause: slow, though no single write blocks for the slow-client timeout.
type trickleWriter struct {
	pause time.Duration

	mu     sync.Mutex
	writes int
	last   string // what WriteLast was given
}

func (w *trickleWriter) Write([]byte) error {
	time.Sleep(w.pause)
	w.mu.Lock()
	w.writes++
	w.mu.Unlock()
	return nil
}

func (w *trickleWriter) MayBlock() bool { return true }

func (w *trickleWriter) Flush() error { return nil }

func (w *trickleWriter) WriteLast(p []byte) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.last += string(p)
	return nil
}

// A stream whose queue stays full for the slow-client timeout, while each
// of its writes is short, is ended by the registry's shared ticker with the
// slow-client comment, without writing all that it was behind; the overflow
// is logged once, not per event.
func TestQueueFullForTheTimeoutEndsTheStream(t *testing.T) {
	const timeout = 200 * time.Millisecond
	h := validHandler()
	h.Queue = 4
	h.SlowClientTimeout = caddy.Duration(timeout)
	core, logs := observer.New(zap.InfoLevel)
	h.logger = zap.New(core)
	h.metrics = newMetrics()
	h.hub = pubsub.NewMemoryHub()
	defer h.hub.Close()
	h.limits = h.hubLimits()
	h.streams = newRegistry(h.logger, 0, 0, timeout)
	defer h.streams.stop()
	h.drainer = newDrainer()
	defer h.drainer.stop()

	s := newStream(h, []string{"a"})
	defer h.hub.Subscribe(s, s.keys).Close()
	w := &trickleWriter{pause: timeout / 20}
	s.out = w
	h.streams.add(s)
	ended := make(chan error, 1)
	began := time.Now()
	go func() { ended <- h.drainer.serve(context.Background(), s) }()

	// publish far faster than the client takes events, until the stream ends
	msg := pubsub.Message{Data: []byte("x")}
	published := 0
	var err error
publishing:
	for {
		select {
		case err = <-ended:
			break publishing
		case <-time.After(time.Millisecond):
		}
		if time.Since(began) > waitFor {
			t.Fatal("the stream was not ended")
		}
		if _, err := h.hub.Publish(context.Background(), "a", msg, h.limits); err != nil {
			t.Fatal(err)
		}
		published++
	}
	if !s.endedSlow(err) {
		t.Fatalf("the stream ended with %v, not as a slow client", err)
	}
	if w.last != ": connection closed: slow client\n" {
		t.Fatalf("last words %q, want the slow-client comment", w.last)
	}
	if lasted := time.Since(began); lasted < timeout {
		t.Fatalf("ended after %v, before the slow-client timeout", lasted)
	}
	if int64(published) <= s.eventsSent+int64(h.Queue) {
		t.Fatalf("the client was not behind: %d published, %d sent", published, s.eventsSent)
	}
	s.countDelivered()
	h.metrics.dropped(s.takeDropped())
	full := logs.FilterMessage("sse_queue_full").AllUntimed()
	episodes := counterValue(t, h.metrics.catchUps) // each taken overflow is caught up once
	dropped := counterValue(t, h.metrics.droppedEvents)
	if len(full) == 0 || float64(len(full)) != episodes || dropped < 4*episodes {
		t.Fatalf("%d sse_queue_full warnings for %v overflow episodes and %v dropped events: want one per episode", len(full), episodes, dropped)
	}
	fields := full[0].ContextMap()
	if full[0].Level != zap.WarnLevel || fields["queue_depth"] != int64(h.Queue) || fmt.Sprint(fields["channels"]) != "[a]" {
		t.Fatalf("sse_queue_full: %v %v", full[0].Level, fields)
	}
}

func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

// valve passes a response body's reads until it is stalled, then holds
// them back (but for what let allows) until it is resumed: a client that
// stops reading.
type valve struct {
	io.ReadCloser
	stalled atomic.Bool
	allowed atomic.Int64  // bytes a stalled valve still lets through
	more    chan struct{} // let was called
	resumed chan struct{}
	once    sync.Once
}

func (v *valve) Read(p []byte) (int, error) {
	if !v.stalled.Load() {
		return v.ReadCloser.Read(p)
	}
	for v.allowed.Load() <= 0 {
		select {
		case <-v.resumed:
			return v.ReadCloser.Read(p)
		case <-v.more:
		}
	}
	if n := v.allowed.Load(); int64(len(p)) > n {
		p = p[:n]
	}
	n, err := v.ReadCloser.Read(p)
	v.allowed.Add(-int64(n))
	return n, err
}

func (v *valve) stall()  { v.stalled.Store(true) }
func (v *valve) resume() { v.once.Do(func() { close(v.resumed) }) }

// let lets a stalled valve pass n more bytes, and waits until they have
// been read.
func (v *valve) let(t testing.TB, n int64) {
	t.Helper()
	v.allowed.Add(n)
	select {
	case v.more <- struct{}{}:
	default:
	}
	deadline := time.Now().Add(15 * time.Second)
	for v.allowed.Load() > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the client could read only %d of %d bytes", n-v.allowed.Load(), n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// openValved opens a stream whose reads go through a valve, over client.
func openValved(t testing.TB, url string, client *http.Client) (*sseClient, *valve) {
	t.Helper()
	resp, err := client.Get(url)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("GET %s: %v", url, err)
	}
	v := &valve{ReadCloser: resp.Body, resumed: make(chan struct{}), more: make(chan struct{}, 1)}
	resp.Body = v
	c := &sseClient{t: t, resp: resp, cancel: func() {},
		events: make(chan sseEvent, 100000), comments: make(chan string, 100), done: make(chan struct{})}
	go c.read()
	t.Cleanup(func() {
		v.resume()
		c.close()
	})
	return c, v
}

// smallReceiveBuffer makes a client whose sockets hold little, so that a
// client that stops reading soon blocks the server's writes.
func smallReceiveBuffer() *http.Client {
	dialer := &net.Dialer{Control: func(_, _ string, c syscall.RawConn) error {
		return c.Control(func(fd uintptr) {
			_ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096)
		})
	}}
	return &http.Client{Transport: &http.Transport{DialContext: dialer.DialContext, DisableCompression: true}}
}

// scrape returns the text of the site's /metrics. It uses a new connection
// each time: a kept-alive one may have been closed by a reload.
func (s *testServer) scrape() string {
	s.t.Helper()
	req, err := http.NewRequest(http.MethodGet, s.base+"/metrics", nil)
	if err != nil {
		s.t.Fatal(err)
	}
	resp, err := doAcrossReloads(requestClient, req) // scrapes follow reloads
	if err != nil {
		s.t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		s.t.Fatalf("/metrics: %d %s", resp.StatusCode, body)
	}
	return string(body)
}

// metric returns the value of one series (name and labels as exposed) in
// a scrape, failing the test if it is missing.
func metric(t testing.TB, scrape, series string) float64 {
	t.Helper()
	for _, line := range strings.Split(scrape, "\n") {
		if value, ok := strings.CutPrefix(line, series+" "); ok {
			v, err := strconv.ParseFloat(value, 64)
			if err != nil {
				t.Fatalf("%s: %v", line, err)
			}
			return v
		}
	}
	t.Fatalf("no series %s in the scrape", series)
	return 0
}

// A client that stops reading while thousands of events are published is
// disconnected within about the slow-client timeout and throttled (SPEC
// S7); its queue never holds more than its bound, another subscriber of
// the channel gets every event, and once the throttle has passed the slow
// client's reconnect replays from its last id.
func TestSlowClientIsDisconnectedThrottledAndResumes(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	metrics /metrics
	sse /events {
		channel a
		principal {query.user}
		queue 16
		max_event_size 16KiB
		queue_bytes 128KiB
		history 100000
		history_bytes 512MiB
		replay_limit 100000
		slow_client_timeout 1s
		throttle 3s
		publish {
			secret `+testSecret+`
		}
	}
}
`)
	var fastSeq atomic.Uint64
	consumed := make(chan struct{})
	t.Cleanup(func() { <-consumed }) // runs after the stream's own cleanup closes it
	fast := srv.subscribe("/events?user=fast", nil)
	go func() {
		defer close(consumed)
		for ev := range fast.events {
			seq := seqOf(t, ev.ID).Seq
			if prev := fastSeq.Swap(seq); seq != prev+1 {
				t.Errorf("the fast subscriber got seq %d after %d: a hole or a duplicate", seq, prev)
			}
		}
	}()

	slow, tap := openValved(t, srv.base+"/events?user=slow", smallReceiveBuffer())
	for i := range 3 {
		srv.publish("/events", map[string]any{"channel": "a", "data": fmt.Sprint("warm ", i)})
	}
	var last sseEvent
	for range 3 {
		last = slow.next()
	}
	tap.stall()

	// 16 KB events: a few hundred fill what the sockets hold
	payload := strings.Repeat("x", 16000)
	published := 3
	stalled := time.Now()
	for metric(t, srv.scrape(), "caddy_sse_slow_client_disconnects_total") == 0 {
		// bounded by time, not by a count: a quick box publishes 10,000
		// events before the slow-client timeout and its sweep have passed
		if time.Since(stalled) > waitFor {
			t.Fatalf("the stalled client was not disconnected %v after it stalled, after %d events", waitFor, published)
		}
		if published > 10000 {
			time.Sleep(20 * time.Millisecond) // enough to fill every buffer: publish on, slower
		}
		published += srv.publishConcurrently(payload, 100, 4)
	}
	t.Logf("disconnected %v after it stalled, after %d events", time.Since(stalled).Round(time.Millisecond), published)

	// throttled: that principal from this address, for about 3s
	resp := do(t, http.MethodGet, srv.base+"/events?user=slow", nil, "")
	if ra, _ := strconv.Atoi(resp.Header.Get("Retry-After")); ra < 1 || ra > 3 {
		t.Errorf("Retry-After %q, want 1 to 3", resp.Header.Get("Retry-After"))
	}
	assertError(t, resp, 429, "throttled")
	// ...not its other device, nor another principal
	for _, c := range []*sseClient{
		openStream(t, srv.base+"/events?user=slow", nil, dialFrom("127.0.0.2")),
		openStream(t, srv.base+"/events?user=other", nil, nil),
	} {
		if c.resp.StatusCode != 200 {
			t.Fatalf("status %d, want 200", c.resp.StatusCode)
		}
		c.close()
	}

	eventually(t, "the fast subscriber got every event", func() bool { return fastSeq.Load() == uint64(published) })
	scrape := srv.scrape()
	depths := metric(t, scrape, "caddy_sse_queue_depth_count")
	if within := metric(t, scrape, `caddy_sse_queue_depth_bucket{le="16"}`); depths == 0 || within != depths {
		t.Fatalf("%v of %v queue depths within the bound of 16", within, depths)
	}
	if metric(t, scrape, "caddy_sse_events_dropped_total") == 0 {
		t.Fatal("no event was dropped from the stalled client's queue: it never overflowed")
	}

	// the slow client reads again: what the socket held, then the end
	tap.resume()
	for ev := range slow.events {
		last = ev
	}
	told := false
	for len(slow.comments) > 0 {
		told = told || <-slow.comments == ": connection closed: slow client"
	}
	t.Logf("the slow client got the slow-client comment: %v (it is written only if the socket has room)", told)

	// after the throttle, its reconnect replays from its last id
	var again *sseClient
	eventually(t, "the throttle to pass", func() bool {
		again = openStream(t, srv.base+"/events?user=slow", header("Last-Event-ID", last.ID), nil)
		if again.resp.StatusCode == 200 {
			return true
		}
		again.close()
		return false
	})
	for want := seqOf(t, last.ID).Seq + 1; want <= uint64(published); want++ {
		if got := seqOf(t, again.next().ID).Seq; got != want {
			t.Fatalf("replay: seq %d, want %d", got, want)
		}
	}
}

// A single write that blocks for the slow-client timeout ends the stream
// as a slow client's, although its queue never fills: the client stopped
// reading with a few MB on the way, and nothing more is published. Each
// write has no deadline of its own; the registry's ticker cuts the one in
// flight (the takeover writer's loops notice the socket taking nothing).
func TestAWriteBlockedForTheSlowClientTimeoutEndsTheStream(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	metrics /metrics
	sse /events {
		channel a
		queue 100000
		queue_bytes 256MiB
		max_event_size 64KiB
		history 100000
		history_bytes 512MiB
		slow_client_timeout 1s
		publish {
			secret `+testSecret+`
		}
	}
}
`)
	slow, tap := openValved(t, srv.base+"/events", smallReceiveBuffer())
	srv.publish("/events", map[string]any{"channel": "a", "data": "warm"})
	slow.next()
	tap.stall()
	// more than the sockets hold (a loopback send buffer grows to 4 MB)
	srv.publishConcurrently(strings.Repeat("x", 60000), 200, 4)
	published := time.Now()
	eventually(t, "the stalled client to be disconnected as slow", func() bool {
		return metric(t, srv.scrape(), "caddy_sse_slow_client_disconnects_total") == 1
	})
	t.Logf("disconnected %v after the last publish", time.Since(published).Round(time.Millisecond))
	if dropped := metric(t, srv.scrape(), "caddy_sse_events_dropped_total"); dropped != 0 {
		t.Fatalf("%v events dropped: the queue overflowed, the blocked write was not what ended the stream", dropped)
	}
	tap.resume()
	for range slow.events { // what the sockets held, then the end
	}
	resp := do(t, http.MethodGet, srv.base+"/events", nil, "")
	assertError(t, resp, 429, "throttled")
}

// publishConcurrently publishes n events of data to channel a from workers
// goroutines and returns n.
func (s *testServer) publishConcurrently(data string, n, workers int) int {
	s.t.Helper()
	body := mustJSON(s.t, map[string]any{"channel": "a", "data": data})
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < n; i += workers {
				if status, reply := s.post("/events", "application/json", body, nil); status != 200 {
					s.t.Errorf("publish: %d %s", status, reply)
					return
				}
			}
		}()
	}
	wg.Wait()
	return n
}

// A stream told to close (a reload, a stop) whose client has stopped
// reading ends within the last-words bound, not after the slow-client
// timeout: a stop waits for every stream, and a write already blocked when
// the close comes is hurried too. Its server_closing cannot reach that
// client; a client that reads gets it (the reload and stop tests).
//
// Both ways a stream writes: from its queue, and catching up from the
// history after its queue overflowed (the takeover writer does that on a
// goroutine of the stream's own, with blocking writes). The slow-client
// timeout is long enough that publishing the load never outlasts it, on a
// busy machine too (the stream would end as slow before the close).
func TestCloseOfAStalledStreamIsBounded(t *testing.T) {
	t.Run("from the queue", func(t *testing.T) { testCloseOfAStalledStream(t, "5000", "256MiB", false) })
	t.Run("from the history", func(t *testing.T) { testCloseOfAStalledStream(t, "4", "64KiB", true) })
}

func testCloseOfAStalledStream(t *testing.T, queue, queueBytes string, catchUp bool) {
	sites := `
:{PORT} {
	metrics /metrics
	sse /events {
		channel a
		queue ` + queue + `
		max_event_size 16KiB
		queue_bytes ` + queueBytes + `
		history 100000
		history_bytes 512MiB
		slow_client_timeout 60s
		throttle off
		heartbeat off
		close_jitter 100ms
		publish {
			secret ` + testSecret + `
		}
	}
}
`
	srv := startCaddy(t, sites)
	c, tap := openValved(t, srv.base+"/events", smallReceiveBuffer())
	srv.publish("/events", map[string]any{"channel": "a", "data": "warm"})
	if ev := c.next(); ev.Data != "warm" {
		t.Fatalf("got %+v", ev)
	}
	tap.stall()
	if !catchUp {
		srv.publishConcurrently(strings.Repeat("x", 16000), 600, 4) // ~9.6 MB: more than the sockets hold
	} else {
		// ~19 MB: the sockets fill and the queue overflows; the client then
		// reads enough for the stream to start catching up from the
		// history, and stalls again while that is still being written
		srv.publishConcurrently(strings.Repeat("x", 16000), 1200, 4)
		tap.let(t, 6<<20)
	}
	time.Sleep(500 * time.Millisecond) // the stream's write blocks on the full socket
	began := time.Now()
	srv.reload(sites) // the old config's streams are told to close
	for metric(t, srv.scrape(), "caddy_sse_streams_open") != 0 {
		if time.Since(began) > 30*time.Second {
			t.Fatal("the stalled stream never ended")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if took := time.Since(began); took > 5*time.Second {
		t.Errorf("a stalled stream took %v to end after it was told to close (slow_client_timeout 60s, last words %v)", took.Round(10*time.Millisecond), lastWordsTimeout)
	}
}

// A client whose socket is full for a moment (far less than
// slow_client_timeout) when a reload tells its stream to close: the write
// in flight is hurried to lastWordsTimeout and fails with a deadline, which
// is not the client's slowness. It is neither counted as a slow client nor
// throttled, so its reconnect after the reload is answered 200 (a 429
// would make an EventSource give up for good).
func TestAReloadDoesNotThrottleAClientBehindForAMoment(t *testing.T) {
	sites := behindSite("principal {query.user}", "throttle 60s")
	srv := startCaddy(t, sites)
	c, tap := openValved(t, srv.base+"/events?user=u", smallReceiveBuffer())
	srv.publish("/events", map[string]any{"channel": "a", "data": "warm"})
	if ev := c.next(); ev.Data != "warm" {
		t.Fatalf("got %+v", ev)
	}
	tap.stall()
	srv.publishConcurrently(strings.Repeat("x", 16000), 600, 4) // more than the sockets hold
	time.Sleep(500 * time.Millisecond)                          // the stream's write blocks on the full socket
	srv.reload(sites)
	eventually(t, "the old stream to end", func() bool { return metric(t, srv.scrape(), "caddy_sse_streams_open") == 0 })
	tap.resume()
	if slow := metric(t, srv.scrape(), "caddy_sse_slow_client_disconnects_total"); slow != 0 {
		t.Errorf("caddy_sse_slow_client_disconnects_total %v after a reload ended a stream behind for a moment; want 0", slow)
	}
	resp := do(t, http.MethodGet, srv.base+"/events?user=u", nil, "")
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("reconnect after the reload: %d (Retry-After %q); want 200", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
}

// A client that reads slowly but steadily — no write blocks for the
// slow-client timeout, so it is not slow (SPEC S7) — and then leaves in
// the middle of a long batch of events is not throttled: its write failed
// because it left, not because of the timeout. (The batch having lasted
// about the timeout is a sign of the deadline only on HTTP/2, which resets
// the stream instead of reporting it; HTTP/1.1 reports the deadline.)
func TestClientLeavingDuringALongBatchIsNotThrottled(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	metrics /metrics
	sse /events {
		channel {query.channels}
		slow_client_timeout 2s
		throttle 60s
		queue 1000
		queue_bytes 64MiB
		history_bytes 64MiB
		publish {
			secret `+testSecret+`
		}
	}
}
`)
	conn, err := net.Dial("tcp", "127.0.0.1:"+itoa(srv.port))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := io.WriteString(conn, "GET /events?channels=big HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	r := bufio.NewReader(conn)
	readRawUntil(t, r, ": ok")
	data := strings.Repeat("x", 32<<10)
	stop, published := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(published)
		for range 400 {
			select {
			case <-stop:
				return
			default:
			}
			if status, _ := srv.post("/events", "application/json", mustJSON(t, map[string]any{"channel": "big", "data": data}), nil); status != http.StatusOK {
				return
			}
		}
	}()
	// the publisher ends before the test does: a publish to the stopped
	// server would fail a test that has completed (a panic)
	defer func() { close(stop); <-published }()
	// read 32 KiB every 20 ms (1.6 MB/s: about 8 s for the events; the
	// kernel wakes a blocked writer once a third of its send buffer, a few
	// MB on loopback, is free: no write waits near 2 s), and leave after
	// 4 s, in a batch that has been writing for longer than 2 s
	buf := make([]byte, 32<<10)
	n := 0
	for end := time.Now().Add(4 * time.Second); time.Now().Before(end); {
		got, err := io.ReadFull(r, buf)
		if err != nil {
			t.Fatalf("reading the stream: %v", err)
		}
		n += got
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("read %d bytes", n)
	_ = conn.(*net.TCPConn).SetLinger(0)
	conn.Close()
	srv.assertNotThrottledOnceItsStreamEnded()
}

// A client behind for a moment when a reload tells its stream to close —
// its socket full, but it reads again at once — gets what the socket held
// and then server_closing (SPEC S8; what was still queued is not written):
// the last words wait for the socket within lastWordsTimeout, as on
// net/http, rather than being dropped because it was full when the close
// came.
func TestAReloadTellsAClientBehindForAMomentServerClosing(t *testing.T) {
	sites := behindSite("throttle off")
	srv := startCaddy(t, sites)
	c, tap := openValved(t, srv.base+"/events", smallReceiveBuffer())
	probe := srv.subscribe("/events", nil) // reads along: tells when the close came
	srv.publish("/events", map[string]any{"channel": "a", "data": "warm"})
	if ev := c.next(); ev.Data != "warm" {
		t.Fatalf("got %+v", ev)
	}
	tap.stall()
	const events = 300
	srv.publishConcurrently(strings.Repeat("x", 16000), events, 4) // ~4.8 MB: more than the sockets hold
	time.Sleep(500 * time.Millisecond)                             // the socket is full
	reloaded := make(chan struct{})
	go func() {
		defer close(reloaded)
		srv.reload(sites)
	}()
	for ev := probe.next(); ev.Type != "server_closing"; ev = probe.next() {
	}
	tap.resume() // the stalled stream was told in the same breath
	got := 0
	for ev := range c.events {
		switch {
		case ev.Type == "server_closing":
			<-reloaded
			return
		case ev.Type == "message":
			got++
		}
	}
	<-reloaded
	t.Fatalf("the stream ended after %d of %d events without server_closing", got, events+1)
}

// The same on HTTP/2, where a passed write deadline resets the stream
// unreported: a client that reads a long replay steadily (no write waits
// near slow_client_timeout, though the batch writes for longer) and then
// cancels its stream is not throttled. Each write and flush has a deadline
// of its own, so only one that lasted the timeout can have been cut by it.
func TestH2ClientLeavingDuringALongBatchIsNotThrottled(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	metrics /metrics
	sse /events {
		channel {query.channels}
		slow_client_timeout 2s
		throttle 60s
		history_bytes 64MiB
		publish {
			secret `+testSecret+`
		}
	}
}
`, h2cGlobals)
	data := strings.Repeat("x", 32<<10)
	first := srv.publish("/events", map[string]any{"channel": "big", "data": data})["big"]
	for range 300 {
		srv.publish("/events", map[string]any{"channel": "big", "data": data})
	}
	c := dialH2Raw(t, "127.0.0.1:"+itoa(srv.port), 32<<10)
	id := c.getHeaders("/events?channels=big", [2]string{"last-event-id", first})
	var got atomic.Int64
	go func() {
		for {
			f, err := c.fr.ReadFrame()
			if err != nil {
				return
			}
			switch f := f.(type) {
			case *http2.DataFrame:
				got.Add(int64(len(f.Data())))
			case *http2.SettingsFrame:
				if !f.IsAck() {
					c.write(func(fr *http2.Framer) error { return fr.WriteSettingsAck() })
				}
			}
		}
	}()
	// grant 32 KiB of the stream's window every 20 ms (1.6 MB/s: about 6 s
	// for the replay, one batch; no write waits near 2 s), and leave after
	// 3 s
	for end := time.Now().Add(3 * time.Second); time.Now().Before(end); {
		c.write(func(fr *http2.Framer) error { return fr.WriteWindowUpdate(id, 32<<10) })
		time.Sleep(20 * time.Millisecond)
	}
	if n := got.Load(); n < 2<<20 || n > 8<<20 {
		t.Fatalf("read %d bytes: the replay was not still being written", n)
	}
	c.write(func(fr *http2.Framer) error { return fr.WriteRSTStream(id, http2.ErrCodeCancel) })
	srv.assertNotThrottledOnceItsStreamEnded()
}

// behindSite is a site on channel a whose streams' queues and history hold
// hundreds of 16 KB events, for clients that fall behind (their sockets
// full) at a reload; settings are added to its sse block.
func behindSite(settings ...string) string {
	return `
:{PORT} {
	metrics /metrics
	sse /events {
		channel a
		queue 5000
		max_event_size 16KiB
		queue_bytes 256MiB
		history 100000
		history_bytes 512MiB
		slow_client_timeout 30s
		heartbeat off
		close_jitter off
		` + strings.Join(settings, "\n\t\t") + `
		publish {
			secret ` + testSecret + `
		}
	}
}
`
}

// assertNotThrottledOnceItsStreamEnded waits for the site's one stream to
// end (a client left in the middle of a long batch), then checks that a
// new stream from the same address is not refused as throttled.
func (s *testServer) assertNotThrottledOnceItsStreamEnded() {
	t := s.t
	t.Helper()
	eventually(t, "the stream to end", func() bool { return metric(t, s.scrape(), "caddy_sse_streams_open") == 0 })
	resp, err := http.Get(s.base + "/events?channels=other")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(resp.Body)
		t.Fatalf("the client was throttled for leaving during a long batch: %d %s", resp.StatusCode, body)
	}
}

// A client that stops reading is logged sse_queue_full when its queue
// overflows, as README says (one warning per overflow episode), though its
// writer, blocked on the client, never takes the queue that overflowed:
// the warning was written only when the writer took it, so the usual slow
// client — cut while its write is blocked — was never logged.
func TestAClientThatStopsReadingIsLoggedAsQueueFull(t *testing.T) {
	logFile := filepath.Join(t.TempDir(), "sse.log")
	srv := startCaddy(t, `
:{PORT} {
	metrics /metrics
	sse /events {
		channel a
		principal {query.user}
		queue 16
		max_event_size 64KiB
		queue_bytes 1MiB
		slow_client_timeout 1s
		publish {
			secret `+testSecret+`
		}
	}
}
`, sseLog(logFile))
	srv.cutSlowClient("/events?user=slowpoke")
	logged := func(msg, level string) func() bool {
		return func() bool {
			return strings.Contains(logLine(t, logFile, msg, `"principal":"slowpoke"`), `"level":"`+level+`"`)
		}
	}
	eventually(t, "sse_queue_full for the client, at warn", logged("sse_queue_full", "warn"))
	// and its cut, at info (README, "Logs")
	eventually(t, "slow client disconnected for the client, at info", logged("slow client disconnected", "info"))
}

// A stream's queue holds at most queue_bytes (SPEC S7): the queue of a
// client that stops reading overflows on its bytes long before its count,
// and once the client reads again the stream catches up from the history,
// without a hole.
func TestQueueBytesBoundsAStalledStreamsQueue(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	metrics /metrics
	sse /events {
		channel a
		queue 5000
		max_event_size 16KiB
		queue_bytes 64KiB
		history 100000
		history_bytes 512MiB
		slow_client_timeout 60s
		throttle off
		heartbeat off
		publish {
			secret `+testSecret+`
		}
	}
}
`)
	c, tap := openValved(t, srv.base+"/events", smallReceiveBuffer())
	srv.publish("/events", map[string]any{"channel": "a", "data": "warm"})
	if ev := c.next(); ev.Data != "warm" {
		t.Fatalf("got %+v", ev)
	}
	tap.stall()
	// ~13 MB in 800 events: more than the sockets hold (a send buffer
	// grows to 4 MiB by default), far more than queue_bytes, well under
	// the queue's count
	const n = 800
	pad := strings.Repeat("x", 16000)
	for i := 1; i <= n; i++ {
		srv.publish("/events", map[string]any{"channel": "a", "data": fmt.Sprintf("%04d", i) + pad})
	}
	tap.resume()
	for i := 1; i <= n; i++ {
		if ev := c.next(); !strings.HasPrefix(ev.Data, fmt.Sprintf("%04d", i)) || len(ev.Data) != 4+len(pad) {
			t.Fatalf("event %d: got %.10q... (%d bytes)", i, ev.Data, len(ev.Data))
		}
	}
	eventually(t, "the queue to have overflowed on its bytes", func() bool {
		return metric(t, srv.scrape(), "caddy_sse_events_dropped_total") > 0
	})
}

// A slow client is throttled for the configured throttle, not a moment:
// its refusal's Retry-After says the rest of that period (SPEC S7).
func TestSlowClientIsThrottledForTheThrottlePeriod(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	metrics /metrics
	sse /events {
		channel a
		principal {query.user}
		queue 4
		max_event_size 64KiB
		slow_client_timeout 500ms
		throttle 60s
		publish {
			secret `+testSecret+`
		}
	}
}
`)
	srv.cutSlowClient("/events?user=slowpoke")
	refused := do(t, http.MethodGet, srv.base+"/events?user=slowpoke", nil, "")
	// waitFor bounds how long the disconnect took to be seen
	if ra, _ := strconv.Atoi(refused.Header.Get("Retry-After")); ra < 60-int(waitFor/time.Second) || ra > 60 {
		t.Errorf("Retry-After %q after a slow-client disconnect with throttle 60s", refused.Header.Get("Retry-After"))
	}
	assertError(t, refused, 429, "throttled")
}

// cutSlowClient opens a stream at path (of channel a, on /events) that is
// never read, the only one open, and publishes 60 KiB events until it is
// cut as a slow client.
func (s *testServer) cutSlowClient(path string) {
	s.t.Helper()
	resp, err := smallReceiveBuffer().Get(s.base + path)
	if err != nil {
		s.t.Fatal(err)
	}
	s.t.Cleanup(func() { resp.Body.Close() }) // never read
	eventually(s.t, "the stream to open", func() bool { return metric(s.t, s.scrape(), "caddy_sse_streams_open") == 1 })
	payload := strings.Repeat("s", 60<<10)
	deadline := time.Now().Add(waitFor)
	for metric(s.t, s.scrape(), "caddy_sse_slow_client_disconnects_total") == 0 {
		if time.Now().After(deadline) {
			s.t.Fatal("the client that reads nothing was not cut")
		}
		s.publish("/events", map[string]any{"channel": "a", "data": payload})
		time.Sleep(10 * time.Millisecond)
	}
}
