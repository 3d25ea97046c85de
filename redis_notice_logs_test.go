package caddysse

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// Whoever may publish on the prefix's shard channels (a backend's Redis
// user publishing directly, wrongly) can send any number of malformed
// announcements: each was logged at warn, 500 of them 500 lines. They are
// logged at warn once a minute, the others at debug level.
func TestMalformedAnnouncementsAreWarnedOfRarely(t *testing.T) {
	rds := redistest.Start(t)
	file := filepath.Join(t.TempDir(), "sse.log")
	srv := startCaddy(t, redisSite(rds.URL()), sseLog(file))
	c := openCountedStream(t, srv, rds, "a", nil)
	rds.MustCLI("EVAL", "for i=1,200 do redis.call('SPUBLISH', KEYS[1], 'garbage') end return 1", "1", "sse:{a}")
	srv.publish("/events", map[string]any{"channel": "a", "data": "after"})
	if ev := c.next(); ev.Data != "after" {
		t.Fatalf("event after the malformed announcements: %+v", ev)
	}
	time.Sleep(100 * time.Millisecond)
	b, _ := os.ReadFile(file)
	if n := strings.Count(string(b), "malformed announcement on a shard channel"); n != 1 {
		t.Fatalf("200 malformed announcements logged %d times at warn level, want once", n)
	}
}
