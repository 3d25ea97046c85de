package caddysse

import (
	"net/http"
	"strings"
	"testing"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// A stream told server_closing before it wrote any event still resumes
// without a loss: the closing says its cursor in an id-only block first, so
// the reconnect replays what was published while it waited instead of
// starting live (it had no id to send). Fresh streams on one and on two
// channels (one of them published to before), and a reconnected stream
// that got nothing since.
func TestStreamWithoutEventsResumesAfterReload(t *testing.T) {
	site := `
:{PORT} {
	sse /events {
		channel {query.channels}
		close_jitter off
		publish {
			secret ` + testSecret + `
		}
	}
}
`
	for _, tc := range []struct{ name, path string }{
		{"fresh", "/events?channels=a"},
		{"fresh, two channels", "/events?channels=a,b"},
		{"reconnected", "/events?channels=a"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := startCaddy(t, site)
			var hdr map[string][]string
			switch tc.name {
			case "reconnected":
				id := srv.publish("/events", map[string]any{"channel": "a", "data": "seen"})["a"]
				hdr = header("Last-Event-ID", id)
			case "fresh, two channels":
				srv.publish("/events", map[string]any{"channel": "b", "data": "before"})
			}
			c := srv.subscribe(tc.path, hdr)
			c.comment("ok")
			srv.reload(site)
			if ev := c.next(); ev.Type != "server_closing" {
				t.Fatalf("got %+v, want server_closing", ev)
			}
			c.expectEnd()
			last := c.lastSeenID.Load()
			if last == nil || *last == "" {
				t.Fatal("the stream gave no id: its reconnect starts live and misses what is published before it")
			}
			srv.publish("/events", map[string]any{"channel": "a", "data": "meanwhile"})
			r := srv.resume(t, tc.path, *last)
			srv.publish("/events", map[string]any{"channel": "a", "data": "after"})
			if got := strings.Join(r.nextData(2), " "); got != "meanwhile after" {
				t.Fatalf("after the reload got %q, want %q", got, "meanwhile after")
			}
		})
	}
}

// A stream cut before it wrote any event (a load balancer, a network
// change: no server_closing) still resumes without a loss: its opening
// block gives its cursor as the id, so the reconnect replays what was
// published while it was away instead of starting live. The same id keeps a
// client's position under the letter of the WHATWG standard, whose last
// event ID buffer starts empty on each connection (the opening blank line
// would set it to ""). Fresh streams on one and two channels, a reconnected
// one, one whose cursor did not parse (told truncated), embedded and Redis.
func TestStreamCutBeforeItsFirstEventResumes(t *testing.T) {
	for _, mode := range []string{"embedded", "redis"} {
		for _, tc := range []struct{ name, path, lastID, channel string }{
			{"fresh", "/events?channels=a", "", "a"},
			{"fresh, two channels", "/events?channels=a,b", "", "a"},
			{"fresh, a channel without events", "/events?channels=z,a", "", "z"},
			{"reconnected", "/events?channels=a", "published", "a"},
			{"garbage cursor", "/events?channels=a", "!!garbage", "a"},
		} {
			t.Run(mode+", "+tc.name, func(t *testing.T) {
				site := hammerSite()
				if mode == "redis" {
					site = redisSite(redistest.Start(t).URL())
				}
				srv := startCaddy(t, site)
				srv.publish("/events", map[string]any{"channel": []string{"a", "b"}, "data": "before"})
				var hdr http.Header
				switch tc.lastID {
				case "published":
					hdr = header("Last-Event-ID", srv.publish("/events", map[string]any{"channel": "a", "data": "seen"})["a"])
				case "":
				default:
					hdr = header("Last-Event-ID", tc.lastID)
				}
				c := srv.subscribe(tc.path, hdr)
				c.comment("ok")
				if tc.lastID == "!!garbage" {
					assertTruncatedEvent(t, c.next(), "a")
				}
				last := givenID(t, c, "an id before the stream's first event")
				if tc.lastID == "published" && last != hdr.Get("Last-Event-ID") {
					t.Fatalf("opening id %q, want the client's own %q", last, hdr.Get("Last-Event-ID"))
				}
				c.close()
				srv.publish("/events", map[string]any{"channel": tc.channel, "data": "meanwhile"})
				r := srv.resume(t, tc.path, last)
				srv.publish("/events", map[string]any{"channel": tc.channel, "data": "after"})
				if got := strings.Join(r.nextData(2), " "); got != "meanwhile after" {
					t.Fatalf("after the cut got %q, want %q", got, "meanwhile after")
				}
			})
		}
	}
}

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
	last := givenID(t, c, "an id once the degraded stream recovered")
	c.close()
	srv.publishWhileRefused("a", "meanwhile")
	r := srv.resume(t, "/events?channels=a", last)
	srv.publish("/events", map[string]any{"channel": "a", "data": "after"})
	if got := strings.Join(r.nextData(2), " "); got != "meanwhile after" {
		t.Fatalf("after the cut got %q, want %q", got, "meanwhile after")
	}
}

// A stream whose Redis user is refused some of its channels (an ACL) opens
// degraded in part: the granted channels start at their heads, as any
// stream's. Cut before its first event, it must resume them where they
// started, not live — it gave no id, and the events published to them
// while its client reconnected were lost.
func TestStreamDegradedInPartCutBeforeItsFirstEventResumes(t *testing.T) {
	rds := redistest.Start(t)
	rds.MustCLI("ACL", "SETUSER", "app", "on", ">pw", "~sse:*", "+@all", "resetchannels",
		"&sse:{a}", "&sse:{sse,throttles}")
	srv := startACLCaddy(t, aclSite(rds))
	srv.publish("/events", map[string]any{"channel": "a", "data": "before"})
	c := srv.subscribe("/events?channels=a,b", nil)
	if ev := c.next(); ev.Type != "sse_degraded" {
		t.Fatalf("first event %+v, want sse_degraded", ev)
	}
	last := givenID(t, c, "an id before the stream's first event")
	c.close()
	srv.publish("/events", map[string]any{"channel": "a", "data": "meanwhile"})
	r := srv.resume(t, "/events?channels=a,b", last)
	if ev := r.next(); ev.Type != "sse_degraded" {
		t.Fatalf("first event after the cut %+v, want sse_degraded (b is still refused)", ev)
	}
	if ev := r.next(); ev.Data != "meanwhile" {
		t.Fatalf("after the cut got %+v, want what was published to a meanwhile", ev)
	}
}

// givenID waits until c's client holds a Last-Event-ID (what) and returns it.
func givenID(t *testing.T, c *sseClient, what string) string {
	t.Helper()
	eventually(t, what, func() bool {
		id := c.lastSeenID.Load()
		return id != nil && *id != ""
	})
	return *c.lastSeenID.Load()
}

// resume opens path again with Last-Event-ID id, failing the test if the
// replay is truncated: a stream that resumes where it was missed nothing.
func (s *testServer) resume(t *testing.T, path, id string) *sseClient {
	t.Helper()
	r := s.subscribe(path, header("Last-Event-ID", id))
	if tr := r.resp.Header.Get("X-Replay-Truncated"); tr != "" {
		t.Fatalf("reconnect with %q told truncated (%s)", id, tr)
	}
	return r
}
