package pubsub

import (
	"context"
	"fmt"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/replay"
)

// An event published straight into Redis with data that is not UTF-8 is
// not sent raw and is reported with one warning per channel (SPEC S3), not
// once per read of the history that holds it (each reconnect with a cursor
// before it).
func TestAnInvalidDirectEventIsWarnedOfOncePerChannel(t *testing.T) {
	srv := redistest.Start(t)
	core, logs := observer.New(zapcore.WarnLevel)
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, Logger: zap.New(core)})
	rec := follow(t, srv, hub, broker, "x")
	good := publishTo(t, hub, "x", "good")
	ctx := context.Background()
	if err := broker.Client().FCall(ctx, FunctionPublish, []string{broker.Key("x")}, "t", "bad \xff data").Err(); err != nil {
		t.Fatal(err)
	}
	got := rec.waitFor(t, 0, 2)
	if len(got[1].Frame) != 0 {
		t.Fatalf("non-UTF-8 data was delivered as %q", got[1].Frame)
	}
	for range 3 { // three clients reconnect with the id of the good event
		page, err := hub.Read(ctx, "x", &good, 10)
		if err != nil || len(page.Events) != 1 || len(page.Events[0].Frame) != 0 {
			t.Fatalf("read %+v %v", page, err)
		}
	}
	var warnings []string
	for _, e := range logs.All() {
		if e.Level == zapcore.WarnLevel {
			warnings = append(warnings, e.Message)
		}
	}
	if len(warnings) != 1 {
		t.Fatalf("%d warnings for one bad event on one channel, want 1: %q", len(warnings), warnings)
	}
}

// The channels warned of invalid direct events are remembered for the
// broker's life, which outlives reloads: a backend that publishes straight
// into Redis data that is not UTF-8 (a truncated multi-byte character) to
// a channel per user or per order grew every instance by one entry per
// channel name, for good, and logged one warning per channel. The broker
// remembers a bounded number; beyond it, the warning is logged rarely.
func TestInvalidDirectEventsOnManyChannelsAreRememberedBoundedly(t *testing.T) {
	srv := redistest.Start(t)
	core, logs := observer.New(zapcore.WarnLevel)
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, Logger: zap.New(core)})
	ctx := context.Background()
	publishTo(t, hub, "warm-up", "loads the function library")
	channels := maxBadWarned + 500
	pipe := broker.Client().Pipeline()
	for i := range channels {
		pipe.FCall(ctx, FunctionPublish, []string{broker.Key(fmt.Sprint("order:", i))}, "t", "bad \xff data")
	}
	if _, err := pipe.Exec(ctx); err != nil {
		t.Fatal(err)
	}
	for i := range channels { // a client reconnects on each channel with a cursor
		if _, err := hub.Read(ctx, fmt.Sprint("order:", i), &replay.Position{}, 10); err != nil {
			t.Fatal(err)
		}
	}
	remembered := 0
	broker.badWarned.Range(func(any, any) bool { remembered++; return true })
	warnings := logs.FilterLevelExact(zapcore.WarnLevel).Len()
	if remembered > maxBadWarned || warnings > maxBadWarned+1 {
		t.Fatalf("after invalid events on %d channels: %d channels remembered, %d warnings; want at most %d and %d",
			channels, remembered, warnings, maxBadWarned, maxBadWarned+1)
	}
}
