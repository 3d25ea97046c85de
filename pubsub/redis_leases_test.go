package pubsub

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// A principal's leases live in one sorted set, whose expiry no Acquire or
// renewal brings closer: a lease taken with a short lease_ttl (another route,
// or an instance of a rolling change of the setting) and released does not
// take the set, with the other instances' long leases, with it when it
// lapses.
func TestAShortLeaseDoesNotExpireTheOthers(t *testing.T) {
	srv := redistest.Start(t)
	long := NewRedisLeases(newTestRedis(t, srv))  // lease_ttl 30s: renews every 10s
	short := NewRedisLeases(newTestRedis(t, srv)) // lease_ttl 100ms
	defer long.Close()
	defer short.Close()
	ctx := context.Background()
	if _, err := long.Acquire(ctx, "p", 2, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	l, err := short.Acquire(ctx, "p", 2, 100*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	l.Release()
	// short's release is flushed at once; then wait a little beyond its
	// ttl (well within long's 30s lease, which nobody may drop)
	time.Sleep(500 * time.Millisecond)
	counts, err := long.Counts(ctx, []string{"p"})
	if err != nil {
		t.Fatal(err)
	}
	if counts["p"] != 1 {
		t.Errorf("the principal holds %d live leases, want 1 (the 30s lease still held); key TTL now %s ms",
			counts["p"], srv.MustCLI("PTTL", "sse:lease:{p}"))
	}
	if _, err := short.Acquire(ctx, "p", 1, 100*time.Millisecond); !errors.Is(err, ErrLimitReached) {
		t.Fatalf("a second lease for a cap of 1 while a 30s lease is held: %v, want ErrLimitReached", err)
	}
}

// Caps and throttles on a Redis Cluster (no other test runs them there):
// two instances share a principal's cap whichever primary holds its key,
// the renewals (one pipeline across primaries) keep a held lease beyond its
// ttl, a release frees the slot for the other instance, and a throttle set
// by one instance is seen by the other.
func TestLeasesAndThrottlesOnACluster(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	opts := RedisOptions{Addrs: cluster.Addrs(), CheckInterval: 300 * time.Millisecond}
	a, err := NewRedisHub(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := NewRedisHub(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	ctx := context.Background()
	const ttl = 300 * time.Millisecond
	principals := []string{channelInSlot(t, 100), channelInSlot(t, 8000), channelInSlot(t, 16000)} // lease keys are named like channels' keys
	held := map[string]Lease{}
	for _, p := range principals {
		l, err := a.Leases().Acquire(ctx, p, 1, ttl)
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		held[p] = l
	}
	time.Sleep(4 * ttl) // several renewals
	for _, p := range principals {
		if _, err := b.Leases().Acquire(ctx, p, 1, ttl); !errors.Is(err, ErrLimitReached) {
			t.Fatalf("%s: a second lease for a cap of 1 across instances after %v: %v", p, 4*ttl, err)
		}
	}
	counts, err := a.Leases().(LeaseCounter).Counts(ctx, principals)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range principals {
		if counts[p] != 1 {
			t.Fatalf("counts %v, want 1 each", counts)
		}
		held[p].Release()
	}
	for _, p := range principals {
		deadline := time.Now().Add(redisWait)
		for {
			if _, err := b.Leases().Acquire(ctx, p, 1, ttl); err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: the released lease never freed the slot", p)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}

	key := "ns\x00" + principals[0] + "\x00127.0.0.1"
	if left, err := b.Throttles().Remaining(ctx, key); err != nil || left != 0 {
		t.Fatalf("before any throttle: %v %v", left, err)
	}
	if err := a.Throttles().Throttle(ctx, key, time.Minute); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(redisWait)
	for {
		left, err := b.Throttles().Remaining(ctx, key)
		if err == nil && left > 50*time.Second {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the other instance never saw the throttle: %v %v", left, err)
		}
		time.Sleep(20 * time.Millisecond)
	}

}

// The renewal period follows the shortest lease held, not the shortest
// ever asked for: after a reload from lease_ttl 300ms to 3s, once the old
// config's leases are released, renewals run every second again, not every
// 100 ms for the life of the process.
func TestRedisLeaseRenewalPeriodFollowsTheLeasesHeld(t *testing.T) {
	srv := redistest.Start(t)
	r := NewRedisLeases(newTestRedis(t, srv))
	defer r.Close()
	ctx := context.Background()
	short, err := r.Acquire(ctx, "old-config", 10, 300*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Acquire(ctx, "new-config", 10, 3*time.Second); err != nil {
		t.Fatal(err)
	}
	if got := r.period(); got != 100*time.Millisecond {
		t.Fatalf("period %v while a 300ms lease is held, want 100ms", got)
	}
	short.Release()
	for deadline := time.Now().Add(redisWait); r.period() != time.Second; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("period %v with only a 3s lease held, want 1s", r.period())
		}
	}
}
