package caddysse

import (
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// A wrong Redis password (WRONGPASS) is Redis being unreachable for this
// instance, logged once: it was taken as an answer from Redis on the
// request paths (marking Redis up) and as unreachable by the subscriber's
// connection, so "redis is unreachable" (error) and "redis is reachable
// again" (info) alternated for every publish and stream, about 17 lines of
// each per second at 10 publishes per second, the second one false.
func TestRedisWrongPasswordLoggedOnce(t *testing.T) {
	rds := redistest.Start(t, "--requirepass", "right-pw")
	file := filepath.Join(t.TempDir(), "sse.log")
	srv := startCaddy(t, redisBlockSite("url redis://:wrong-pw@"+rds.Addr()+"\n\t\t\tcheck_interval 300ms"), sseLog(file))
	c := openStream(t, srv.base+"/events?channels=a", nil, nil)
	if c.resp.StatusCode != http.StatusOK {
		t.Fatalf("stream with Redis refusing the password: %d, want 200 (degraded)", c.resp.StatusCode)
	}
	if ev := c.next(); ev.Type != "sse_degraded" {
		t.Fatalf("first event %+v, want sse_degraded", ev)
	}
	for i := 0; i < 15; i++ {
		status, body := srv.post("/events", "application/json", mustJSON(t, map[string]any{"channel": "a", "data": "x"}), nil)
		if status != http.StatusServiceUnavailable {
			t.Fatalf("publish with Redis refusing the password: %d %s", status, body)
		}
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(time.Second) // a few subscriber reconnects and checks
	text := readFile(t, file)
	if n := strings.Count(text, `"redis is unreachable"`); n != 1 {
		t.Errorf(`"redis is unreachable" logged %d times, want once:`+"\n%s", n, text)
	}
	if n := strings.Count(text, `"redis is reachable again"`); n != 0 {
		t.Errorf(`"redis is reachable again" logged %d times while Redis refuses the password:`+"\n%s", n, text)
	}
	if !strings.Contains(text, "WRONGPASS") {
		t.Errorf("the log does not say why:\n%s", text)
	}
	rds.MustCLI("CONFIG", "SET", "requirepass", "wrong-pw") // the password is right now
	eventually(t, "Redis to be reachable again", func() bool {
		return strings.Count(readFile(t, file), `"redis is reachable again"`) == 1
	})
	srv.publishWhileRefused("a", "back")
}

func readFile(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(name)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	return string(b)
}
