package e2e

import (
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/internal/waitfor"
)

// TestBrowserThroughARedisOutageAndAReload: Chromium's EventSource on an
// instance whose Redis dies. A reload while Redis is down tells the page
// server_closing; the EventSource comes back by itself with its
// Last-Event-ID and is opened with sse_degraded — a 200 stream, so it does
// not give up. Redis comes back with its history (an append-only file), and
// the page gets the event published then: not told sse_truncated, and not
// given the earlier event again.
func TestBrowserThroughARedisOutageAndAReload(t *testing.T) {
	w := startBrowser(t)
	rds := redistest.Start(t, "--appendonly", "yes", "--appendfsync", "always")
	redisBlock := "redis {\n\t\t\turl " + rds.URL() + "\n\t\t\tcheck_interval 500ms\n\t\t}"
	site := startBrowserSite(t, browserPageDir(t), redisBlock)
	base, accessLog := site.base, site.accessLog
	pub := h1Client(t, false)
	got := func(pred func(pageRecord) bool) func([]pageRecord) bool {
		return func(rs []pageRecord) bool { return tagged(rs, "s0", pred) > 0 }
	}
	data := func(d string) func(pageRecord) bool { return func(r pageRecord) bool { return r.Data == d } }
	typed := func(t string) func(pageRecord) bool { return func(r pageRecord) bool { return r.Type == t } }

	w.navigate(pageURL(base, "/events?channels=news"))
	w.waitPage(time.Now().Add(waitFor), "the stream open", got(func(r pageRecord) bool { return r.K == "open" }))
	publishEvent(t, pub, base+"/events", "news", "", "before")
	w.waitPage(time.Now().Add(waitFor), "the event published before the outage", got(data("before")))

	rds.Kill()
	site.proc.writeConfig(site.caddyfile(redisBlock + "\n\t\tretry 2s")) // another config, so that the reload is one
	site.proc.reload()
	w.waitPage(time.Now().Add(waitFor), "sse_degraded on the stream reopened while Redis is down", got(typed("sse_degraded")))

	rds.Restart()
	publishUntilAccepted(t, pub, base+"/events", "news", "after")
	rs := w.waitPage(time.Now().Add(waitFor), "the event published once Redis was back", got(data("after")))
	for _, c := range []struct {
		what string
		pred func(pageRecord) bool
		want int
	}{
		{"server_closing", typed("server_closing"), 1},
		{"the event published before the outage", data("before"), 1},
		{"the event published after it", data("after"), 1},
		{"sse_truncated", typed("sse_truncated"), 0},
		{"errors with readyState CLOSED (the EventSource gave up)", func(r pageRecord) bool { return r.K == "error" && r.RS == 2 }, 0},
	} {
		if n := tagged(rs, "s0", c.pred); n != c.want {
			t.Errorf("%s: %d, want %d; the page recorded:\n%s", c.what, n, c.want, formatRecords(rs))
		}
	}
	// the access log has a request once it ended: close the page's stream
	w.script("window.sources.s0.close()")
	var ids []string
	waitfor.Until(t, "the reopened stream's request in the access log", waitFor, 50*time.Millisecond, func() bool {
		ids = streamRequests(t, accessLog, "/events?channels=news")
		return len(ids) == 2
	})
	// the id the browser came back with: the last one it saw before
	var lastSeen string
	for _, r := range rs {
		if r.Type == "sse_degraded" {
			break
		}
		if r.ID != "" {
			lastSeen = r.ID
		}
	}
	if ids[0] != "" || lastSeen == "" || ids[1] != lastSeen {
		t.Errorf("the stream's requests carried Last-Event-ID %q, want none and then %q, the last id the page saw", ids, lastSeen)
	}
}
