package caddysse

import (
	"fmt"
	"testing"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// A client that saw channel b empty, was away while b's first event was
// published, and comes back after Redis lost it (flushed, restarted without
// persistence, a failover that lost the write) is told b was truncated. Its
// id held b as "before the first event" with nothing naming the history it
// saw empty, and was replayed b's new history as if it were all there was.
func TestRedisCursorOfAnEmptyChannelIsTruncatedWhenTheHistoryIsLost(t *testing.T) {
	for name, lose := range map[string]func(*redistest.Server){
		"flush": func(rds *redistest.Server) { rds.MustCLI("FLUSHALL") },
		"restart without persistence": func(rds *redistest.Server) {
			rds.Kill()
			rds.Restart()
		},
	} {
		t.Run(name, func(t *testing.T) {
			rds := redistest.Start(t)
			srv := startCaddy(t, redisSite(rds.URL()))
			id := idHoldingBEmpty(t, srv, func() { rds.WaitShardSubscribers(t, "sse:{a}", 1) })
			srv.publish("/events", map[string]any{"channel": "b", "data": "lost"})
			lose(rds)
			publishUntilAccepted(t, srv, "b", "new")
			r := srv.subscribe("/events?channels=a,b", header("Last-Event-ID", id))
			if r.resp.Header.Get("X-Replay-Truncated") != "true" {
				t.Fatal("missing X-Replay-Truncated: true")
			}
			assertTruncatedEvent(t, r.next(), "a", "b")
			if got := r.nextData(1); fmt.Sprint(got) != "[new]" {
				t.Fatalf("after the truncation: %v", got)
			}
		})
	}
}

// The same client whose channel's history is all there is replayed it from
// its first event, and is told nothing was truncated.
func TestRedisCursorOfAnEmptyChannelReplaysItsFirstEvents(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, redisSite(rds.URL()))
	id := idHoldingBEmpty(t, srv, func() { rds.WaitShardSubscribers(t, "sse:{a}", 1) })
	srv.publishN("b", "b", 1, 2)
	r := srv.subscribe("/events?channels=a,b", header("Last-Event-ID", id))
	if h := r.resp.Header.Get("X-Replay-Truncated"); h != "" {
		t.Fatalf("X-Replay-Truncated: %q, want none", h)
	}
	if got := r.nextData(2); fmt.Sprint(got) != "[b1 b2]" {
		t.Fatalf("replayed %v", got)
	}
}
