package caddysse

import (
	"strings"
	"testing"
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
			r := srv.subscribe(tc.path, header("Last-Event-ID", *last))
			if tr := r.resp.Header.Get("X-Replay-Truncated"); tr != "" {
				t.Fatalf("reconnect told truncated (%s)", tr)
			}
			srv.publish("/events", map[string]any{"channel": "a", "data": "after"})
			if got := strings.Join(r.nextData(2), " "); got != "meanwhile after" {
				t.Fatalf("after the reload got %q, want %q", got, "meanwhile after")
			}
		})
	}
}
