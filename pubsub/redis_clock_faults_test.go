package pubsub

import (
	"context"
	"errors"
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
	followLoaded(t, a)
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

// An announcement that arrives before the instance measured Redis' clock
// (a watch's sync re-delivering a channel's newest event once Redis
// answers again, while the first loads failed) is counted on this
// instance's clock, as before there was a measurement, not taken for new:
// one a day old refused its client again for its whole length.
func TestRedisThrottlesAnnouncementBeforeAnyMeasurementIsNotTakenForNew(t *testing.T) {
	r := NewRedisThrottles(&Redis{now: time.Now})
	old := time.Now().Add(-time.Hour).UnixMilli()
	ev, valid := encodeEvent(replay.Position{Epoch: 1, Seq: 1, Time: old}, "throttle", `{"k":"user|old","ms":60000}`)
	if !valid {
		t.Fatal("not a valid announcement")
	}
	r.apply(ev)
	if left, _ := r.known.Remaining(context.Background(), "user|old"); left != 0 {
		t.Fatalf("an announcement an hour old, of a 1 min throttle, throttles for %v", left)
	}
}
