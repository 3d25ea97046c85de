package pubsub

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/replay"
)

// failTime fails this client's TIME calls while armed (Redis flapping: the
// call's connection dropped, or it timed out), and nothing else: the scripts
// and functions, which read Redis' clock inside Redis, still run.
type failTime struct {
	passThrough
	armed atomic.Bool
	calls atomic.Int64
}

func (h *failTime) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if strings.EqualFold(cmd.Name(), "time") {
			h.calls.Add(1)
			if h.armed.Load() {
				err := errors.New("i/o timeout (test: TIME lost)")
				cmd.SetErr(err)
				return err
			}
		}
		return next(ctx, cmd)
	}
}

// An instance whose first measurement of Redis' clock fails (TIME lost
// while Redis flaps) but whose read of the announcements works took every
// announcement of the history for new: a throttle that ended a while ago
// (the history keeps them for a day) refused its client again, for its
// whole length, on that instance. Before the clock was measured, it was at
// worst off by the instance's skew.
func TestRedisThrottlesOverBeforeAFailedClockMeasurementStayOver(t *testing.T) {
	srv := redistest.Start(t)
	opts := RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: 500 * time.Millisecond}
	ctx := context.Background()
	a := newRedisThrottles(t, opts)
	_, _ = a.Remaining(ctx, "x")
	waitLoaded(t, a)
	const key = "user|over"
	if err := a.Throttle(ctx, key, 300*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(redisWait)
	for srv.MustCLI("EXISTS", a.key(key)) != "0" { // Redis' key lapses with the throttle
		if time.Now().After(deadline) {
			t.Fatal("the throttle's key did not lapse")
		}
		time.Sleep(10 * time.Millisecond)
	}
	for {
		left, err := a.Remaining(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		if left == 0 {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}

	b := newRedisThrottles(t, opts)
	hook := &failTime{}
	hook.armed.Store(true)
	b.b.client.AddHook(hook)
	_, _ = b.Remaining(ctx, "x")
	deadline = time.Now().Add(redisWait)
	for hook.calls.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the load never measured Redis' clock")
		}
		time.Sleep(10 * time.Millisecond)
	}
	hook.armed.Store(false) // Redis answers again: the load may retry
	waitLoaded(t, b)
	if left, err := b.Remaining(ctx, key); err != nil || left != 0 {
		t.Fatalf("a throttle over before the instance started refuses its client for %v more (%v)", left, err)
	}
}

// One primary of a cluster hangs while another has lost the lease scripts
// (a replica just promoted, SCRIPT FLUSH): the renewal's pipeline of
// EVALSHA gets NOSCRIPT from the one and nothing from the other; the
// leases of the one that answers are sent again with EVAL, within their
// ttl, and a cap of 1 there still holds.
func TestRedisLeasesOnAPrimaryWithoutTheScriptsOutliveAHungOne(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	healthy, hung := channelInSlot(t, 100), channelInSlot(t, 16000)
	healthyNode, hungNode := cluster.NodeOfSlot(t, 100), cluster.NodeOfSlot(t, 16000)
	if healthyNode == hungNode {
		t.Fatal("slots 100 and 16000 on one primary")
	}
	newLeases := func() *RedisLeases {
		b, err := NewRedis(RedisOptions{Addrs: cluster.Addrs(), ReadTimeout: 500 * time.Millisecond}, func(string, *replay.Event) {})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = b.Close() })
		r := NewRedisLeases(b)
		t.Cleanup(r.Close)
		return r
	}
	r, other := newLeases(), newLeases()
	ctx := context.Background()
	const ttl = 3 * time.Second
	for _, p := range []string{healthy, hung} {
		if _, err := r.Acquire(ctx, p, 1, ttl); err != nil {
			t.Fatalf("%s: %v", p, err)
		}
	}
	if n, err := other.Held(ctx, healthy); err != nil || n != 1 {
		t.Fatalf("the other instance counts %d leases (%v), want 1", n, err)
	}
	const pause = 3 * ttl
	healthyNode.MustCLI("SCRIPT", "FLUSH")
	hungNode.MustCLI("CLIENT", "PAUSE", strconv.Itoa(int(pause.Milliseconds())), "ALL")
	paused := time.Now()
	for time.Since(paused) < pause-time.Second {
		l, err := other.Acquire(ctx, healthy, 1, ttl)
		if err == nil {
			l.Release()
			t.Fatalf("%v after: a second lease for a cap of 1 on the primary that answers", time.Since(paused).Round(time.Millisecond))
		}
		if !errors.Is(err, ErrLimitReached) && !errors.Is(err, ErrUnavailable) {
			t.Fatalf("after %v: %v", time.Since(paused).Round(time.Millisecond), err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
