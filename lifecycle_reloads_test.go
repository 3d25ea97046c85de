package caddysse

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

func lifeSite(body string) string {
	return `
:{PORT} {
	metrics /metrics
` + body + `
}
`
}

func lifeSSE(path, extra string) string {
	return `	sse ` + path + ` {
		channel {query.channels}
		close_jitter off
		heartbeat 50ms
		` + extra + `
		publish {
			secret ` + testSecret + `
		}
	}
`
}

// hubKeys lists the keys of the hub pool.
func pooledHubKeys() []string {
	var keys []string
	hubs.Range(func(k, _ any) bool {
		keys = append(keys, fmt.Sprint(k))
		return true
	})
	return keys
}

func redisClients(t *testing.T, rds *redistest.Server) int {
	t.Helper()
	out, err := rds.CLI("CLIENT", "LIST")
	if err != nil {
		t.Fatalf("CLIENT LIST: %v", err)
	}
	n := 0
	for _, line := range strings.Split(out, "\n") {
		if strings.Contains(line, "addr=") && !strings.Contains(line, "cmd=client") {
			n++
		}
	}
	return n
}

// Cleanup twice (a harmless thing for a CleanerUpper) must not panic nor
// release another handler's references.
func TestCleanupTwiceReleasesOnce(t *testing.T) {
	srv := startCaddy(t, lifeSite(lifeSSE("/events", "")))
	refsBefore, _ := hubs.References(embeddedHubKey)
	h := &Handler{Channels: []string{"a"}}
	ctx := caddy.ActiveContext()
	// as in an HTTP server (the running config's events app has started)
	ctx.Context = context.WithValue(ctx.Context, caddyhttp.ServerCtxKey, &caddyhttp.Server{})
	if err := h.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	cleanup := func() (p any) {
		defer func() { p = recover() }()
		_ = h.Cleanup()
		return nil
	}
	if p := cleanup(); p != nil {
		t.Fatalf("first Cleanup panicked: %v", p)
	}
	if p := cleanup(); p != nil {
		t.Errorf("second Cleanup panicked: %v", p)
	}
	if refs, _ := hubs.References(embeddedHubKey); refs != refsBefore {
		t.Errorf("embedded hub references: %d after Provision+Cleanup×2, want %d (the running config's)", refs, refsBefore)
	}
	// the running config still publishes
	assertDelivers(t, srv, "still")
}

func TestCleanupWithoutProvision(t *testing.T) {
	defer func() {
		if p := recover(); p != nil {
			t.Fatalf("Cleanup without Provision panicked: %v", p)
		}
	}()
	h := &Handler{Channels: []string{"a"}}
	_ = h.Cleanup()
	_ = h.Cleanup()
}

// A config whose Provision fails halfway (a valid first handler, a broken
// second) leaves nothing in the pools, and reloading back works.
func TestAFailedProvisionReleasesWhatItTook(t *testing.T) {
	rds := redistest.Start(t)
	good := lifeSite(lifeSSE("/events", ""))
	srv := startCaddy(t, good)
	baseKeys := pooledHubKeys()
	hubRefs, _ := hubs.References(embeddedHubKey)
	metricRefs, _ := metricsPool.References(metricsKey)
	loopRefs, _ := loopsPool.References(loopsKey) // the good config holds them under SSE_TEST_WRITER=takeover
	baseClients := redisClients(t, rds)
	missingCA := filepath.Join(t.TempDir(), "nope.pem")
	bad := map[string]string{
		"bad second redis url": lifeSSE("/a", "redis "+rds.URL()) + lifeSSE("/b", "redis redis://[::1"),
		"missing CA file":      lifeSSE("/a", "redis "+rds.URL()) + lifeSSE("/b", "redis {\n\t\t\turl "+rds.URL()+"\n\t\t\tprefix p2\n\t\t\ttls "+missingCA+"\n\t\t}"),
		"invalid after redis":  lifeSSE("/a", "redis "+rds.URL()) + lifeSSE("/b", "redis "+rds.URL()+"\n\t\tmax_connections 7777"),
		"invalid writer":       lifeSSE("/a", "writer takeover") + lifeSSE("/b", "max_connections 7777"),
	}
	for name, body := range bad {
		text := globalOptions("") + strings.ReplaceAll(lifeSite(body), "{PORT}", strconv.Itoa(srv.port))
		// the Caddyfile refuses a cap per principal without a principal
		// when it is adapted: the JSON has one, which only Validate
		// refuses, after the handler took its hub
		cfg := bytes.ReplaceAll(adapt(t, text), []byte(`"max_connections":7777`), []byte(`"max_connections_per_principal":2`))
		err := caddy.Load(cfg, true)
		if err == nil {
			t.Fatalf("%s: the config loaded", name)
		}
		t.Logf("%s: %v", name, err)
		if keys := pooledHubKeys(); len(keys) != len(baseKeys) {
			t.Errorf("%s: hub pool %q after the failed load, want %q", name, keys, baseKeys)
		}
		if r, _ := hubs.References(embeddedHubKey); r != hubRefs {
			t.Errorf("%s: embedded hub refs %d, want %d", name, r, hubRefs)
		}
		if r, _ := metricsPool.References(metricsKey); r != metricRefs {
			t.Errorf("%s: metrics refs %d, want %d", name, r, metricRefs)
		}
		if r, _ := loopsPool.References(loopsKey); r != loopRefs {
			t.Errorf("%s: takeover loops refs %d, want %d", name, r, loopRefs)
		}
	}
	if n := settledRedisClients(t, rds, baseClients); n > baseClients {
		t.Errorf("redis clients: %d after the failed loads, %d before", n, baseClients)
	}
	srv.reload(good)
	assertDelivers(t, srv, "back")
}

// Many reloads across embedded/Redis, writers, a second route and a changed
// Redis setting leak nothing: goroutines, fds, Redis connections, hubs;
// metrics keep counting and have no duplicate series.
func TestManyReloadsLeaveNothingBehind(t *testing.T) {
	t.Setenv("SSE_TEST_WRITER", "")
	rds := redistest.Start(t)
	configs := []string{
		lifeSSE("/events", "writer net_http"),
		lifeSSE("/events", "redis "+rds.URL()+"\n\t\twriter takeover"),
		lifeSSE("/events", "writer takeover") + lifeSSE("/two", "namespace two"),
		lifeSSE("/events", "redis {\n\t\t\turl "+rds.URL()+"\n\t\t\tpool_size 3\n\t\t}") + lifeSSE("/two", "redis "+rds.URL()),
		lifeSSE("/events", "redis {\n\t\t\turl "+rds.URL()+"\n\t\t\tpool_size 4\n\t\t}\n\t\twriter takeover"),
	}
	srv := startCaddy(t, lifeSite(configs[0]))
	warm := srv.subscribe("/events?channels=w", nil)
	warm.comment("ok")
	srv.publish("/events", map[string]any{"channel": "w", "data": "x"})
	warm.close()
	baseG, baseFD := steadyGoroutines(), openFDCount(t)
	baseStacks := make([]byte, 1<<20)
	baseStacks = baseStacks[:runtime.Stack(baseStacks, true)]
	baseClients := redisClients(t, rds)
	prevOpened := metric(t, srv.scrape(), "caddy_sse_streams_opened_total")
	for round := 0; round < 50; round++ {
		cfg := configs[round%len(configs)]
		if round%10 == 0 {
			c := srv.subscribe("/events?channels=r", nil)
			c.comment("ok")
			srv.reload(lifeSite(cfg))
			for ev := c.next(); ev.Type != "server_closing"; ev = c.next() {
			}
			c.expectEnd()
			c.close()
		} else {
			srv.reload(lifeSite(cfg))
		}
		scrape := srv.scrape()
		seen := map[string]bool{}
		for _, line := range strings.Split(scrape, "\n") {
			if line == "" || strings.HasPrefix(line, "#") {
				continue
			}
			series := line[:strings.LastIndex(line, " ")]
			if seen[series] {
				t.Fatalf("round %d: duplicate series %s", round, series)
			}
			seen[series] = true
		}
		opened := metric(t, scrape, "caddy_sse_streams_opened_total")
		if opened < prevOpened {
			t.Fatalf("round %d: streams_opened_total went from %v to %v", round, prevOpened, opened)
		}
		prevOpened = opened
	}
	srv.reload(lifeSite(configs[0]))
	requestClient.CloseIdleConnections()
	if keys := pooledHubKeys(); len(keys) != 1 || keys[0] != embeddedHubKey {
		t.Errorf("hub pool after the reloads: %q, want only the embedded hub", keys)
	}
	if _, live := loopsPool.References(loopsKey); live {
		t.Errorf("takeover loops live after reloading to net_http")
	}
	if n := settledRedisClients(t, rds, baseClients); n > baseClients {
		out, _ := rds.CLI("CLIENT", "LIST")
		t.Errorf("redis clients: %d after the reloads, %d before\n%s", n, baseClients, out)
	}
	if n := settleGoroutines(baseG); n > baseG {
		buf := make([]byte, 4<<20)
		t.Errorf("goroutines: %d after, %d before\nBEFORE\n%s\nAFTER\n%s", n, baseG, baseStacks, buf[:runtime.Stack(buf, true)])
	}
	deadline := time.Now().Add(waitFor)
	for openFDCount(t) > baseFD && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if n := openFDCount(t); n > baseFD {
		ents, _ := os.ReadDir("/proc/self/fd")
		var links []string
		for _, e := range ents {
			l, _ := os.Readlink("/proc/self/fd/" + e.Name())
			links = append(links, e.Name()+"->"+l)
		}
		t.Errorf("fds: %d after, %d before: %v", n, baseFD, links)
	}
}

// A stream of an sse inside route inside handle (respond fallback) is
// closed when Caddy stops, and Stop returns promptly.
func TestStopClosesNestedStream(t *testing.T) {
	site := `
:{PORT} {
	handle /x/* {
		route {
` + lifeSSE("/x/events", "") + `
		}
		respond "fallback" 404
	}
	respond "other" 404
}
`
	srv := startCaddy(t, site)
	c := srv.subscribe("/x/events?channels=a", nil)
	c.comment("ok")
	done := make(chan error, 1)
	go func() { done <- caddy.Stop() }()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("stop: %v", err)
		}
	case <-time.After(waitFor):
		t.Fatal("caddy.Stop did not return with a stream open")
	}
	for ev := c.next(); ev.Type != "server_closing"; ev = c.next() {
	}
	c.expectEnd()
}

// assertDelivers checks that the running config's /events still delivers
// a publish to a new stream.
//
// Right after a reload the stream may reach the old config on its way out
// (a connection its server accepted from the shared listener before it shut
// down), which answers it with server_closing, as documented: it is opened
// again then, as a browser would.
func assertDelivers(t *testing.T, srv *testServer, data string) {
	t.Helper()
	for attempt := 1; ; attempt++ {
		c := srv.subscribe("/events?channels=x", nil)
		c.comment("ok")
		srv.publish("/events", map[string]any{"channel": "x", "data": data})
		ev := c.next()
		if ev.Type == "server_closing" && attempt < 3 {
			continue
		}
		if ev.Data != data {
			t.Fatalf("got %+v", ev)
		}
		return
	}
}

// settledRedisClients waits, within waitFor, for rds's client count to come
// down to base, and returns it.
func settledRedisClients(t *testing.T, rds *redistest.Server, base int) int {
	t.Helper()
	for deadline := time.Now().Add(waitFor); redisClients(t, rds) > base && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
	}
	return redisClients(t, rds)
}

// A stream request that reaches a config on its way out — the old server
// still serves the connections it had when a reload began — is answered as
// that config's streams were, with server_closing inside a 200 stream, so
// that the client reconnects to the next config; a 503 would make a
// browser's EventSource give up for good. It opens as every stream does
// (clients may wait for that). The config's own Redis hub is closed by
// then.
func TestAStreamRequestToAConfigOnItsWayOutIsToldToReconnect(t *testing.T) {
	rds := redistest.Start(t)
	startCaddy(t, lifeSite(lifeSSE("/events", "")))
	h := &Handler{Channels: []string{"a"}, Redis: &RedisConfig{URL: rds.URL(), Prefix: "way-out"}}
	ctx := caddy.ActiveContext()
	ctx.Context = context.WithValue(ctx.Context, caddyhttp.ServerCtxKey, &caddyhttp.Server{})
	if err := h.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	if err := h.Cleanup(); err != nil {
		t.Fatal(err)
	}
	for _, lastEventID := range []string{"", "0-1"} {
		rec := httptest.NewRecorder()
		req := httptest.NewRequest(http.MethodGet, "/events", nil)
		if lastEventID != "" {
			req.Header.Set("Last-Event-ID", lastEventID)
		}
		req = caddyhttp.PrepareRequest(req, caddy.NewReplacer(), rec, &caddyhttp.Server{})
		served := make(chan error, 1)
		go func() {
			served <- h.ServeHTTP(rec, req, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil }))
		}()
		select {
		case <-served:
		case <-time.After(10 * time.Second):
			t.Fatalf("Last-Event-ID %q: the request is still served after 10 s", lastEventID)
		}
		body := rec.Body.String()
		if rec.Code != http.StatusOK || !strings.HasPrefix(body, ": ok\nretry: ") || !strings.Contains(body, "event: server_closing\n") {
			t.Errorf("Last-Event-ID %q: %d %q, want 200 and server_closing", lastEventID, rec.Code, body)
		}
	}
}
