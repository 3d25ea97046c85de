package caddysse

import (
	"strings"
	"testing"
)

// README, "A proxy in front": behind a Caddy reverse_proxy (here in the
// same process, on another port) a stream's preamble, events and heartbeats
// pass through as they are written, a reconnect's Last-Event-ID reaches the
// instance and gets its replay, and a reload's server_closing reaches the
// client through the proxy.
func TestBehindACaddyReverseProxy(t *testing.T) {
	sites := `
:{PORT} {
	reverse_proxy 127.0.0.1:{PORT2}
}

:{PORT2} {
	sse /events {
		channel {query.channels}
		heartbeat 300ms
		close_jitter 100ms
		publish {
			secret ` + testSecret + `
		}
	}
}
`
	srv := startCaddy(t, sites)
	c := srv.subscribe("/events?channels=a", nil) // through the proxy
	c.comment("ok")
	ids := srv.publishN("a", "e", 1, 2) // through the proxy too
	if got := c.nextData(2); got[0] != "e1" || got[1] != "e2" {
		t.Fatalf("events through the proxy: %v", got)
	}
	c.comment("heartbeat")

	resumed := srv.subscribe("/events?channels=a", header("Last-Event-ID", ids[1]))
	if got := resumed.nextData(1); got[0] != "e2" {
		t.Fatalf("the replay after Last-Event-ID %s through the proxy: %v", ids[1], got)
	}

	// the reload replaces both sites; the instance's streams are told
	// through the old proxy's connections
	srv.reload(strings.ReplaceAll(sites, "{PORT2}", strings.TrimPrefix(srv.base2, "http://127.0.0.1:")))
	for _, s := range []*sseClient{c, resumed} {
		if ev := s.next(); ev.Type != "server_closing" {
			t.Fatalf("after the reload: %+v, want server_closing through the proxy", ev)
		}
	}
}
