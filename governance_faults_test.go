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

// While Redis is down the per-principal cap fails open for a principal
// that already holds its cap too (SPEC S9: caps fail open, logged), not
// only for one that holds nothing: the leases that count its streams on
// every instance are in Redis, so this instance cannot know it is over.
func TestACapFailsOpenForAPrincipalAtItsCapWhileRedisIsDown(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, redisSite(rds.URL(), "principal {query.user}", "max_connections_per_principal 1"))
	srv.subscribe("/events?channels=a&user=p", nil).comment("ok")
	if got := srv.getRefusal("/events?channels=a&user=p"); got.code != "too_many_connections" {
		t.Fatalf("a second stream of the principal with Redis up: %+v", got)
	}
	rds.Kill()
	eventually(t, "a second stream of the principal admitted while Redis is down", func() bool {
		c := openStream(t, srv.base+"/events?channels=a&user=p", nil, nil)
		defer c.close()
		return c.resp.StatusCode == http.StatusOK && c.next().Type == "sse_degraded"
	})
}
