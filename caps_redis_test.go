package caddysse

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// A full instance refuses a stream without taking its principal's lease:
// one taken only to be given back counted against the principal on every
// instance for that round trip, so a client hammering a full instance had
// its principal's streams refused 429 elsewhere. The refusal still follows
// SPEC S2's order: the principal's cap (counted across instances) before
// the instance's. Redis tells every write to the principal's lease set
// (keyspace notifications); the test's own marker write ends the wait.
func TestAFullInstanceRefusesWithoutTakingTheLease(t *testing.T) {
	rds := redistest.Start(t)
	rds.MustCLI("CONFIG", "SET", "notify-keyspace-events", "Kz")
	srv := startCaddy(t, redisSite(rds.URL(), "principal {query.user}", "max_connections_per_principal 2", "max_connections 1"))
	srv.subscribe("/events?channels=a&user=filler", nil).comment("ok") // the instance is full

	const key = "sse:lease:{u1}"
	otherInstance := func(member string) {
		rds.MustCLI("ZADD", key, fmt.Sprint(time.Now().Add(time.Minute).UnixMilli()), member)
	}
	otherInstance("other-instance:1")

	client := redis.NewClient(&redis.Options{Addr: rds.Addr()})
	defer client.Close()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	writes := client.Subscribe(ctx, "__keyspace@0__:"+key)
	defer writes.Close()
	if _, err := writes.Receive(ctx); err != nil { // the subscription's confirmation
		t.Fatal(err)
	}

	// under its cap (1 of 2): the instance's refusal, and no write
	if got := srv.getRefusal("/events?channels=a&user=u1"); got.status != http.StatusServiceUnavailable || got.code != "server_full" {
		t.Fatalf("u1 below its cap on a full instance: %d %s, want 503 server_full", got.status, got.code)
	}
	rds.MustCLI("ZINCRBY", key, "1", "other-instance:1") // the marker (a lease 1 ms longer)
	for {
		msg, err := writes.ReceiveMessage(ctx)
		if err != nil {
			t.Fatalf("waiting for the marker: %v", err)
		}
		if msg.Payload == "zincr" {
			break
		}
		t.Fatalf("a refused stream wrote %q to its principal's lease set", msg.Payload)
	}

	// at its cap across instances (2 of 2): the principal's refusal first
	otherInstance("other-instance:2")
	if got := srv.getRefusal("/events?channels=a&user=u1"); got.status != http.StatusTooManyRequests || got.code != "too_many_connections" {
		t.Fatalf("u1 at its cap on a full instance: %d %s, want 429 too_many_connections", got.status, got.code)
	}
	if n := rds.MustCLI("ZCARD", key); n != "2" {
		t.Fatalf("%s members after the refusals, want the other instance's 2", n)
	}
}
