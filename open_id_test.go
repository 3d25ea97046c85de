package caddysse

import (
	"strings"
	"testing"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// A stream that opened degraded (Redis down) gives no id at its opening:
// it does not know its positions. Once Redis is back it knows them, and
// until it writes an event it is a stream at its start like any other: cut
// then (a load balancer, a network change), it must resume where it
// recovered, not live — its client, which came without a cursor, has no
// id to send, and the events published while it reconnected would be lost.
func TestRecoveredDegradedStreamCutBeforeItsFirstEventResumes(t *testing.T) {
	rds := redistest.Start(t)
	rds.Kill()
	// heartbeat 200ms: the degraded stream tries to recover at each
	srv := startCaddy(t, redisSite(rds.URL(), "heartbeat 200ms"))
	c := srv.subscribe("/events?channels=a", nil)
	if ev := c.next(); ev.Type != "sse_degraded" {
		t.Fatalf("got %+v, want sse_degraded", ev)
	}
	if id := c.lastSeenID.Load(); id != nil && *id != "" {
		t.Fatalf("a degraded stream gave the id %q at its opening", *id)
	}
	rds.Restart()
	eventually(t, "an id once the degraded stream recovered", func() bool {
		id := c.lastSeenID.Load()
		return id != nil && *id != ""
	})
	last := *c.lastSeenID.Load()
	c.close()
	srv.publishWhileRefused("a", "meanwhile")
	r := srv.subscribe("/events?channels=a", header("Last-Event-ID", last))
	if tr := r.resp.Header.Get("X-Replay-Truncated"); tr != "" {
		t.Fatalf("reconnect told truncated (%s)", tr)
	}
	srv.publish("/events", map[string]any{"channel": "a", "data": "after"})
	if got := strings.Join(r.nextData(2), " "); got != "meanwhile after" {
		t.Fatalf("after the cut got %q, want %q", got, "meanwhile after")
	}
}
