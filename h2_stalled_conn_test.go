package caddysse

import (
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/h2stall"
)

// dialH2TCPStalled opens an h2c stream of path on a connection it then
// never reads (h2stall).
func dialH2TCPStalled(t *testing.T, addr, path string) net.Conn {
	t.Helper()
	conn, err := h2stall.Dialer().Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	h2stall.OpenStream(t, conn, "http", "x", path)
	return conn
}

// An HTTP/2 client that stops reading its connection (TCP, not flow
// control: the reset a passed write deadline sends never goes out) is
// still ended: after slow_client_timeout as a slow client (counted and
// throttled), or within about lastWordsTimeout on a reload. Its stream
// used to stay open for ever — no cut, and a stop that waits for it never
// ended (e2e: a SIGTERM did not exit). A stream on another connection
// gets every event meanwhile.
func TestTCPStalledH2ConnectionIsEnded(t *testing.T) {
	site := `
:{PORT} {
	metrics /metrics
	sse /events {
		channel {query.channels}
		slow_client_timeout SLOW
		throttle 30s
		heartbeat 5s
		close_jitter off
		max_event_size 256KiB
		history_bytes 256MiB
		publish {
			secret ` + testSecret + `
		}
	}
}
`
	for _, tc := range []struct{ name, slow string }{{"slow client", "1s"}, {"reload", "30s"}} {
		t.Run(tc.name, func(t *testing.T) {
			site := strings.ReplaceAll(site, "SLOW", tc.slow)
			srv := startCaddy(t, site, h2cGlobals)
			before := metric(t, srv.scrape(), "caddy_sse_slow_client_disconnects_total")
			healthy := openStream(t, srv.base+"/events?channels=a", nil, h2cClient())
			healthy.comment("ok")
			_ = dialH2TCPStalled(t, "127.0.0.1:"+itoa(srv.port), "/events?channels=a")
			eventually(t, "two streams", func() bool { return metric(t, srv.scrape(), "caddy_sse_streams_open") == 2 })
			payload := strings.Repeat("s", 200<<10)
			for i := range 60 { // 12 MB: more than the sockets' buffers hold
				srv.publish("/events", map[string]any{"channel": "a", "data": itoa(i) + payload})
				if ev := healthy.next(); !strings.HasPrefix(ev.Data, itoa(i)+"s") {
					t.Fatalf("the healthy stream got %.20q, want event %d", ev.Data, i)
				}
			}
			began := time.Now()
			want := 1.0
			if tc.name == "reload" {
				srv.reload(site, h2cGlobals)
				if ev := healthy.next(); ev.Type != "server_closing" {
					t.Fatalf("the healthy stream got %+v", ev)
				}
				healthy.expectEnd()
				want = 0
			}
			deadline := began.Add(6 * time.Second)
			for metric(t, srv.scrape(), "caddy_sse_streams_open") != want {
				if time.Now().After(deadline) {
					t.Fatalf("the stalled HTTP/2 stream is still open %s after the stall", time.Since(began).Round(time.Millisecond))
				}
				time.Sleep(50 * time.Millisecond)
			}
			t.Logf("ended %s after the stall", time.Since(began).Round(time.Millisecond))
			if tc.name == "reload" {
				return
			}
			if got := metric(t, srv.scrape(), "caddy_sse_slow_client_disconnects_total") - before; got != 1 {
				t.Errorf("slow client disconnects went up by %v, want 1", got)
			}
			resp, err := http.Get(srv.base + "/events?channels=a")
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusTooManyRequests {
				t.Errorf("the stalled client's address reconnects with %d, want 429 (throttled)", resp.StatusCode)
			}
			srv.publish("/events", map[string]any{"channel": "a", "data": "after"})
			if ev := healthy.next(); ev.Data != "after" {
				t.Fatalf("the healthy stream got %+v", ev)
			}
		})
	}
}
