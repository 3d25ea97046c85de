package caddysse

import (
	"net/url"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// A stream whose history Redis answers with an error (not an outage: Redis
// is up and says no; here the channel's stream key holds a string, so
// reading it is WRONGTYPE) is refused 503 history_unavailable with
// Retry-After: 1 (README, "Status codes"), or, with `rejections in_stream`,
// told so in a 200 stream with retry: 1000 after its own cursor said back.
// Either way the refused stream gives back what it held (with
// max_connections 1, a stream opens after the refusals), and the operator
// is told at warn level, with Redis' answer, which the subscriber is not.
func TestRedisHistoryReadErrorRefusesTheStream(t *testing.T) {
	for _, mode := range []string{"status", "in_stream"} {
		t.Run(mode, func(t *testing.T) {
			rds := redistest.Start(t)
			logFile := filepath.Join(t.TempDir(), "sse.log")
			srv := startCaddy(t, redisSite(rds.URL(), "max_connections 1", "rejections "+mode), sseLog(logFile))
			ids := srv.publishN("a", "e", 1, 2)
			rds.MustCLI("DEL", "sse:{a}:s")
			rds.MustCLI("SET", "sse:{a}:s", "not a stream")

			// from the first event: the second must be read from the history
			path := "/events?channels=a&lastEventID=" + url.QueryEscape(ids[1])
			for range 2 {
				got := srv.getRefusal(path)
				want := refusal{status: 503, code: "history_unavailable", retryAfter: 1, retryMs: -1}
				if mode == "in_stream" {
					want.status, want.retryMs, want.id = 200, 1000, ids[1]
				}
				if got.status != want.status || got.code != want.code || got.retryAfter != want.retryAfter ||
					got.retryMs != want.retryMs || got.id != want.id {
					t.Fatalf("got %+v, want %+v", got, want)
				}
				if strings.Contains(got.detail, "WRONGTYPE") {
					t.Fatalf("the refusal tells the subscriber Redis' reply: %q", got.detail)
				}
			}
			c := srv.subscribe("/events?channels=b", nil)
			c.comment("ok")
			srv.publish("/events", map[string]any{"channel": "b", "data": "after the refusals"})
			if ev := c.next(); ev.Data != "after the refusals" {
				t.Fatalf("got %+v", ev)
			}
			if line := logLine(t, logFile, "history unavailable", "WRONGTYPE"); !strings.Contains(line, `"level":"warn"`) {
				t.Fatalf("the refusals were not logged at warn level with Redis' answer:\n%s", readFile(t, logFile))
			}
		})
	}
}
