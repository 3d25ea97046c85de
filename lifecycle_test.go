package caddysse

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

const idleSite = `
:{PORT} {
	sse /events {
		channel {query.channels}
		heartbeat 50ms
		publish {
			secret ` + testSecret + `
		}
	}
}
`

// steadyGoroutines returns the goroutine count once it has stopped
// changing, after closing the test's idle keep-alive connections (their
// client and server goroutines are not the streams').
func steadyGoroutines() int {
	requestClient.CloseIdleConnections()
	prev := -1
	deadline := time.Now().Add(waitFor)
	for {
		n := runtime.NumGoroutine()
		if n == prev || time.Now().After(deadline) {
			return n
		}
		prev = n
		time.Sleep(100 * time.Millisecond)
	}
}

// settleGoroutines waits until the goroutine count is at most want, and
// returns the last count. It waits longer than the step pool's workers
// idle (workerIdle) before they end: while the server runs, the workers
// its streams' steps started are counted until then, and a wait of
// waitFor alone (as long) raced with them, to fail on a loaded machine.
func settleGoroutines(want int) int {
	requestClient.CloseIdleConnections()
	deadline := time.Now().Add(workerIdle + waitFor)
	n := runtime.NumGoroutine()
	for n > want && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
		n = runtime.NumGoroutine()
	}
	return n
}

func TestNoGoroutineLeakAfterManyStreams(t *testing.T) {
	srv := startCaddy(t, idleSite)
	addr := strings.TrimPrefix(srv.base, "http://")
	// warm up: the heartbeat ticker and the history sweeper start once
	rawStream(t, addr, "/events?channels=warm").Close()
	srv.publish("/events", map[string]any{"channel": "warm", "data": "x"})
	base := steadyGoroutines()

	for i := range 300 {
		conn := rawStream(t, addr, fmt.Sprintf("/events?channels=c%d,shared", i%7))
		if i%3 == 0 { // some leave while an event is on its way
			srv.publish("/events", map[string]any{"channel": "shared", "data": "x"})
		}
		conn.Close()
	}
	// every stream leaves the hub (a taken-over stream once its event loop
	// has seen the client go: not before the goroutines settle)
	hub, key, err := acquireHub(nil, "")
	if err != nil {
		t.Fatal(err)
	}
	defer releaseHub(key)
	deadline := time.Now().Add(waitFor)
	for i := range 7 {
		for hub.Subscribers(fmt.Sprintf("c%d", i)) != 0 {
			if time.Now().After(deadline) {
				t.Fatalf("channel c%d still has %d subscribers", i, hub.Subscribers(fmt.Sprintf("c%d", i)))
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	if n := settleGoroutines(base); n > base {
		t.Fatalf("goroutines: %d after the streams closed, %d before", n, base)
	}
}

// Idle streams cost the goroutines net/http needs per connection (the
// serve goroutine, which runs the handler, and its background reader) and
// nothing more: heartbeats come from one shared ticker.
func TestIdleStreamsNeedNoGoroutineOfTheirOwn(t *testing.T) {
	srv := startCaddy(t, idleSite)
	addr := strings.TrimPrefix(srv.base, "http://")
	rawStream(t, addr, "/events?channels=warm").Close()
	base := steadyGoroutines()

	const streams = 1000
	conns := make([]net.Conn, 0, streams)
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for i := range streams {
		conns = append(conns, rawStream(t, addr, fmt.Sprintf("/events?channels=idle%d", i%100)))
	}
	// heartbeats flow (every 50 ms) on the idle streams meanwhile
	expectHeartbeat(t, conns[0])
	expectHeartbeat(t, conns[streams-1])
	n := runtime.NumGoroutine()
	if perStream := float64(n-base) / streams; n-base > 2*streams+10 {
		t.Fatalf("%d goroutines for %d idle streams (%.2f per stream), want at most 2 per stream", n-base, streams, perStream)
	}
	t.Logf("%d goroutines for %d idle streams", n-base, streams)
}

func expectHeartbeat(t *testing.T, conn net.Conn) {
	t.Helper()
	_ = conn.SetReadDeadline(time.Now().Add(waitFor))
	r := bufio.NewReader(conn)
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			t.Fatalf("no heartbeat: %v", err)
		}
		if strings.Contains(line, ": heartbeat") {
			return
		}
	}
}

// A reload tells open streams server_closing (with a jittered retry) and
// keeps the hub: a client that reconnects with its last id gets what was
// published while it was away.
func TestReloadInProcessKeepsHistory(t *testing.T) {
	site := `
:{PORT} {
	sse /events {
		channel {query.channels}
		close_jitter 2s
		publish {
			secret ` + testSecret + `
		}
	}
}
`
	srv := startCaddy(t, site)
	c := srv.subscribe("/events?channels=a", nil)
	srv.publish("/events", map[string]any{"channel": "a", "data": "before"})
	last := c.next()

	srv.reload(site)
	closing := c.next()
	if closing.Type != "server_closing" || closing.Data != `{"reason":"reload"}` {
		t.Fatalf("got %+v, want server_closing for a reload", closing)
	}
	if closing.Retry < 0 || closing.Retry > 2000 {
		t.Fatalf("retry %d is not within close_jitter", closing.Retry)
	}
	if closing.ID != last.ID {
		t.Fatal("server_closing must not move the last event id")
	}
	c.expectEnd()

	srv.publish("/events", map[string]any{"channel": "a", "data": "during"})
	r := srv.subscribe("/events?channels=a", header("Last-Event-ID", last.ID))
	if got := r.next(); got.Data != "during" {
		t.Fatalf("got %+v after the reload, want the event published meanwhile", got)
	}
}

// noJitterSite streams channel a and tells its streams to come back at once
// (retry: 0) when it closes them.
const noJitterSite = `
:{PORT} {
	sse /events {
		channel a
		close_jitter off
	}
}
`

func TestCloseJitterOffSendsRetryZero(t *testing.T) {
	srv := startCaddy(t, noJitterSite)
	c := srv.subscribe("/events", nil)
	c.comment("ok")
	srv.reload(noJitterSite)
	if ev := c.next(); ev.Type != "server_closing" || ev.Retry != 0 {
		t.Fatalf("got %+v, want server_closing with retry 0", ev)
	}
}

// Streams told server_closing by a reload that reconnect at once all get a
// response. They are told once the old server has closed its listening
// socket: Caddy binds each config's with SO_REUSEPORT, so a reconnect made
// while the old socket is open may reach it, and net/http closes a
// connection whose request it reads after its shutdown has begun without
// a response (a reconnect storm of 10k streams lost 35 that way).
func TestReloadReconnectsAllGetAResponse(t *testing.T) {
	srv := startCaddy(t, noJitterSite)
	const n = 300
	streams := make([]*sseClient, n)
	for i := range streams {
		streams[i] = srv.subscribe("/events", nil)
		streams[i].comment("ok")
	}
	failures := make(chan string, n)
	var wg sync.WaitGroup
	for _, c := range streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			select {
			case ev := <-c.events:
				if ev.Type != "server_closing" {
					failures <- "got " + ev.Type + ", want server_closing"
					return
				}
			case <-time.After(20 * time.Second):
				failures <- "no server_closing"
				return
			}
			if status, err := reconnectOnce(srv.port, "/events"); err != nil {
				failures <- err.Error()
			} else if status != "200" {
				failures <- "status " + status
			}
		}()
	}
	srv.reload(noJitterSite)
	wg.Wait()
	noFailures(t, failures, n, "reconnects")
}

// noFailures closes failures, which goroutines filled, and fails the test
// with their count out of n and the first of them, if any.
func noFailures(t *testing.T, failures chan string, n int, what string) {
	t.Helper()
	close(failures)
	var got []string
	for f := range failures {
		got = append(got, f)
	}
	if len(got) > 0 {
		t.Fatalf("%d of %d %s failed, e.g. %q", len(got), n, what, got[0])
	}
}

// reconnectOnce opens a stream of path on a connection of its own and
// returns the status of its response head.
func reconnectOnce(port int, path string) (string, error) {
	conn, err := net.DialTimeout("tcp", "127.0.0.1:"+strconv.Itoa(port), 5*time.Second)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(conn, "GET "+path+" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"); err != nil {
		return "", err
	}
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		return "", fmt.Errorf("no response head: %v", err)
	}
	if _, status, ok := strings.Cut(line, " "); ok && len(status) >= 3 {
		return status[:3], nil
	}
	return "", fmt.Errorf("bad status line %q", line)
}

// Every stream's end is logged with why it ended (README, Logs: "stream
// ended (duration, events sent, reason)"). A stream that ended without an
// error was logged without a reason: on either writer one closed by a
// reload or stop (its last words written), and on the net_http writer one
// whose client left (the drainer sees only the request's end), while the
// takeover writer said "the client closed the connection" — the two most
// common ends of a stream were the ones an operator could not tell apart.
func TestAStreamsEndIsLoggedWithItsReason(t *testing.T) {
	file := filepath.Join(t.TempDir(), "sse.log")
	logs := "log ssefile {\n\t\toutput file " + file + "\n\t\tformat json\n\t\tlevel DEBUG\n\t\tinclude http.handlers.sse\n\t}"
	defer func() {
		if t.Failed() {
			b, _ := os.ReadFile(file)
			t.Logf("the module's log:\n%s", b)
		}
	}()
	loggedEnd := func(channel, reason string) {
		t.Helper()
		eventually(t, "the end of the stream on "+channel+" to be logged with its reason", func() bool {
			return strings.Contains(logLine(t, file, "stream ended", `"channels":["`+channel+`"]`), `"reason":"`+reason)
		})
	}
	srv := startCaddy(t, idleSite, logs)
	left := srv.subscribe("/events?channels=left", nil)
	left.comment("ok")
	left.close()
	// before the reload: a stream whose client left is ended when the
	// server notices, which a reload must not overtake
	loggedEnd("left", "the client closed the connection")

	closed := srv.subscribe("/events?channels=closed", nil)
	closed.comment("ok")
	srv.publish("/events", map[string]any{"channel": "closed", "data": "one"})
	if ev := closed.next(); ev.Data != "one" {
		t.Fatalf("got %+v", ev)
	}
	srv.reload(idleSite, logs)
	if ev := closed.next(); ev.Type != "server_closing" {
		t.Fatalf("got %+v, want server_closing", ev)
	}
	closed.expectEnd()
	loggedEnd("closed", "server closing: reload")

	// README, "Logs": each stream's opening, its end with how long it
	// lasted and what it was sent, and the reload's closing of the streams
	// at info level with how many
	opened := logLine(t, file, "stream opened", `"channels":["left"]`) != ""
	ended := logLine(t, file, "stream ended", `"channels":["closed"]`)
	closing := logLine(t, file, "closing streams", `"reason":"reload"`)
	if !opened || !strings.Contains(ended, `"events_sent":1,`) || !strings.Contains(ended, `"duration":`) ||
		!strings.Contains(closing, `"level":"info"`) || !strings.Contains(closing, `"streams":1,`) {
		t.Fatalf("logged: stream opened %v; want stream ended with duration and events_sent 1: %s; want closing streams at info with 1 stream: %s", opened, ended, closing)
	}
}
