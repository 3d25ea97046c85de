package pubsub

import (
	"context"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
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
