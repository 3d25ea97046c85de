package pubsub

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/replay"
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

// acquireN takes n leases of principal with a cap of limit.
func acquireN(t *testing.T, r *RedisLeases, principal string, n, limit int) []Lease {
	t.Helper()
	ls := make([]Lease, n)
	for i := range ls {
		l, err := r.Acquire(context.Background(), principal, limit, 30*time.Second)
		if err != nil {
			t.Fatalf("lease %d of %d: %v", i+1, n, err)
		}
		ls[i] = l
	}
	return ls
}

// An Acquire costs the same however many leases of the principal this
// instance holds: it used to send them all, to put back those Redis lost,
// and Redis ran a ZADD for each (with thousands of streams of one principal
// every stream's start cost milliseconds of Redis' single thread, and the
// instance's lock was held as long: at 2000 new streams/s of one principal
// the instance collapsed into 19k goroutines waiting for that lock).
func TestRedisLeaseAcquireDoesNotResendTheLeasesHeld(t *testing.T) {
	srv := redistest.Start(t)
	r := NewRedisLeases(newTestRedis(t, srv))
	defer r.Close()
	acquireN(t, r, "p", 500, 0)
	srv.MustCLI("CONFIG", "RESETSTAT")
	acquireN(t, r, "p", 1, 0)
	stats := srv.MustCLI("INFO", "commandstats")
	for _, line := range strings.Split(stats, "\n") {
		calls, ok := strings.CutPrefix(line, "cmdstat_zadd:calls=")
		if n, _ := strconv.Atoi(strings.Split(calls, ",")[0]); ok && n > leaseSample+1 {
			t.Fatalf("one Acquire with 500 leases held ran %s (the newest %d are put back if lost)", line, leaseSample)
		}
	}
}

// Redis loses the newest writes in a failover, and every write in a restart
// without persistence: the leases this instance holds that Redis lost are
// put back before counting (the newest few, sent with every Acquire; all of
// them when the set is gone or when some of those few were lost, since more
// than those may be), also when other instances' leases are in the set.
func TestRedisLeaseAcquirePutsBackLeasesRedisLost(t *testing.T) {
	srv := redistest.Start(t)
	r, other := NewRedisLeases(newTestRedis(t, srv)), NewRedisLeases(newTestRedis(t, srv))
	defer r.Close()
	defer other.Close()
	const mine, others = 40, 10
	acquireN(t, other, "p", others, 0)
	acquireN(t, r, "p", mine, 0)
	newest := func(n int) []string {
		r.mu.Lock()
		defer r.mu.Unlock()
		var ms []string
		for _, l := range r.heldBy[r.key("p")][mine-n:] {
			ms = append(ms, l.member)
		}
		return ms
	}
	for _, tc := range []struct {
		name string
		lose func()
	}{
		{"the newest lost", func() { srv.MustCLI(append([]string{"ZREM", "sse:lease:{p}"}, newest(5)...)...) }},
		{"more than the sample lost", func() {
			srv.MustCLI(append([]string{"ZREM", "sse:lease:{p}"}, newest(leaseSample+10)...)...)
		}},
		{"the set lost", func() { srv.MustCLI("DEL", "sse:lease:{p}") }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.lose()
			limit := mine + others
			if tc.name == "the set lost" {
				limit = mine // the other instance's leases are back at its renewal only
			}
			_, err := r.Acquire(context.Background(), "p", limit, 30*time.Second)
			if !errors.Is(err, ErrLimitReached) {
				t.Fatalf("a lease beyond the cap of %d after Redis lost this instance's: %v, want ErrLimitReached", limit, err)
			}
			if n := srv.MustCLI("ZCARD", "sse:lease:{p}"); n != strconv.Itoa(limit) {
				t.Fatalf("the set holds %s leases, want %d", n, limit)
			}
		})
	}
}

// Releasing leases in any order keeps the index of those held right (a
// release finds its lease by its index, in constant time).
func TestRedisLeaseReleasesInAnyOrder(t *testing.T) {
	srv := redistest.Start(t)
	r := NewRedisLeases(newTestRedis(t, srv))
	defer r.Close()
	ls := acquireN(t, r, "p", 20, 0)
	for _, i := range []int{3, 19, 0, 7, 8, 18, 1, 12, 15, 10} {
		ls[i].Release()
		ls[i].Release() // a second release does nothing
	}
	r.mu.Lock()
	held := r.heldBy[r.key("p")]
	for i, l := range held {
		if l.at != i {
			t.Errorf("lease %s at %d says %d", l.member, i, l.at)
		}
	}
	r.mu.Unlock()
	if len(held) != 10 {
		t.Fatalf("%d leases held, want 10", len(held))
	}
	for deadline := time.Now().Add(redisWait); srv.MustCLI("ZCARD", "sse:lease:{p}") != "10"; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("Redis holds %s leases, want 10", srv.MustCLI("ZCARD", "sse:lease:{p}"))
		}
	}
}

// BenchmarkRedisLeaseAcquire: a principal's streams starting and ending
// (an Acquire and a Release of a lease), 128 at a time, while this
// instance holds held other leases of the same principal.
func BenchmarkRedisLeaseAcquire(b *testing.B) {
	for _, held := range []int{0, 1000, 5000} {
		b.Run("held="+strconv.Itoa(held), func(b *testing.B) {
			srv := redistest.Start(b)
			r := NewRedisLeases(newTestRedis(b, srv))
			defer r.Close()
			ctx := context.Background()
			for range held {
				if _, err := r.Acquire(ctx, "p", 0, time.Minute); err != nil {
					b.Fatal(err)
				}
			}
			b.SetParallelism(64)
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					l, err := r.Acquire(ctx, "p", 0, time.Minute)
					if err != nil {
						b.Error(err)
						return
					}
					l.Release()
				}
			})
		})
	}
}

// ReleaseThen calls back once Redis no longer holds the lease: a stream
// told to reconnect says so only then (its client may come back through
// another instance at once). Also for a lease released before, and for one
// released after the leases were closed (their removal is done by then).
func TestRedisLeaseReleaseThenCallsBackOnceRedisHasItNoMore(t *testing.T) {
	srv := redistest.Start(t)
	r := NewRedisLeases(newTestRedis(t, srv))
	ls := acquireN(t, r, "p", 3, 0)
	calledBack := func(l Lease, what string) {
		t.Helper()
		// Redis holds writes (the removal) for a moment, and answers reads
		// (the callback's ZSCORE): a callback before the removal sees it
		srv.MustCLI("CLIENT", "PAUSE", "200", "WRITE")
		done := make(chan string, 1)
		l.(ReleaseNotifier).ReleaseThen(func() { done <- srv.MustCLI("ZSCORE", "sse:lease:{p}", l.(*redisLease).member) })
		select {
		case score := <-done:
			if score != "" {
				t.Fatalf("%s: called back while Redis still holds the lease (score %q)", what, score)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: never called back", what)
		}
	}
	calledBack(ls[0], "a held lease")
	calledBack(ls[0], "a lease released before")

	// a removal under way for longer than lateRemoval (Redis hangs): the
	// next ReleaseThen calls back at once, and its lease is still released
	srv.MustCLI("CLIENT", "PAUSE", "1500", "WRITE")
	ls[2].Release()
	time.Sleep(lateRemoval + 200*time.Millisecond) // the removal of ls[2] is late by now
	done := make(chan struct{})
	ls[1].(ReleaseNotifier).ReleaseThen(func() { close(done) })
	select {
	case <-done:
	case <-time.After(lateRemoval):
		t.Fatal("ReleaseThen waited for a removal under way while the one before was late")
	}
	member := ls[1].(*redisLease).member
	deadline := time.Now().Add(10 * time.Second)
	for srv.MustCLI("ZSCORE", "sse:lease:{p}", member) != "" {
		if time.Now().After(deadline) {
			t.Fatal("the lease released while a removal was late was never removed")
		}
		time.Sleep(50 * time.Millisecond)
	}
	ls = append(ls, acquireN(t, r, "p", 1, 0)...)
	r.Close()
	calledBack(ls[3], "a lease released after the leases were closed")
	if n := srv.MustCLI("ZCARD", "sse:lease:{p}"); n != "0" {
		t.Fatalf("Redis holds %s leases after Close, want 0", n)
	}
}

// A primary of a Redis Cluster that stops answering (hung, partitioned;
// the cluster does not fail it over yet) holds up the renewals of the
// leases it holds, not those of the leases on the other primaries: the
// one pipeline that renews them all waited for the hung one (go-redis'
// retries, up to the renewal's 10 s), and the next renewal came a period
// after it gave up, so the leases on the primaries that answer lapsed and
// another instance let their principals past their caps (with the
// defaults, lease_ttl 15 s and read_timeout 3 s, as here scaled down).
// The same when the primary that answers has lost the lease scripts too (a
// replica just promoted, SCRIPT FLUSH): the renewal's pipeline of EVALSHA
// gets NOSCRIPT from it and nothing from the hung one; its leases are sent
// again with EVAL, within their ttl.
func TestRedisLeasesOnHealthyPrimariesOutliveAHungOne(t *testing.T) {
	for _, scriptsLost := range []bool{false, true} {
		t.Run(map[bool]string{false: "scripts kept", true: "scripts lost"}[scriptsLost], func(t *testing.T) {
			leasesOutliveAHungPrimary(t, scriptsLost)
		})
	}
}

func leasesOutliveAHungPrimary(t *testing.T, scriptsLost bool) {
	cluster := redistest.StartCluster(t, 3)
	healthy, hung := channelInSlot(t, 100), channelInSlot(t, 16000) // lease keys are named like channels' keys
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
	const ttl = 3 * time.Second // renewed every second
	for _, p := range []string{healthy, hung} {
		if _, err := r.Acquire(ctx, p, 1, ttl); err != nil {
			t.Fatalf("%s: %v", p, err)
		}
	}
	if n, err := other.Held(ctx, healthy); err != nil || n != 1 { // and other has read the slots
		t.Fatalf("the other instance counts %d leases (%v), want 1", n, err)
	}
	const pause = 3 * ttl
	if scriptsLost {
		healthyNode.MustCLI("SCRIPT", "FLUSH")
	}
	hungNode.MustCLI("CLIENT", "PAUSE", strconv.Itoa(int(pause.Milliseconds())), "ALL")
	paused := time.Now()
	for time.Since(paused) < pause-time.Second {
		l, err := other.Acquire(ctx, healthy, 1, ttl)
		if err == nil {
			l.Release()
			t.Fatalf("%v after another primary stopped answering, another instance took a second lease for a cap of 1 on a primary that answers",
				time.Since(paused).Round(time.Millisecond))
		}
		if !errors.Is(err, ErrLimitReached) && !errors.Is(err, ErrUnavailable) { // go-redis may ask the hung one for the slots
			t.Fatalf("after %v: %v", time.Since(paused).Round(time.Millisecond), err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
