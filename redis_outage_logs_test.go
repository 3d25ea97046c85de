package caddysse

import (
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// While Redis is down every stream that opens and every publish meets it.
// Their warnings were logged each time (three per stream with a cap and
// throttling, one per publish): 200 streams and 200 publishes made 600
// warnings in 2.3 s, a flood growing with the traffic. Each is logged at
// warn level once per warnEvery while it lasts, the others at debug level.
func TestRedisOutageWarningsAreRateLimited(t *testing.T) {
	rds := redistest.Start(t)
	file := filepath.Join(t.TempDir(), "sse.log")
	srv := startCaddy(t, redisSite(rds.URL(), "principal {query.u}", "max_connections_per_principal 50"), sseLog(file))
	srv.subscribe("/events?channels=a&u=p", nil).comment("ok")
	rds.Kill()
	eventually(t, "redis to be logged unreachable", func() bool {
		b, _ := os.ReadFile(file)
		return strings.Contains(string(b), "redis is unreachable")
	})
	for i := 0; i < 20; i++ {
		c := openStream(t, srv.base+"/events?channels=a&u=q", nil, nil)
		if ev := c.next(); ev.Type != "sse_degraded" {
			t.Fatalf("stream %d: first event %+v, want sse_degraded", i, ev)
		}
		c.close()
		if status, body := srv.post("/events", "application/json", mustJSON(t, map[string]any{"channel": "a", "data": "x"}), nil); status != http.StatusServiceUnavailable {
			t.Fatalf("publish %d with Redis down: %d %s", i, status, body)
		}
	}
	b, _ := os.ReadFile(file)
	text := string(b)
	for _, msg := range []string{
		"publish failed",
		"stream opened without history: the backend is unreachable",
		"connection cap unavailable; admitting the stream",
		"throttles unavailable; admitting the stream",
	} {
		// at most twice: once, and once more if the test outlasted warnEvery
		if n := strings.Count(text, `"msg":"`+msg+`"`); n > 2 {
			t.Errorf("%q logged %d times at warn level, want once per %v", msg, n, warnEvery)
		}
	}
	if !strings.Contains(text, `"msg":"publish failed"`) {
		t.Errorf("the first failed publish was not logged:\n%s", text)
	}
}
