package caddysse

import (
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// Streams across a Redis outage or a lost history: what opened degraded,
// or at a head the history then lost, gets every event published after it
// opened.

// dataUpTo returns the data of the events up to and including the first whose
// data is last.
func (c *sseClient) dataUpTo(last string) []string {
	c.t.Helper()
	var got []string
	for {
		ev := c.next()
		got = append(got, ev.Data)
		if ev.Data == last {
			return got
		}
	}
}

// A stream opened while Redis is down, without a cursor ("live from now"),
// gets the events published after it opened, once Redis is back — also
// those its recovery finds in the head it reads (the event that wakes it is
// one: it was once dropped as covered), and those published before this
// instance was subscribed again.
func TestDegradedStreamWithoutCursorGetsTheEventsAfterTheOutage(t *testing.T) {
	rds := redistest.Start(t)
	rds.Kill()
	// heartbeat 1m: the registry's sweep (which also pokes degraded streams)
	// runs every 7.5 s, so it does not decide the outcome
	srv := startCaddy(t, redisSite(rds.URL(), "heartbeat 1m"))
	degradedStreamGetsWhatFollows(t, srv, rds)
}

// degradedStreamGetsWhatFollows opens a stream while rds is down, restarts
// rds, and checks that the stream gets the first two events published then.
func degradedStreamGetsWhatFollows(t *testing.T, srv *testServer, rds *redistest.Server) {
	t.Helper()
	c := srv.subscribe("/events?channels=a", nil)
	if ev := c.next(); ev.Type != "sse_degraded" {
		t.Fatalf("got %+v, want sse_degraded", ev)
	}
	rds.Restart()
	srv.publishWhileRefused("a", "first")
	srv.publish("/events", map[string]any{"channel": "a", "data": "second"})
	if got := c.dataUpTo("second"); fmt.Sprint(got) != "[first second]" {
		t.Fatalf("the degraded stream got %q, want [first second]", got)
	}
}

// Same with Caddy up before the outage (the channel's watch is known): a
// stream that opens degraded without a cursor gets the first event
// published once Redis is back.
func TestDegradedStreamAfterARestartGetsTheFirstEvent(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, redisSite(rds.URL(), "heartbeat 1m"))
	old := srv.subscribe("/events?channels=a", nil)
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	srv.publish("/events", map[string]any{"channel": "a", "data": "before"})
	old.next()
	rds.Kill()
	// this instance learns that Redis is down (a publish answers 503)
	if status, _ := srv.post("/events", "application/json", mustJSON(t, map[string]any{"channel": "a", "data": "x"}), nil); status != http.StatusServiceUnavailable {
		t.Fatalf("publish with Redis down: %d", status)
	}
	degradedStreamGetsWhatFollows(t, srv, rds)
}

// After the history of a channel is lost while this instance keeps its
// subscription (FLUSHALL, a key evicted by maxmemory or expired), a stream
// that opens without a cursor starts at the head the watch remembers (from
// the lost epoch) until the next full check (check_interval, default 5 s).
// The first event of the new epoch does not follow that position; the
// stream, which has written nothing there, starts over from the new epoch
// instead of ending (it once ended, and its client, without a
// Last-Event-ID, never saw the event).
func TestFreshStreamAfterLostHistoryGetsTheNewEpoch(t *testing.T) {
	for _, tc := range []struct {
		name string
		lose []string
	}{
		{"flushall", []string{"FLUSHALL"}},
		{"hash evicted", []string{"DEL", "sse:{a}:m"}},
		{"stream evicted", []string{"DEL", "sse:{a}:s"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rds := redistest.Start(t)
			// the default check_interval (5 s)
			srv := startCaddy(t, redisBlockSite("url "+rds.URL()+"\n\t\t\tdial_timeout 300ms\n\t\t\tmax_retries -1"))
			old := srv.subscribe("/events?channels=a", nil)
			rds.WaitShardSubscribers(t, "sse:{a}", 1)
			srv.publishN("a", "e", 1, 3)
			old.nextData(3)

			rds.MustCLI(tc.lose...)
			fresh := srv.subscribe("/events?channels=a", nil)
			fresh.comment("ok") // its starting point is read
			srv.publish("/events", map[string]any{"channel": "a", "data": "new epoch 1"})
			if ev := fresh.next(); ev.Data != "new epoch 1" {
				t.Fatalf("fresh stream got %+v", ev)
			}
		})
	}
}

// A stream that opens degraded with a Last-Event-ID is counted once in
// caddy_sse_replays_total, when it replays once Redis is back — not also
// when it opens.
func TestDegradedReplayIsCountedOnce(t *testing.T) {
	rds := redistest.Start(t)
	site := strings.Replace(redisSite(rds.URL(), "heartbeat 200ms"), ":{PORT} {", ":{PORT} {\n\tmetrics /metrics", 1)
	srv := startCaddy(t, site)
	ids := srv.publishN("a", "e", 1, 2)
	rds.Kill()
	before := metric(t, srv.scrape(), "caddy_sse_replays_total")
	c := srv.subscribe("/events?channels=a", header("Last-Event-ID", ids[1]))
	if ev := c.next(); ev.Type != "sse_degraded" {
		t.Fatalf("got %+v, want sse_degraded", ev)
	}
	// a Redis restart without persistence: the replay is truncated
	rds.Restart()
	srv.publishWhileRefused("a", "new")
	assertTruncatedEvent(t, c.next(), "a")
	if ev := c.next(); ev.Data != "new" {
		t.Fatalf("got %+v", ev)
	}
	scrape := srv.scrape()
	if got := metric(t, scrape, "caddy_sse_replays_total") - before; got != 1 {
		t.Errorf("one stream with a Last-Event-ID counted %v times in caddy_sse_replays_total", got)
	}
	if got := metric(t, scrape, "caddy_sse_replays_truncated_total"); got != 1 {
		t.Errorf("caddy_sse_replays_truncated_total = %v, want 1", got)
	}
}

// A fresh stream (no cursor) starts live: no replay (SPEC S4). The first
// stream of an instance on a Redis channel makes the watcher's first sync
// deliver the channel's newest event, which the head the stream started at
// counts: it is dropped, not written.
func TestFreshRedisStreamGetsNoOldEvent(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, redisSite(rds.URL()))
	// history on the channel before this instance watches it
	srv.publishN("a", "old", 1, 3)
	c := srv.subscribe("/events?channels=a", nil)
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	srv.publishN("a", "new", 1, 1)
	if got := c.next().Data; got != "new1" {
		t.Fatalf("a stream without a cursor got %q first (want new1: no replay)", got)
	}
}
