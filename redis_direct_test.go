package caddysse

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// A backend that appends to a channel's stream with a plain XADD, as the
// docs describe its entries, bypasses the library: its entry (id
// "<ms>-0") has no seq of the channel and was never announced. Live
// streams never got it, yet a reconnect's replay wrote it, with an id
// whose seq went back to 0 — the streams of one channel disagreed, and a
// client cut just after it was told its next replay was truncated. It is
// not part of the channel: neither gets it.
func TestPlainXAddToAChannelsStreamIsNotReplayed(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, redisSite(rds.URL()))
	c := srv.subscribe("/events?channels=a", nil)
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	one := srv.publishN("a", "e", 1, 1)[1]
	// XADD * after e1's millisecond: "<ms>-0", and the next publish's
	// entry comes after it
	deadline := time.Now().Add(5 * time.Second)
	for redisMillis(t, rds) <= seqOf(t, one).Time {
		if time.Now().After(deadline) {
			t.Fatal("the Redis clock did not move")
		}
	}
	rds.MustCLI("XADD", "sse:{a}:s", "*", "y", "t", "d", "plain")
	srv.publishN("a", "e", 2, 3)
	if got := c.nextData(3); fmt.Sprint(got) != "[e1 e2 e3]" {
		t.Fatalf("live: %v", got)
	}
	r := srv.subscribe("/events?channels=a", header("Last-Event-ID", one))
	if r.resp.Header.Get("X-Replay-Truncated") != "" {
		t.Fatal("the replay after e1 is told truncated")
	}
	for i, want := range []string{"e2", "e3"} {
		ev := r.next()
		if ev.Data != want || seqOf(t, ev.ID).Seq != uint64(i+2) {
			t.Fatalf("replay after e1: event %d is %q at %+v, want %s at seq %d", i, ev.Data, seqOf(t, ev.ID), want, i+2)
		}
	}
}

// redisMillis is the Redis server's clock in milliseconds.
func redisMillis(t *testing.T, rds *redistest.Server) int64 {
	t.Helper()
	f := strings.Fields(rds.MustCLI("TIME"))
	s, err1 := strconv.ParseInt(f[0], 10, 64)
	us, err2 := strconv.ParseInt(f[1], 10, 64)
	if len(f) != 2 || err1 != nil || err2 != nil {
		t.Fatalf("TIME answered %q", f)
	}
	return s*1000 + us/1000
}
