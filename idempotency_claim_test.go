package caddysse

import (
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// A keyed publish sent to a frozen Redis: its claim of the key (SET NX)
// gets no answer and the publish answers 503 + Retry-After: 1. Redis runs
// the claim it holds once it resumes, and nobody owns that claim any more.
// The retry the 503 asks for, under the same key once Redis answers, must
// be answered at once (with the event's id: Redis ran the publish too),
// not wait for the orphaned claim to lapse (30 s), which a publisher with
// a request timeout sees as more failures.
func TestAKeyedRetryAfterAFrozenRedisIsNotHeldByAnOrphanedClaim(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, redisBlockSite("url "+rds.URL()+
		"\n\t\t\tdial_timeout 300ms\n\t\t\tread_timeout 300ms\n\t\t\twrite_timeout 300ms\n\t\t\tmax_retries -1\n\t\t\tcheck_interval 300ms"))
	c := srv.subscribe("/events?channels=a", nil)
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	srv.publish("/events", map[string]any{"channel": "a", "data": "before"})
	c.next()

	body := mustJSON(t, map[string]any{"channel": "a", "data": "once"})
	key := http.Header{"Idempotency-Key": {"k-frozen"}}
	setsBefore := setCalls(t, rds)
	rds.Pause()
	status, reply := srv.post("/events", "application/json", body, key)
	rds.Resume()
	if status != http.StatusServiceUnavailable {
		t.Fatalf("keyed publish to a frozen Redis: %d %s, want 503", status, reply)
	}
	// Redis runs the claim it held once it resumes: nobody owns it now
	eventually(t, "Redis runs the claim it holds once it resumes", func() bool { return setCalls(t, rds) > setsBefore })

	start := time.Now()
	deadline := start.Add(waitFor)
	var ids publishReply
	for {
		status, reply = srv.post("/events", "application/json", body, key)
		if status == http.StatusOK {
			if err := json.Unmarshal(reply, &ids); err != nil {
				t.Fatal(err)
			}
			break
		}
		if status != http.StatusServiceUnavailable || time.Now().After(deadline) {
			// waitFor is a third of the claim's 30 s: a retry held by
			// the orphaned claim until it lapses ends here
			t.Fatalf("retry under the key %v after Redis resumed: %d %s", time.Since(start), status, reply)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if ev := c.next(); ev.Data != "once" || ev.ID != ids.IDs["a"] {
		t.Fatalf("stream got %+v, the retry answered %s", ev, ids.IDs["a"])
	}
	srv.publish("/events", map[string]any{"channel": "a", "data": "after"})
	if ev := c.next(); ev.Data != "after" {
		t.Fatalf("got %+v after the retried event, want the next one (no second copy)", ev)
	}
}

// setCalls is how many SET commands Redis has run (a claim of a key is one).
func setCalls(t *testing.T, rds *redistest.Server) int {
	t.Helper()
	for _, line := range strings.Split(rds.MustCLI("INFO", "commandstats"), "\n") {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_set:calls="); ok {
			n, _ := strconv.Atoi(rest[:strings.IndexByte(rest, ',')])
			return n
		}
	}
	return 0
}
