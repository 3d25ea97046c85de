package e2e

import (
	"fmt"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"
)

const (
	testSecret = "test-secret"
	// closeJitter is the close_jitter of the test configs: server_closing
	// must carry a retry within it.
	closeJitter = 2 * time.Second
	// waitFor bounds every wait for an event or the end of a stream.
	waitFor = 10 * time.Second
)

// plainSite is an HTTP/1.1 site with one sse route whose channels come
// from the query string. No grace_period: Caddy's default eternal grace
// period is what must work.
func plainSite(adminPort, port int) string {
	return fmt.Sprintf(`{
	admin 127.0.0.1:%d
	auto_https off
}

http://:%d {
	sse /events {
		channel {query.channels}
		close_jitter 2s
		publish {
			secret %s
		}
	}
}
`, adminPort, port, testSecret)
}

// plainServer starts caddy on plainSite and returns it with the stream
// URL (channel news) and the publish URL.
func plainServer(t *testing.T) (p *caddyProc, streamURL, publishURL string) {
	t.Helper()
	adminPort, port := freePort(t, false), freePort(t, false)
	p = startCaddy(t, fmt.Sprintf("127.0.0.1:%d", adminPort), plainSite(adminPort, port))
	base := fmt.Sprintf("http://127.0.0.1:%d/events", port)
	return p, base + "?channels=news", base
}

// openStreams opens n HTTP/1.1 streams on url and checks their preamble:
// a comment line first, then retry: 3000 (the default retry).
func openStreams(t *testing.T, client *http.Client, url string, n int) []*sseConn {
	t.Helper()
	streams := make([]*sseConn, n)
	for i := range streams {
		c := openStream(t, client, url, "")
		if c.resp.ProtoMajor != 1 || c.resp.ProtoMinor != 1 {
			t.Fatalf("stream %d: protocol %s, want HTTP/1.1", i, c.resp.Proto)
		}
		checkPreamble(t, c)
		streams[i] = c
	}
	return streams
}

func checkPreamble(t *testing.T, c *sseConn) {
	t.Helper()
	if !strings.HasPrefix(c.firstLine, ":") {
		t.Fatalf("stream's first line is %q, want a comment", c.firstLine)
	}
	if c.openRetry != 3000 {
		t.Fatalf("stream's preamble set retry %d ms, want 3000", c.openRetry)
	}
	if h := c.resp.Header.Get("Cache-Control"); !strings.Contains(h, "no-transform") {
		t.Fatalf("Cache-Control %q, want no-transform", h)
	}
}

// TestReloadClosesStreamsAndResumes: a reload (`caddy reload --force`)
// returns promptly although streams are open, tells every stream
// server_closing with reason reload and a retry within close_jitter, ends
// them, and keeps the hub and its history: every client that reconnects
// with its Last-Event-ID gets exactly the events published while it was
// away, then live events.
func TestReloadClosesStreamsAndResumes(t *testing.T) {
	p, streamURL, publishURL := plainServer(t)
	client, pub := h1Client(t, true), h1Client(t, false)

	streams := openStreams(t, client, streamURL, 20)

	var lastPublished string
	for _, data := range []string{"n1", "n2", "n3"} {
		lastPublished = publish(t, pub, publishURL, testSecret, "news", data)
	}
	deadline := time.Now().Add(waitFor)
	forAll(t, streams, func(_ int, c *sseConn) error {
		return c.expectData(deadline, "n1", "n2", "n3")
	})

	took := p.reload()
	t.Logf("caddy reload returned in %s with %d open streams", took.Round(time.Millisecond), len(streams))

	retries := make([]int, len(streams))
	deadline = time.Now().Add(waitFor)
	forAll(t, streams, func(i int, c *sseConn) error {
		r, err := c.expectClosing(deadline, "reload", closeJitter)
		if err != nil {
			return err
		}
		retries[i] = r
		return c.expectEnd(deadline)
	})
	if allEqual(retries) {
		t.Errorf("all %d streams got the same retry %d ms: close_jitter should spread reconnections", len(retries), retries[0])
	}

	// published while every client is away
	missed := []string{"m1", "m2", "m3", "m4", "m5"}
	for _, data := range missed {
		publish(t, pub, publishURL, testSecret, "news", data)
	}

	// every client comes back with its Last-Event-ID; one more comes back
	// with the id a publish returned (SPEC S4: valid as a Last-Event-ID)
	back := make([]*sseConn, 0, len(streams)+1)
	for i, c := range streams {
		id := c.lastEventID()
		if id == "" {
			t.Fatalf("stream %d has no last event id", i)
		}
		back = append(back, openStream(t, client, streamURL, id))
	}
	back = append(back, openStream(t, client, streamURL, lastPublished))
	for i, c := range back {
		checkPreamble(t, c)
		if h := c.resp.Header.Get("X-Replay-Truncated"); h != "" {
			t.Fatalf("reconnected stream %d: X-Replay-Truncated: %s, want none", i, h)
		}
	}
	deadline = time.Now().Add(waitFor)
	forAll(t, back, func(_ int, c *sseConn) error {
		// exactly the missed events, in order: no sse_truncated first, and
		// nothing seen before the reload again
		return c.expectData(deadline, missed...)
	})

	// then live: the next event is the new one (no duplicate in between)
	publish(t, pub, publishURL, testSecret, "news", "live1")
	deadline = time.Now().Add(waitFor)
	forAll(t, back, func(_ int, c *sseConn) error {
		return c.expectData(deadline, "live1")
	})
}

// TestReloadReturnsWithManyStreams: with 200 open streams, `caddy reload`
// returns within 10 s and every stream is told server_closing and ends.
func TestReloadReturnsWithManyStreams(t *testing.T) {
	p, streamURL, publishURL := plainServer(t)
	client, pub := h1Client(t, true), h1Client(t, false)

	streams := openStreams(t, client, streamURL, 200)
	publish(t, pub, publishURL, testSecret, "news", "before")
	deadline := time.Now().Add(waitFor)
	forAll(t, streams, func(_ int, c *sseConn) error {
		return c.expectData(deadline, "before")
	})

	took := p.reload()
	t.Logf("caddy reload returned in %s with %d open streams", took.Round(time.Millisecond), len(streams))

	deadline = time.Now().Add(waitFor)
	forAll(t, streams, func(_ int, c *sseConn) error {
		if _, err := c.expectClosing(deadline, "reload", closeJitter); err != nil {
			return err
		}
		return c.expectEnd(deadline)
	})

	// the new config serves
	c := openStream(t, client, streamURL, "")
	publish(t, pub, publishURL, testSecret, "news", "after")
	if err := c.expectData(time.Now().Add(waitFor), "after"); err != nil {
		t.Fatalf("stream opened after the reload: %v", err)
	}
}

func allEqual(xs []int) bool {
	for _, x := range xs {
		if x != xs[0] {
			return false
		}
	}
	return true
}

// TestFailedReloadKeepsStreams: a reload to a config that fails to load
// (here: the publish secret is an unset environment variable, refused at
// provision) is refused, and the running config's streams stay open and
// keep receiving events; a good reload afterwards still closes them.
func TestFailedReloadKeepsStreams(t *testing.T) {
	p, streamURL, publishURL := plainServer(t)
	client, pub := h1Client(t, true), h1Client(t, false)
	streams := openStreams(t, client, streamURL, 5)

	good, err := os.ReadFile(p.config)
	if err != nil {
		t.Fatal(err)
	}
	const unset = "CADDY_SSE_E2E_SURELY_UNSET_SECRET"
	if _, set := os.LookupEnv(unset); set {
		t.Fatalf("%s must not be set", unset)
	}
	bad := strings.Replace(string(good), "secret "+testSecret, "secret {env."+unset+"}", 1)
	if bad == string(good) {
		t.Fatal("could not make the bad config")
	}
	p.writeConfig(bad)
	took, out, err := p.tryCLI(10*time.Second, p.reloadArgs()...)
	if err == nil {
		t.Fatalf("reload to a config with an empty publish secret succeeded after %s, want it refused:\n%s", took, out)
	}
	if !strings.Contains(out, "secret") {
		t.Errorf("the refused reload does not say why (no mention of the secret):\n%s", out)
	}

	// the streams are still open and still live on the running config
	publish(t, pub, publishURL, testSecret, "news", "still-here")
	deadline := time.Now().Add(waitFor)
	forAll(t, streams, func(_ int, c *sseConn) error { return c.expectData(deadline, "still-here") })

	p.writeConfig(string(good))
	p.reload()
	deadline = time.Now().Add(waitFor)
	forAll(t, streams, func(_ int, c *sseConn) error {
		if _, err := c.expectClosing(deadline, "reload", closeJitter); err != nil {
			return err
		}
		return c.expectEnd(deadline)
	})
}
