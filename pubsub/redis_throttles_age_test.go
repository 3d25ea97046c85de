package pubsub

import (
	"context"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/replay"
)

// A throttle is refused by an instance that starts (or gets a new hub)
// while it lasts, as Redis' key says, even once its announcement is older
// than the announcements' max age: the history's reads leave such events
// out (and publishes trim them), so an instance loading it then never
// learned of a throttle longer than that age and admitted the client while
// Redis still held its key. The max age is shortened here to stand for the
// 24 h a longer `throttle` outlived.
func TestRedisThrottleOutlivingItsAnnouncementIsNotForgotten(t *testing.T) {
	defer func(l replay.Limits) { throttleHistory = l }(throttleHistory)
	throttleHistory.MaxAge = 300 * time.Millisecond
	srv := redistest.Start(t)
	newHub := func() *RedisThrottles {
		return newRedisThrottles(t, RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: time.Hour})
	}
	ctx := context.Background()
	a := newHub()
	const key = "ns\x00user\x001.2.3.4"
	if err := a.Throttle(ctx, key, time.Minute); err != nil {
		t.Fatal(err)
	}
	// until the history's reads no longer have the announcement
	deadline := time.Now().Add(redisWait)
	for {
		page, err := a.hub.Read(ctx, throttleChannel, &replay.Position{}, 10)
		if err == nil && len(page.Events) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the announcement is still read: %d events, %v", len(page.Events), err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	b := newHub()
	b.following()
	waitLoadedEvery(t, b, 5*time.Millisecond)
	left, err := b.Remaining(ctx, key)
	pttl, perr := a.b.client.PTTL(ctx, a.key(key)).Result()
	if err != nil || perr != nil || (left > 0) != (pttl > 0) {
		t.Fatalf("a new instance answers %v left (%v); Redis' key has %v (%v)", left, err, pttl, perr)
	}
}
