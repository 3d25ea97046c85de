package caddysse

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// A publish without an Idempotency-Key whose call reached Redis and got no
// answer (here Redis is frozen: it runs the call once it resumes) answers
// 503 for a channel that Redis did publish. Its body offers a key; the
// retry under it publishes the channels that were not published and gets
// the first event's id for the one that was: every stream gets each event
// once.
func TestRedisFailedPublishIsRetriedOnceUnderItsOfferedKey(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, redisBlockSite("url "+rds.URL()+
		"\n\t\t\tdial_timeout 300ms\n\t\t\tread_timeout 300ms\n\t\t\twrite_timeout 300ms\n\t\t\tmax_retries -1\n\t\t\tcheck_interval 300ms"))
	streams := map[string]*sseClient{}
	for _, ch := range []string{"a", "b"} {
		streams[ch] = srv.subscribe("/events?channels="+ch, nil)
		rds.WaitShardSubscribers(t, "sse:{"+ch+"}", 1)
		srv.publish("/events", map[string]any{"channel": ch, "data": "before"})
		streams[ch].next()
	}
	body := mustJSON(t, map[string]any{"channel": []string{"a", "b"}, "data": "once"})

	rds.Pause()
	status, reply := srv.post("/events", "application/json", body, nil)
	rds.Resume()
	var failure errorBody
	if err := json.Unmarshal(reply, &failure); err != nil || status != http.StatusServiceUnavailable {
		t.Fatalf("publish to a frozen Redis: %d %s (%v)", status, reply, err)
	}
	if !strings.HasPrefix(failure.IdempotencyKey, retryKeyPrefix) || len(failure.Channels) != 2 {
		t.Fatalf("the failed publish offers no retry key, or does not name both channels: %s", reply)
	}
	eventually(t, "Redis runs the call it holds once it resumes", func() bool { return rds.MustCLI("XLEN", "sse:{a}:s") == "2" })

	ids := retryUnderKey(t, srv, body, failure.IdempotencyKey)
	for _, ch := range []string{"a", "b"} {
		if ev := streams[ch].next(); ev.Data != "once" || ev.ID != ids[ch] {
			t.Fatalf("channel %s: the stream got %+v, the retry answered the id %s", ch, ev, ids[ch])
		}
		srv.publish("/events", map[string]any{"channel": ch, "data": "after"})
		if ev := streams[ch].next(); ev.Data != "after" {
			t.Fatalf("channel %s: got %+v after the retried event, want the next one (no second copy)", ch, ev)
		}
		if n := rds.MustCLI("XLEN", "sse:{"+ch+"}:s"); n != "3" {
			t.Fatalf("channel %s holds %s events, want 3 (before, once, after)", ch, n)
		}
	}
}

// retryUnderKey sends body under the Idempotency-Key key until Caddy
// takes it (it answers 503 while it counts Redis as down), and returns
// the ids of the reply.
func retryUnderKey(t *testing.T, srv *testServer, body []byte, key string) map[string]string {
	t.Helper()
	deadline := time.Now().Add(waitFor)
	for {
		status, reply := srv.post("/events", "application/json", body, http.Header{"Idempotency-Key": {key}})
		if status == http.StatusOK {
			var out publishReply
			if err := json.Unmarshal(reply, &out); err != nil {
				t.Fatalf("retry reply %q: %v", reply, err)
			}
			return out.IDs
		}
		if status != http.StatusServiceUnavailable || time.Now().After(deadline) {
			t.Fatalf("retry under the offered key: %d %s", status, reply)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
