package pubsub

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// skewed returns a clock off the system's by d: an instance whose clock
// is ahead of (d > 0) or behind Redis' and the other instances'.
func skewed(d time.Duration) func() time.Time {
	return func() time.Time { return time.Now().Add(d) }
}

// Instances sharing one Redis do not share a clock. A lease is scored by
// when it lapses: scored by the clock of the instance that took it, and
// dropped as lapsed by the clock of the one that counts, an instance whose
// clock is 20 s behind had its live lease (renewed a moment ago, 15 s to
// go) removed by the next Acquire of another: a cap of 1 let 2 streams in.
func TestRedisLeasesCapHoldsAcrossInstancesWithSkewedClocks(t *testing.T) {
	srv := redistest.Start(t)
	behind := newTestRedis(t, srv)
	behind.now = skewed(-20 * time.Second)
	a, b := NewRedisLeases(newTestRedis(t, srv)), NewRedisLeases(behind)
	defer a.Close()
	defer b.Close()
	ctx := context.Background()
	if _, err := b.Acquire(ctx, "p", 1, 15*time.Second); err != nil {
		t.Fatal(err)
	}
	if counts, err := a.Counts(ctx, []string{"p"}); err != nil || counts["p"] != 1 {
		t.Errorf("the other instance counts %v (%v), want 1 lease", counts, err)
	}
	if _, err := a.Acquire(ctx, "p", 1, 15*time.Second); !errors.Is(err, ErrLimitReached) {
		t.Fatalf("a second lease for a cap of 1, on an instance whose clock is 20 s ahead: %v", err)
	}
}

// A throttle is announced with the event's time (Redis' clock) and its
// length; an instance that worked out what is left of it with its own
// clock let the client straight in when that clock was ahead by more than
// the throttle, and refused it for minutes longer when it was behind.
func TestRedisThrottlesHoldAcrossInstancesWithSkewedClocks(t *testing.T) {
	srv := redistest.Start(t)
	opts := RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: 500 * time.Millisecond}
	ctx := context.Background()
	a := newRedisThrottles(t, opts)
	followLoaded(t, a)
	for i, skew := range []time.Duration{2 * time.Minute, -2 * time.Minute} {
		b := newRedisThrottles(t, opts)
		b.b.now = skewed(skew)
		followLoaded(t, b)
		srv.WaitShardSubscribers(t, b.b.Key(throttleChannel), 2+i)

		key := "user|" + skew.String()
		if err := a.Throttle(ctx, key, time.Minute); err != nil {
			t.Fatal(err)
		}
		waitThrottled(t, b, key) // about a minute, not none or three
	}
}

// Now keeps what it read of each primary's clock by the primary's client.
// On a cluster, a primary that goes away (a failover to a node of another
// address, a pod that came back with another IP) leaves its client behind,
// closed; its read of the clock stayed in the map for the broker's life,
// holding the client, one more at each such change. A read older than
// clockReuse is of no use: those of other primaries go at the next read.
func TestRedisNowForgetsTheClocksOfPrimariesGone(t *testing.T) {
	srv := redistest.Start(t)
	b := newTestRedis(t, srv)
	gone := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	_ = gone.Close()
	read := make(chan struct{})
	close(read)
	b.clocksMu.Lock()
	b.clocks = map[*redis.Client]*primaryClock{gone: {read: read, at: b.now().Add(-time.Minute)}}
	b.clocksMu.Unlock()
	if _, err := b.Now(context.Background(), "a"); err != nil {
		t.Fatal(err)
	}
	b.clocksMu.Lock()
	defer b.clocksMu.Unlock()
	if _, kept := b.clocks[gone]; kept || len(b.clocks) != 1 {
		t.Errorf("the clocks read are kept for %d primaries (the one gone: %v), want the one still asked", len(b.clocks), kept)
	}
}

// The offset to Redis' clock was measured only when the announcements were
// loaded (a start, a gap). An NTP step of an instance's clock after that (or
// a failover to a primary of another clock) left it as it was: a throttle
// announced afterwards by another instance was counted on the old offset,
// and a one-minute throttle was taken for over by an instance whose clock
// had stepped two minutes ahead.
func TestRedisThrottlesFollowAStepOfTheInstancesClock(t *testing.T) {
	srv := redistest.Start(t)
	opts := RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: 500 * time.Millisecond}
	ctx := context.Background()
	a := newRedisThrottles(t, opts)
	followLoaded(t, a)

	b := newRedisThrottles(t, opts)
	var step atomic.Int64
	b.b.now = func() time.Time { return time.Now().Add(time.Duration(step.Load())) }
	b.clockEvery = 50 * time.Millisecond
	followLoaded(t, b)
	srv.WaitShardSubscribers(t, b.b.Key(throttleChannel), 2)

	step.Store(int64(2 * time.Minute)) // NTP steps b's clock ahead
	deadline := time.Now().Add(redisWait)
	for offset := int64(0); offset > -110_000; {
		if time.Now().After(deadline) {
			t.Fatalf("the offset to Redis' clock is %d ms after a step of two minutes, want about -120000", offset)
		}
		time.Sleep(10 * time.Millisecond)
		b.mu.Lock()
		offset = b.offset
		b.mu.Unlock()
	}
	const key = "user|after-step"
	if err := a.Throttle(ctx, key, time.Minute); err != nil {
		t.Fatal(err)
	}
	waitThrottled(t, b, key) // about a minute, not none
}
