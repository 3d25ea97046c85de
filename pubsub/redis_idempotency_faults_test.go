package pubsub

import (
	"bytes"
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// The claim of an Idempotency-Key (SET NX) whose reply is lost after Redis
// ran it is sent again by go-redis (max_retries), and the second run finds
// the key taken, by this very request: it must publish at once, not wait
// for its own claim to lapse (idemPendingTTL, 30 s, by which time the
// publisher has given up, and a retry of it was kept waiting as well).
func TestRedisIdempotencyClaimRetriedAfterALostReplyPublishes(t *testing.T) {
	srv := redistest.Start(t)
	b := newTestRedis(t, srv)
	hook := &loseOneReply{match: func(p []byte) bool {
		return bytes.Contains(p, []byte("idem:{")) && bytes.Contains(bytes.ToLower(p), []byte("nx"))
	}}
	b.client.AddHook(hook)
	r := NewRedisIdempotency(b)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := b.client.Ping(ctx).Err(); err != nil { // warm the pool
		t.Fatal(err)
	}
	hook.armed.Store(true)
	var runs atomic.Int32
	reply, replayed, err := r.Do(ctx, "k", "fp", func() ([]byte, error) {
		runs.Add(1)
		return []byte(`{"ids":{}}`), nil
	})
	if hook.armed.Load() {
		t.Fatal("the test lost no reply")
	}
	if err != nil || replayed || runs.Load() != 1 || string(reply) != `{"ids":{}}` {
		t.Fatalf("a keyed publish whose claim was sent twice: %s replayed %v, %v; %d publishes, want 1", reply, replayed, err, runs.Load())
	}
	if v := srv.MustCLI("GET", "sse:idem:{k}"); v != `d:fp:{"ids":{}}` {
		t.Fatalf("the key holds %q, want the reply", v)
	}
}

// A keyed publish that panics (Caddy recovers a handler's panic) gives its
// claim back and stops renewing it: the renewals went on for the life of
// the process, a Redis call every third of idemPendingTTL per such request.
func TestRedisIdempotencyPanicStopsTheClaimsRenewals(t *testing.T) {
	srv := redistest.Start(t)
	r := NewRedisIdempotency(newTestRedis(t, srv))
	r.pendingTTL = 150 * time.Millisecond // renewed every 50 ms
	func() {
		defer func() { _ = recover() }()
		_, _, _ = r.Do(context.Background(), "k", "fp", func() ([]byte, error) {
			time.Sleep(120 * time.Millisecond) // renewed at least once
			panic("publish")
		})
	}()
	calls := func() string {
		for _, line := range strings.Split(srv.MustCLI("INFO", "commandstats"), "\n") {
			if strings.HasPrefix(line, "cmdstat_evalsha:") {
				calls, _, _ := strings.Cut(strings.TrimPrefix(line, "cmdstat_evalsha:"), ",")
				return calls
			}
		}
		return ""
	}
	before := calls()
	time.Sleep(300 * time.Millisecond)
	if after := calls(); after != before {
		t.Fatalf("scripts run after the publish panicked: %s, then %s", before, after)
	}
}
