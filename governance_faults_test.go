package caddysse

import (
	"net/http"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// timedConnect opens a stream and returns how long its headers took.
func timedConnect(t *testing.T, url string) (*sseClient, time.Duration) {
	t.Helper()
	began := time.Now()
	c := openStream(t, url, nil, nil)
	return c, time.Since(began)
}

// While Redis hangs (SIGSTOP) and is known to be down, a new stream opens
// degraded (SPEC S9) and the cap fails open at once: a capped connect takes
// no longer than the same route's without the cap, rather than one more
// read_timeout (or go-redis' whole retry cycle) for the lease.
func TestACapFailsOpenAtOnceWhileRedisHangs(t *testing.T) {
	rds := redistest.Start(t)
	redisBlock := "redis {\n\t\t\turl " + rds.URL() + "\n\t\t\tread_timeout 2s\n\t\t\tmax_retries -1\n\t\t}"
	srv := startCaddy(t, `
:{PORT} {
	sse /capped {
		channel a
		principal {query.user}
		max_connections_per_principal 5
		`+redisBlock+`
		publish {
			secret `+testSecret+`
		}
	}
	sse /open {
		channel a
		principal {query.user}
		`+redisBlock+`
	}
}
`)
	srv.subscribe("/capped?user=warm", nil).comment("ok")
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	rds.Pause()
	defer rds.Resume()
	// a publish meets the hung Redis: it is known down from one read_timeout on
	status, _ := srv.post("/capped", "application/json", mustJSON(t, map[string]any{"channel": "a", "data": "x"}), nil)
	if status != http.StatusServiceUnavailable {
		t.Fatalf("publish into a hung Redis: %d", status)
	}
	open, tookOpen := timedConnect(t, srv.base+"/open?user=u1")
	if open.resp.StatusCode != 200 {
		t.Fatalf("uncapped connect: %d", open.resp.StatusCode)
	}
	capped, tookCapped := timedConnect(t, srv.base+"/capped?user=u2")
	if capped.resp.StatusCode != 200 {
		t.Fatalf("capped connect: %d (the cap must fail open)", capped.resp.StatusCode)
	}
	t.Logf("connect while Redis hangs: uncapped %v, capped %v", tookOpen, tookCapped)
	if tookCapped > tookOpen+time.Second {
		t.Fatalf("a capped connect while Redis is known down took %v (uncapped %v): the cap waited for Redis instead of failing open", tookCapped, tookOpen)
	}
}
