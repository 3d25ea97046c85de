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

// sseLog is a global option that sends the module's logs to file.
func sseLog(file string) string {
	return "log ssefile {\n\t\toutput file " + file + "\n\t\tformat json\n\t\tinclude http.handlers.sse\n\t}"
}

// The Redis hub outlives the config that made it, and so must not keep its
// logger: after a reload that changes where (or at which level) the
// module logs, the hub logs there too. It kept the first config's logger,
// whose output Caddy had let go with that config: "redis is unreachable"
// went on to the old file, which the running config no longer names.
func TestRedisHubLogsWhereTheRunningConfigSays(t *testing.T) {
	rds := redistest.Start(t)
	dir := t.TempDir()
	first, second := filepath.Join(dir, "first.log"), filepath.Join(dir, "second.log")
	site := redisSite(rds.URL())
	srv := startCaddy(t, site, sseLog(first))
	c := srv.subscribe("/events?channels=a", nil)
	c.comment("ok")
	srv.reload(site, sseLog(second))
	openCountedStream(t, srv, rds, "a", nil)
	rds.Kill()
	eventually(t, "the running config's log to say redis is unreachable", func() bool {
		b, _ := os.ReadFile(second)
		return strings.Contains(string(b), "redis is unreachable")
	})
}

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

// logLine returns the first line of the JSON log file whose message is msg
// and which holds marker (a field, such as `"principal":"p"`), or "".
func logLine(t *testing.T, file, msg, marker string) string {
	t.Helper()
	for _, line := range strings.Split(readFile(t, file), "\n") {
		if strings.Contains(line, `"msg":"`+msg+`"`) && strings.Contains(line, marker) {
			return line
		}
	}
	return ""
}

func readFile(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(name)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	return string(b)
}

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
	for msg, atLeast := range map[string]int{
		"publish failed": 1,
		"stream opened without history: the backend is unreachable": 1,
		"connection cap unavailable; admitting the stream":          1, // the cap fails open, and says so
		// the throttles answer from memory once loaded (they were, before
		// Redis died); they are asked of Redis only until then
		"throttles unavailable; admitting the stream": 0,
	} {
		// once, and once more if the test outlasted warnEvery
		if n := strings.Count(text, `"msg":"`+msg+`"`); n < atLeast || n > 2 {
			t.Errorf("%q logged %d times at warn level, want %d to 2 (once per %v)", msg, n, atLeast, warnEvery)
		}
	}
}

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
