package pubsub

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/internal/waitfor"
	"github.com/caddy-sse/caddy-sse/replay"
)

func newTestRedis(t testing.TB, srv *redistest.Server) *Redis {
	t.Helper()
	b, err := NewRedis(RedisOptions{Addrs: []string{srv.Addr()}}, func(string, *replay.Event) {})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	return b
}

// Two instances race 20 connects for a cap of 2: exactly 2 win.
func TestRedisLeasesCapAcrossInstances(t *testing.T) {
	srv := redistest.Start(t)
	a, b := NewRedisLeases(newTestRedis(t, srv)), NewRedisLeases(newTestRedis(t, srv))
	defer a.Close()
	defer b.Close()
	var won atomic.Int32
	var wg sync.WaitGroup
	for i := range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			leases := a
			if i%2 == 1 {
				leases = b
			}
			_, err := leases.Acquire(context.Background(), "wallet-1", 2, 5*time.Second)
			switch {
			case err == nil:
				won.Add(1)
			case !errors.Is(err, ErrLimitReached):
				t.Errorf("acquire: %v", err)
			}
		}()
	}
	wg.Wait()
	if won.Load() != 2 {
		t.Fatalf("%d leases granted for a cap of 2", won.Load())
	}
	counts, err := a.Counts(context.Background(), []string{"wallet-1", "nobody"})
	if err != nil || counts["wallet-1"] != 2 || counts["nobody"] != 0 {
		t.Fatalf("counts %v %v", counts, err)
	}
}

func TestRedisLeaseReleaseAndLapse(t *testing.T) {
	srv := redistest.Start(t)
	a := NewRedisLeases(newTestRedis(t, srv))
	defer a.Close()
	l, err := a.Acquire(context.Background(), "p", 1, 600*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	l.Release()
	waitLease(t, a, "p", 1) // released in the background: the slot frees up

	// an instance that dies without releasing: its lease lapses within ttl,
	// while a living instance's lease is renewed beyond its ttl
	dead := NewRedisLeases(newTestRedis(t, srv))
	if _, err := dead.Acquire(context.Background(), "q", 2, 600*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	close(dead.stop) // stop renewing, release nothing: as if killed
	if _, err := a.Acquire(context.Background(), "q", 2, 600*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Acquire(context.Background(), "q", 2, 600*time.Millisecond); !errors.Is(err, ErrLimitReached) {
		t.Fatalf("third lease for a cap of 2: %v", err)
	}
	waitLease(t, a, "q", 2) // the dead one lapses; a's own is renewed
	counts, _ := a.Counts(context.Background(), []string{"q"})
	if counts["q"] != 2 {
		t.Fatalf("after the lapse q holds %d leases, want 2 (the living instance's are renewed)", counts["q"])
	}
}

// Streams of other principals that come and go more often than the
// renewal period must not put the renewal off: the held lease would lapse
// and the cap let a second stream in.
func TestRedisLeaseRenewedWhileOthersComeAndGo(t *testing.T) {
	srv := redistest.Start(t)
	r := NewRedisLeases(newTestRedis(t, srv))
	defer r.Close()
	ctx := context.Background()
	const ttl = 600 * time.Millisecond
	if _, err := r.Acquire(ctx, "p", 1, ttl); err != nil {
		t.Fatal(err)
	}
	for end := time.Now().Add(4 * ttl); time.Now().Before(end); time.Sleep(ttl / 12) {
		l, err := r.Acquire(ctx, "churn", 0, ttl)
		if err != nil {
			t.Fatal(err)
		}
		l.Release()
	}
	if _, err := r.Acquire(ctx, "p", 1, ttl); !errors.Is(err, ErrLimitReached) {
		t.Fatalf("a second lease for a cap of 1 while the first is held: %v", err)
	}
}

// A lease Redis lost (here a restart without persistence) is put back by
// the next renewal: the stream holding it counts again.
func TestRedisLeaseRestoredAfterRedisLostIt(t *testing.T) {
	srv := redistest.Start(t)
	r := NewRedisLeases(newTestRedis(t, srv))
	defer r.Close()
	ctx := context.Background()
	if _, err := r.Acquire(ctx, "p", 1, 600*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	srv.Kill()
	srv.Restart()
	waitfor.Until(t, "the lease Redis lost to be put back", redisWait, 20*time.Millisecond, func() bool {
		counts, err := r.Counts(ctx, []string{"p"})
		return err == nil && counts["p"] == 1
	})
	if _, err := r.Acquire(ctx, "p", 1, 600*time.Millisecond); !errors.Is(err, ErrLimitReached) {
		t.Fatalf("a second lease for a cap of 1 after the restart: %v", err)
	}
}

// waitLease waits until a lease for principal can be taken with limit.
func waitLease(t *testing.T, r *RedisLeases, principal string, limit int) {
	t.Helper()
	deadline := time.Now().Add(redisWait)
	for time.Now().Before(deadline) {
		if _, err := r.Acquire(context.Background(), principal, limit, 600*time.Millisecond); err == nil {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("no lease for %s within the deadline", principal)
}

func TestRedisThrottlesAcrossInstances(t *testing.T) {
	srv := redistest.Start(t)
	a, b := NewRedisThrottles(newTestRedis(t, srv)), NewRedisThrottles(newTestRedis(t, srv))
	ctx := context.Background()
	if err := a.Throttle(ctx, "user|1.2.3.4", time.Minute); err != nil {
		t.Fatal(err)
	}
	_ = a.Throttle(ctx, "user|1.2.3.4", time.Second) // a shorter one keeps the longer
	left, err := b.Remaining(ctx, "user|1.2.3.4")
	if err != nil || left < 50*time.Second || left > time.Minute {
		t.Fatalf("remaining on the other instance: %v %v", left, err)
	}
	if left, _ := b.Remaining(ctx, "other"); left != 0 {
		t.Fatalf("an unthrottled key has %v left", left)
	}
}

func TestRedisIdempotencyAcrossInstances(t *testing.T) {
	srv := redistest.Start(t)
	a, b := NewRedisIdempotency(newTestRedis(t, srv)), NewRedisIdempotency(newTestRedis(t, srv))
	ctx := context.Background()
	var runs atomic.Int32
	publish := func() ([]byte, error) { runs.Add(1); return []byte(`{"ids":{"a":"x"}}`), nil }
	r1, replayed1, err1 := a.Do(ctx, "k", "fp", publish)
	r2, replayed2, err2 := b.Do(ctx, "k", "fp", publish)
	if err1 != nil || err2 != nil || replayed1 || !replayed2 || string(r1) != string(r2) || runs.Load() != 1 {
		t.Fatalf("first %s %v %v, retry elsewhere %s %v %v, runs %d", r1, replayed1, err1, r2, replayed2, err2, runs.Load())
	}
	if _, _, err := b.Do(ctx, "k", "other", publish); !errors.Is(err, ErrKeyReused) {
		t.Fatalf("reuse with another request: %v", err)
	}
	// a failed publish is forgotten: the retry publishes
	fail := func() ([]byte, error) { return nil, errors.New("boom") }
	if _, _, err := a.Do(ctx, "k2", "fp", fail); err == nil {
		t.Fatal("expected the failure")
	}
	if _, replayed, err := b.Do(ctx, "k2", "fp", publish); err != nil || replayed {
		t.Fatalf("retry after a failure: replayed %v %v", replayed, err)
	}
}

// A publish that takes longer than the pending claim's ttl (wait_replicas
// with a replica down, retries) keeps its claim: a retry with the same key
// waits for it and gets its reply, and nothing is published twice.
func TestRedisIdempotencyClaimOutlivesASlowPublish(t *testing.T) {
	srv := redistest.Start(t)
	a, b := NewRedisIdempotency(newTestRedis(t, srv)), NewRedisIdempotency(newTestRedis(t, srv))
	a.pendingTTL, b.pendingTTL = 300*time.Millisecond, 300*time.Millisecond
	ctx := context.Background()
	var runs atomic.Int32
	started := make(chan struct{})
	slow := func() ([]byte, error) {
		if runs.Add(1) == 1 {
			close(started)
			time.Sleep(4 * a.pendingTTL) // the claim would have lapsed three times over
		}
		return []byte(fmt.Sprintf(`{"run":%d}`, runs.Load())), nil
	}
	first := make(chan []byte, 1)
	go func() {
		reply, _, err := a.Do(ctx, "k", "fp", slow)
		if err != nil {
			t.Error(err)
		}
		first <- reply
	}()
	<-started
	time.Sleep(2 * a.pendingTTL) // the client gave up and retries, on another instance
	retry, replayed, err := b.Do(ctx, "k", "fp", slow)
	if err != nil || !replayed || string(retry) != string(<-first) || runs.Load() != 1 {
		t.Fatalf("retry %s replayed %v %v; publishes %d, want the first reply and 1", retry, replayed, err, runs.Load())
	}
}

// A retry that comes while Redis is unreachable (the first reply was lost,
// then Redis went away) replays the first reply from this instance's
// memory instead of publishing a second time on the local fallback.
func TestRedisIdempotencyRetryDuringAnOutageReplays(t *testing.T) {
	srv := redistest.Start(t)
	b, err := NewRedis(RedisOptions{Addrs: []string{srv.Addr()}, DialTimeout: 200 * time.Millisecond, MaxRetries: -1}, func(string, *replay.Event) {})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	r := NewRedisIdempotency(b)
	ctx := context.Background()
	var runs atomic.Int32
	publish := func() ([]byte, error) { return []byte(fmt.Sprintf(`{"run":%d}`, runs.Add(1))), nil }
	first, _, err := r.Do(ctx, "k", "fp", publish)
	if err != nil {
		t.Fatal(err)
	}
	srv.Kill()
	retry, replayed, err := r.Do(ctx, "k", "fp", publish)
	if err != nil || !replayed || string(retry) != string(first) || runs.Load() != 1 {
		t.Fatalf("retry during the outage: %s replayed %v %v; publishes %d, want the first reply %s and 1", retry, replayed, err, runs.Load(), first)
	}
}

// A hub's throttles answer from memory once they have read the internal
// channel's announcements: a throttle set on one instance reaches the
// others through it (also after their pub/sub connections were killed), an
// instance started later reads it from the history, and looking a client
// up costs no Redis call.
func TestRedisThrottlesFollowAnnouncements(t *testing.T) {
	srv := redistest.Start(t)
	newHub := func() *RedisThrottles {
		return newRedisThrottles(t, RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: 500 * time.Millisecond})
	}
	ctx := context.Background()
	a, b := newHub(), newHub()
	if left, err := b.Remaining(ctx, "user|1.2.3.4"); left != 0 || err != nil {
		t.Fatalf("nobody is throttled yet: %v %v", left, err)
	}
	waitLoaded(t, b)
	srv.WaitShardSubscribers(t, b.b.Key(throttleChannel), 1)

	if err := a.Throttle(ctx, "user|1.2.3.4", time.Minute); err != nil {
		t.Fatal(err)
	}
	waitThrottled(t, b, "user|1.2.3.4")

	pttl := func() string { return commandCalls(srv.MustCLI("INFO", "commandstats"), "cmdstat_pttl") }
	before := pttl()
	for range 100 {
		if left, _ := b.Remaining(ctx, "someone|5.6.7.8"); left != 0 {
			t.Fatalf("an unthrottled key has %v left", left)
		}
	}
	if after := pttl(); after != before {
		t.Fatalf("looking clients up called Redis: PTTL %q → %q", before, after)
	}

	// an instance started later reads the throttle from the history
	c := newHub()
	followLoaded(t, c)
	if left, _ := c.Remaining(ctx, "user|1.2.3.4"); left < 50*time.Second || left > time.Minute {
		t.Fatalf("an instance started later: %v left, want about a minute", left)
	}

	// announcements missed while the pub/sub connections were down are
	// repaired from the channel's stream
	srv.MustCLI("CLIENT", "KILL", "TYPE", "pubsub")
	if err := a.Throttle(ctx, "other|1.2.3.4", time.Minute); err != nil {
		t.Fatal(err)
	}
	waitThrottled(t, b, "other|1.2.3.4")
	waitThrottled(t, c, "other|1.2.3.4")
}

// followLoaded has r follow the announcements (its first lookup) and
// waits until they are loaded.
func followLoaded(t *testing.T, r *RedisThrottles) {
	t.Helper()
	_, _ = r.Remaining(context.Background(), "x")
	waitLoaded(t, r)
}

func waitLoaded(t *testing.T, r *RedisThrottles) {
	t.Helper()
	waitLoadedEvery(t, r, 10*time.Millisecond)
}

// waitLoadedEvery looks every pause (or without pausing, if 0: it returns
// as soon as the load is done) until the announcements are loaded.
func waitLoadedEvery(t *testing.T, r *RedisThrottles, pause time.Duration) {
	t.Helper()
	deadline := time.Now().Add(redisWait)
	for {
		r.mu.Lock()
		loaded := r.loaded
		r.mu.Unlock()
		if loaded {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the throttle announcements were not loaded")
		}
		if pause == 0 {
			runtime.Gosched()
		} else {
			time.Sleep(pause)
		}
	}
}

func waitThrottled(t *testing.T, r *RedisThrottles, key string) {
	t.Helper()
	deadline := time.Now().Add(redisWait)
	for {
		left, err := r.Remaining(context.Background(), key)
		if err == nil && left > 50*time.Second && left <= time.Minute {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %v left (%v), want about a minute", key, left, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// commandCalls returns the calls= field of a command's INFO commandstats
// line.
func commandCalls(info, stat string) string {
	return strings.SplitN(strings.TrimPrefix(strings.TrimSpace(commandLine(info, stat)), stat+":"), ",", 2)[0]
}

// Acquire removes the leases this instance released and has not removed
// yet (releasedOf), so that an immediate reconnect is not refused by the
// lease of the stream it replaces — also while flushReleases is removing
// them (it once took them out of sight before its ZREMs had run).
func TestRedisLeaseAcquireRightAfterReleaseIsNotRefused(t *testing.T) {
	srv := redistest.Start(t)
	r := NewRedisLeases(newTestRedis(t, srv))
	defer r.Close()
	ctx := context.Background()
	l, err := r.Acquire(ctx, "p", 1, 15*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	refused := 0
	const rounds = 3000
	for range rounds {
		l.Release()
		var next Lease
		for {
			next, err = r.Acquire(ctx, "p", 1, 15*time.Second)
			if err == nil {
				break
			}
			if !errors.Is(err, ErrLimitReached) {
				t.Fatal(err)
			}
			refused++
			time.Sleep(time.Millisecond)
		}
		l = next
	}
	if refused > 0 {
		t.Fatalf("%d of %d acquires right after the release of the principal's only lease were refused", refused, rounds)
	}
}

// The same interleaving, made deterministic: maintain is kept from
// starting, and the test plays flushReleases' part: it takes the released
// leases, acquires, then removes them.
func TestRedisLeaseAcquireDuringTheRemovalOfReleasesIsNotRefused(t *testing.T) {
	srv := redistest.Start(t)
	r := NewRedisLeases(newTestRedis(t, srv))
	r.running = true // no maintain: the test plays its part
	ctx := context.Background()
	l, err := r.Acquire(ctx, "p", 1, 15*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	l.Release()
	// flushReleases, first half: the list is taken, the ZREMs not yet sent
	taken := r.takeReleased()
	_, err = r.Acquire(ctx, "p", 1, 15*time.Second)
	// flushReleases, second half
	for key, ls := range taken {
		for _, old := range ls {
			srv.MustCLI("ZREM", key, old.member)
		}
	}
	r.removed()
	if err != nil {
		t.Fatalf("an acquire while the release of the principal's only lease was being flushed: %v", err)
	}
}

// An instance that starts while another throttles clients learns every
// throttle: those announced before its subscription to the internal
// channel was confirmed come from the history, which it reads once its
// watch of the channel has had its first sync (a sync covers what it read
// the head of, and delivers only the newest of those). Each round races a
// new instance's start against two announcements.
func TestRedisThrottlesAnnouncedWhileAnInstanceStarts(t *testing.T) {
	srv := redistest.Start(t)
	newHub := func() *RedisThrottles {
		return newRedisThrottles(t, RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: time.Hour})
	}
	ctx := context.Background()
	a := newHub()
	for round := range 20 {
		b := newHub()
		b.following()
		// announce right after b read the history, which may be before its
		// subscription is confirmed
		waitLoadedEvery(t, b, 0)
		first, second := fmt.Sprint("first|", round), fmt.Sprint("second|", round)
		if err := a.Throttle(ctx, first, time.Minute); err != nil {
			t.Fatal(err)
		}
		if err := a.Throttle(ctx, second, time.Minute); err != nil {
			t.Fatal(err)
		}
		for _, key := range []string{first, second} {
			waitThrottled(t, b, key)
		}
	}
}

// The streams of a burst at start look clients up once the announcements
// are loaded, not each with a Redis call of its own (which made go-redis
// open its whole pool).
func TestRedisThrottlesBurstAtStartWaitsForTheLoad(t *testing.T) {
	srv := redistest.Start(t)
	r := newRedisThrottles(t, RedisOptions{Addrs: []string{srv.Addr()}})
	pttl := func() string { return commandCalls(srv.MustCLI("INFO", "commandstats"), "cmdstat_pttl") }
	before := pttl()
	var wg sync.WaitGroup
	for range 200 {
		wg.Go(func() {
			if left, err := r.Remaining(context.Background(), "someone|5.6.7.8"); left != 0 || err != nil {
				t.Errorf("an unthrottled key: %v %v", left, err)
			}
		})
	}
	wg.Wait()
	if after := pttl(); after != before {
		t.Fatalf("the burst called Redis: PTTL %q → %q", before, after)
	}
	if clients := strings.Count(srv.MustCLI("CLIENT", "LIST"), "\n"); clients > 6 {
		t.Fatalf("%d connections to Redis after the burst", clients)
	}
}

// twoThrottleInstances starts two hubs' throttles on srv (checks every
// 200ms), b's as the ACL user "b", whose permissions the test may take
// away, and waits until b's are loaded and subscribed.
func twoThrottleInstances(t *testing.T, srv *redistest.Server) (a, b *RedisThrottles) {
	t.Helper()
	srv.MustCLI("ACL", "SETUSER", "b", "on", ">secret", "~*", "&*", "+@all")
	newHub := func(opts RedisOptions) *RedisThrottles {
		opts.Addrs, opts.CheckInterval = []string{srv.Addr()}, 200*time.Millisecond
		return newRedisThrottles(t, opts)
	}
	a, b = newHub(RedisOptions{}), newHub(RedisOptions{Username: "b", Password: "secret"})
	_, _ = b.Remaining(context.Background(), "x")
	waitLoaded(t, b)
	srv.WaitShardSubscribers(t, b.b.Key(throttleChannel), 1)
	return a, b
}

// The throttles follow their channel as a bare hub subscriber: they do not
// notice gaps. An announcement this instance missed (its pub/sub
// connection was replaced) is repaired from the history, but while the
// history cannot be read (here an ACL; in production a timeout, BUSY, a
// pool wait) the next announcement is delivered and moves the watch's last
// position past the missed one. Nothing delivers it afterwards: the checks
// find head == last.
func TestRedisThrottleMissedWhileARepairFailsIsApplied(t *testing.T) {
	srv := redistest.Start(t)
	a, b := twoThrottleInstances(t, srv)
	ctx := context.Background()
	waitSynced(t, b.b, throttleChannel)
	// a follows the announcements too, from now on: both subscriptions are
	// counted below (a's made by its first throttle could be counted
	// before b's was made again, and a wait for b's alone then missed it)
	followLoaded(t, a)
	key := b.b.Key(throttleChannel)
	srv.WaitShardSubscribers(t, key, 2)

	// b cannot read the channel's history for a while
	srv.MustCLI("ACL", "SETUSER", "b", "resetkeys", "~sse:throttle:*")
	srv.MustCLI("CLIENT", "KILL", "TYPE", "pubsub")
	if err := a.Throttle(ctx, "missed|1.2.3.4", time.Minute); err != nil { // while b resubscribes
		t.Fatal(err)
	}
	srv.WaitShardSubscribers(t, key, 2)
	time.Sleep(300 * time.Millisecond) // b's checks run, and fail
	if err := a.Throttle(ctx, "next|1.2.3.4", time.Minute); err != nil {
		t.Fatal(err)
	}
	waitThrottled(t, b, "next|1.2.3.4")
	srv.MustCLI("ACL", "SETUSER", "b", "~*") // b reads again

	waitThrottled(t, b, "missed|1.2.3.4") // a check finds it, within a few intervals
}

// A repair delivers at most RepairLimit events, the newest: streams notice
// the hole before them and read it themselves, the throttles never learn
// the older announcements.
func TestRedisThrottlesBeyondTheRepairLimitAreApplied(t *testing.T) {
	srv := redistest.Start(t)
	newHub := func(opts RedisOptions) *RedisThrottles {
		opts.Addrs, opts.CheckInterval = []string{srv.Addr()}, 200*time.Millisecond
		return newRedisThrottles(t, opts)
	}
	ctx := context.Background()
	a, b := newHub(RedisOptions{}), newHub(RedisOptions{RepairLimit: 2})
	followLoaded(t, b)
	srv.WaitShardSubscribers(t, b.b.Key(throttleChannel), 1)
	waitSynced(t, b.b, throttleChannel)

	srv.MustCLI("CLIENT", "KILL", "TYPE", "pubsub") // b resubscribes after a 50 ms backoff
	keys := []string{"k1|1.2.3.4", "k2|1.2.3.4", "k3|1.2.3.4", "k4|1.2.3.4", "k5|1.2.3.4"}
	for _, key := range keys {
		if err := a.Throttle(ctx, key, time.Minute); err != nil {
			t.Fatal(err)
		}
	}
	for _, key := range keys { // the older ones found by a check, within a few intervals
		waitThrottled(t, b, key)
	}
}

// The throttles learn other instances' throttles from announcements on a
// shard channel. While Redis refuses this instance that subscription (an
// ACL changed to take SSUBSCRIBE away), none arrives: a lookup asks Redis,
// rather than answer from what it loaded before the refusal (a client
// another instance throttled meanwhile was let in).
func TestRedisThrottlesAskRedisWhileTheirSubscriptionIsRefused(t *testing.T) {
	srv := redistest.Start(t)
	a, b := twoThrottleInstances(t, srv)
	ctx := context.Background()

	srv.MustCLI("ACL", "SETUSER", "b", "-ssubscribe")
	srv.MustCLI("CLIENT", "KILL", "USER", "b") // its subscription is made again, and refused
	pollUntil(t, "the refused subscription of the announcements to be noticed", func() bool { return b.b.watch.denied(b.b.Key(throttleChannel)) })
	if err := a.Throttle(ctx, "k|1.2.3.4", time.Minute); err != nil {
		t.Fatal(err)
	}
	if left, err := b.Remaining(ctx, "k|1.2.3.4"); err != nil || left < 50*time.Second {
		t.Fatalf("a throttle of another instance while the announcements' subscription is refused: %v left (%v), want about a minute", left, err)
	}
}

// A slow client that an instance throttles while Redis has been down since
// the instance started (its announcements never loaded) is refused by that
// instance for the throttle's time, as it is when Redis goes down later:
// the throttle fails open on the other instances only, which cannot know it.
// The lookup used to ask the unreachable Redis alone and admit the client.
func TestRedisThrottleOfThisInstanceAppliesWhileRedisIsDownSinceStart(t *testing.T) {
	hub, err := NewRedisHub(RedisOptions{
		Addrs:       []string{fmt.Sprintf("127.0.0.1:%d", redistest.FreePort(t))}, // nothing listens there
		DialTimeout: 300 * time.Millisecond,
		MaxRetries:  -1,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = hub.Close() })
	throttles := hub.Throttles()
	ctx := context.Background()
	if err := throttles.Throttle(ctx, "k|1.2.3.4", time.Minute); err == nil {
		t.Fatal("throttling in a Redis that is down: no error")
	}
	if left, err := throttles.Remaining(ctx, "k|1.2.3.4"); left < 50*time.Second {
		t.Fatalf("the throttle this instance set while Redis is down: %v left (%v), want about a minute", left, err)
	}
	if left, err := throttles.Remaining(ctx, "k|5.6.7.8"); left != 0 || err == nil {
		t.Fatalf("another client while Redis is down: %v left (%v), want none and Redis' error (the caller fails open)", left, err)
	}
}

// Held counts a principal's live leases across instances without taking
// one: another instance's count, a lapsed lease not, and a lease released
// here whose removal has not run yet not either (maintain is kept from
// starting, so the release stays pending).
func TestRedisLeasesHeldCountsWithoutTaking(t *testing.T) {
	srv := redistest.Start(t)
	here := NewRedisLeases(newTestRedis(t, srv))
	here.running = true // no maintain: releases stay pending
	other := NewRedisLeases(newTestRedis(t, srv))
	defer other.Close()
	ctx := context.Background()
	if _, err := other.Acquire(ctx, "p", 0, 15*time.Second); err != nil {
		t.Fatal(err)
	}
	kept, err := here.Acquire(ctx, "p", 0, 15*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	released, err := here.Acquire(ctx, "p", 0, 15*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	released.Release()
	key := here.key("p")
	srv.MustCLI("ZADD", key, "1", "lapsed-instance:1")
	if n := srv.MustCLI("ZCARD", key); n != "4" {
		t.Fatalf("%s members, want 4 (the pending release and the lapsed lease still in the set)", n)
	}
	if n, err := here.Held(ctx, "p"); err != nil || n != 2 {
		t.Fatalf("held %d, %v; want 2 (one lease here, one on the other instance)", n, err)
	}
	if n := srv.MustCLI("ZCARD", key); n != "4" {
		t.Fatalf("Held wrote to the set: %s members", n)
	}
	if n, err := here.Held(ctx, "nobody"); err != nil || n != 0 {
		t.Fatalf("held by nobody: %d, %v", n, err)
	}
	kept.Release()
	srv.Kill()
	if _, err := here.Held(ctx, "p"); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("held with Redis gone: %v, want ErrUnavailable", err)
	}
}

// newRedisThrottles returns the throttles of a new Redis hub with opts,
// closed at the test's end.
func newRedisThrottles(t *testing.T, opts RedisOptions) *RedisThrottles {
	t.Helper()
	hub, err := NewRedisHub(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = hub.Close() })
	return hub.Throttles().(*RedisThrottles)
}
