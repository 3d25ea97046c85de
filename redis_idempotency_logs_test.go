package caddysse

import (
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// While Redis is down each publish with an Idempotency-Key warned that
// idempotency keys fall back to this instance: one warn line per publish,
// as many as the publishes. It is warned of once a minute while it lasts.
func TestIdempotencyFallbackIsWarnedOfRarely(t *testing.T) {
	rds := redistest.Start(t)
	file := filepath.Join(t.TempDir(), "sse.log")
	srv := startCaddy(t, redisSite(rds.URL()), sseLog(file))
	srv.publish("/events", map[string]any{"channel": "a", "data": "x"})
	rds.Kill()
	for i := 0; i < 20; i++ {
		status, body := srv.post("/events", "application/json", mustJSON(t, map[string]any{"channel": "a", "data": "x"}),
			header("Idempotency-Key", "k"+itoa(i)))
		if status != http.StatusServiceUnavailable {
			t.Fatalf("keyed publish %d with Redis down: %d %s", i, status, body)
		}
	}
	b, _ := os.ReadFile(file)
	if n := strings.Count(string(b), "idempotency keys fall back to this instance"); n != 1 {
		t.Fatalf("20 keyed publishes with Redis down warned of the fallback %d times, want once", n)
	}
}
