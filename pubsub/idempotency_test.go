package pubsub

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// testClock is injected into Idempotency.now. It also counts its calls:
// every Do reads it once per claim, under the store's lock, so a test can
// wait until a number of callers have claimed (and are waiting) without
// sleeping.
type testClock struct {
	mu    sync.Mutex
	t     time.Time
	calls atomic.Int64
}

func (c *testClock) Now() time.Time {
	c.calls.Add(1)
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *testClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// waitCalls waits until the clock was read n times.
func (c *testClock) waitCalls(t *testing.T, n int64) {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for c.calls.Load() < n {
		if time.Now().After(deadline) {
			t.Fatalf("timed out: %d claims, want %d", c.calls.Load(), n)
		}
		time.Sleep(time.Millisecond)
	}
}

func newTestIdempotency() (*Idempotency, *testClock) {
	clock := &testClock{t: time.UnixMilli(1_700_000_000_000)}
	o := NewIdempotency()
	o.now = clock.Now
	return o, clock
}

// countingPublish returns a publish func that counts its runs and replies
// with reply.
func countingPublish(runs *atomic.Int32, reply string) func() ([]byte, error) {
	return func() ([]byte, error) {
		runs.Add(1)
		return []byte(reply), nil
	}
}

// do calls o.Do with a deadline, so that a wrongly waiting call fails the
// test instead of hanging it.
func do(t *testing.T, o *Idempotency, key, fp string, publish func() ([]byte, error)) (string, bool, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	reply, replayed, err := o.Do(ctx, key, fp, publish)
	if errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Do(%q, %q) was still waiting after %v", key, fp, waitTimeout)
	}
	return string(reply), replayed, err
}

func TestIdempotencyReplaysTheFirstReply(t *testing.T) {
	o, _ := newTestIdempotency()
	var runs atomic.Int32
	reply, replayed, err := do(t, o, "k", "fp", countingPublish(&runs, "first"))
	if err != nil || replayed || reply != "first" {
		t.Fatalf("first Do = %q, %v, %v; want first, false, nil", reply, replayed, err)
	}
	reply, replayed, err = do(t, o, "k", "fp", countingPublish(&runs, "second"))
	if err != nil || !replayed || reply != "first" {
		t.Errorf("retry = %q, %v, %v; want the first reply, replayed", reply, replayed, err)
	}
	if n := runs.Load(); n != 1 {
		t.Errorf("publish ran %d times, want 1", n)
	}
}

func TestIdempotencyKeysAreIndependent(t *testing.T) {
	o, _ := newTestIdempotency()
	var runs atomic.Int32
	do(t, o, "k1", "fp", countingPublish(&runs, "one"))
	reply, replayed, err := do(t, o, "k2", "fp", countingPublish(&runs, "two"))
	if err != nil || replayed || reply != "two" || runs.Load() != 2 {
		t.Errorf("another key = %q, %v, %v after %d runs; want a fresh publish", reply, replayed, err, runs.Load())
	}
}

func TestIdempotencyKeyReusedWithAnotherRequest(t *testing.T) {
	o, _ := newTestIdempotency()
	var runs atomic.Int32
	do(t, o, "k", "fp1", countingPublish(&runs, "first"))
	reply, replayed, err := do(t, o, "k", "fp2", countingPublish(&runs, "other"))
	if !errors.Is(err, ErrKeyReused) || reply != "" || replayed {
		t.Errorf("Do with another fingerprint = %q, %v, %v; want ErrKeyReused", reply, replayed, err)
	}
	if n := runs.Load(); n != 1 {
		t.Errorf("publish ran %d times, want 1", n)
	}
	// The original request still replays.
	if reply, replayed, _ := do(t, o, "k", "fp1", countingPublish(&runs, "x")); reply != "first" || !replayed {
		t.Errorf("original request after a reuse = %q, %v", reply, replayed)
	}
}

// A reused key is refused even while the first request is still publishing.
func TestIdempotencyKeyReusedWhileInFlight(t *testing.T) {
	o, _ := newTestIdempotency()
	entered, release := make(chan struct{}), make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		o.Do(context.Background(), "k", "fp1", func() ([]byte, error) {
			close(entered)
			<-release
			return []byte("first"), nil
		})
	}()
	waitClosedT(t, entered)
	_, _, err := do(t, o, "k", "fp2", func() ([]byte, error) { t.Error("published"); return nil, nil })
	if !errors.Is(err, ErrKeyReused) {
		t.Errorf("Do with another fingerprint while in flight = %v, want ErrKeyReused", err)
	}
	close(release)
	waitClosedT(t, done)
}

func TestIdempotencyForgetsFailedPublish(t *testing.T) {
	o, _ := newTestIdempotency()
	boom := errors.New("boom")
	reply, replayed, err := do(t, o, "k", "fp", func() ([]byte, error) { return nil, boom })
	if !errors.Is(err, boom) || replayed || reply != "" {
		t.Fatalf("failing Do = %q, %v, %v; want boom", reply, replayed, err)
	}
	var runs atomic.Int32
	reply, replayed, err = do(t, o, "k", "fp", countingPublish(&runs, "ok"))
	if err != nil || replayed || reply != "ok" || runs.Load() != 1 {
		t.Fatalf("retry after failure = %q, %v, %v (%d runs); want a fresh publish", reply, replayed, err, runs.Load())
	}
	if reply, replayed, _ := do(t, o, "k", "fp", countingPublish(&runs, "again")); reply != "ok" || !replayed {
		t.Errorf("third call = %q, %v; want the successful reply replayed", reply, replayed)
	}
	// After a failure the key is free for any request.
	do(t, o, "k2", "fp", func() ([]byte, error) { return nil, boom })
	if _, _, err := do(t, o, "k2", "other", countingPublish(&runs, "x")); err != nil {
		t.Errorf("another request on a failed key = %v, want it to run", err)
	}
}

// Callers racing with one key: publish runs once, and everyone gets its
// reply. The clock's call count proves all callers claimed while the first
// publish was still running, so they really waited.
func TestIdempotencyConcurrentCallersPublishOnce(t *testing.T) {
	o, clock := newTestIdempotency()
	const callers = 50
	var runs atomic.Int32
	release := make(chan struct{})
	publish := func() ([]byte, error) {
		runs.Add(1)
		<-release
		return []byte("the reply"), nil
	}

	type result struct {
		reply    string
		replayed bool
		err      error
	}
	results := make(chan result, callers)
	for range callers {
		go func() {
			reply, replayed, err := o.Do(context.Background(), "k", "fp", publish)
			results <- result{string(reply), replayed, err}
		}()
	}
	clock.waitCalls(t, callers)
	close(release)

	fresh := 0
	for range callers {
		var r result
		select {
		case r = <-results:
		case <-time.After(waitTimeout):
			t.Fatal("a caller did not return")
		}
		if r.err != nil || r.reply != "the reply" {
			t.Errorf("caller got %q, %v", r.reply, r.err)
		}
		if !r.replayed {
			fresh++
		}
	}
	if n := runs.Load(); n != 1 {
		t.Errorf("publish ran %d times, want 1", n)
	}
	if fresh != 1 {
		t.Errorf("%d callers got a non-replayed reply, want exactly the one that published", fresh)
	}
}

// When the first publish fails while others wait, one waiter publishes
// again and the rest get that reply.
func TestIdempotencyWaitersRetryAfterFailure(t *testing.T) {
	o, clock := newTestIdempotency()
	const callers = 20
	var runs atomic.Int32
	release := make(chan struct{})
	publish := func() ([]byte, error) {
		if runs.Add(1) == 1 {
			<-release
			return nil, errors.New("first attempt fails")
		}
		return []byte("second"), nil
	}
	errs := make(chan error, callers)
	replies := make(chan string, callers)
	for range callers {
		go func() {
			reply, _, err := o.Do(context.Background(), "k", "fp", publish)
			errs <- err
			replies <- string(reply)
		}()
	}
	clock.waitCalls(t, callers)
	close(release)

	failed := 0
	for range callers {
		select {
		case err := <-errs:
			reply := <-replies
			if err != nil {
				failed++
			} else if reply != "second" {
				t.Errorf("reply %q, want second", reply)
			}
		case <-time.After(waitTimeout):
			t.Fatal("a caller did not return")
		}
	}
	if failed != 1 {
		t.Errorf("%d callers failed, want only the first", failed)
	}
	if n := runs.Load(); n != 2 {
		t.Errorf("publish ran %d times, want 2 (the failure and one retry)", n)
	}
}

func TestIdempotencyWaiterHonoursContext(t *testing.T) {
	o, clock := newTestIdempotency()
	release := make(chan struct{})
	firstDone := make(chan struct{})
	go func() {
		defer close(firstDone)
		o.Do(context.Background(), "k", "fp", func() ([]byte, error) {
			<-release
			return []byte("first"), nil
		})
	}()
	clock.waitCalls(t, 1)

	ctx, cancel := context.WithCancel(context.Background())
	waiterDone := make(chan error, 1)
	go func() {
		_, _, err := o.Do(ctx, "k", "fp", func() ([]byte, error) { t.Error("waiter published"); return nil, nil })
		waiterDone <- err
	}()
	clock.waitCalls(t, 2) // the waiter has claimed and is waiting
	cancel()
	select {
	case err := <-waiterDone:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("cancelled waiter = %v, want context.Canceled", err)
		}
	case <-time.After(waitTimeout):
		t.Fatal("cancelled waiter did not return")
	}
	close(release)
	waitClosedT(t, firstDone)

	// The first reply is still there for the next retry.
	if reply, replayed, _ := do(t, o, "k", "fp", nil); reply != "first" || !replayed {
		t.Errorf("after the cancelled wait: %q, %v; want the first reply", reply, replayed)
	}
}

func TestIdempotencyEntriesExpire(t *testing.T) {
	o, clock := newTestIdempotency()
	var runs atomic.Int32
	do(t, o, "k", "fp", countingPublish(&runs, "first"))

	clock.Advance(IdempotencyTTL - time.Nanosecond)
	if reply, replayed, _ := do(t, o, "k", "fp", countingPublish(&runs, "x")); reply != "first" || !replayed {
		t.Errorf("just before the TTL: %q, %v; want the first reply", reply, replayed)
	}
	clock.Advance(time.Nanosecond)
	reply, replayed, err := do(t, o, "k", "other fingerprint", countingPublish(&runs, "second"))
	if err != nil || replayed || reply != "second" {
		t.Errorf("at the TTL: %q, %v, %v; want the key free again", reply, replayed, err)
	}
	if n := runs.Load(); n != 2 {
		t.Errorf("publish ran %d times, want 2", n)
	}
	// The expired entry is gone from both the map and the expiry order.
	if len(o.entries) != 1 || len(o.order) != 1 {
		t.Errorf("store holds %d entries, %d in order; want the live one only", len(o.entries), len(o.order))
	}
}

// The TTL counts from the first use: replays do not keep an entry alive.
func TestIdempotencyReplaysDoNotExtendTTL(t *testing.T) {
	o, clock := newTestIdempotency()
	var runs atomic.Int32
	do(t, o, "k", "fp", countingPublish(&runs, "first"))
	for range 3 {
		clock.Advance(IdempotencyTTL / 3)
		do(t, o, "k", "fp", countingPublish(&runs, "again"))
	}
	if n := runs.Load(); n != 2 {
		t.Errorf("publish ran %d times over 1 TTL of replays, want 2", n)
	}
}

// A flood of keys must not grow the store past its bound: the oldest are
// dropped first.
func TestIdempotencySizeBound(t *testing.T) {
	if testing.Short() {
		t.Skip("fills the store")
	}
	o, _ := newTestIdempotency()
	var runs atomic.Int32
	ok := countingPublish(&runs, "r")
	for i := range maxIdempotencyEntries + 10 {
		if _, _, err := o.Do(context.Background(), fmt.Sprint("key-", i), "fp", ok); err != nil {
			t.Fatal(err)
		}
	}
	if n := len(o.entries); n > maxIdempotencyEntries+1 {
		t.Errorf("store holds %d entries, bound is %d", n, maxIdempotencyEntries)
	}
	if n := len(o.order); n > maxIdempotencyEntries+1 {
		t.Errorf("order holds %d entries, bound is %d", n, maxIdempotencyEntries)
	}
	before := runs.Load()
	if _, replayed, _ := do(t, o, "key-0", "fp", ok); replayed || runs.Load() != before+1 {
		t.Error("the oldest key is still remembered past the bound")
	}
	if _, replayed, _ := do(t, o, fmt.Sprint("key-", maxIdempotencyEntries+9), "fp", ok); !replayed {
		t.Error("the newest key was forgotten")
	}
}

// A publish that panics must not wedge its key: the HTTP server recovers
// the panic, and a retry must not wait for a reply that will never come.
func TestIdempotencyPanickingPublishDoesNotWedgeTheKey(t *testing.T) {
	o, _ := newTestIdempotency()
	func() {
		defer func() { recover() }()
		o.Do(context.Background(), "k", "fp", func() ([]byte, error) { panic("broker bug") })
	}()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	var runs atomic.Int32
	reply, _, err := o.Do(ctx, "k", "fp", countingPublish(&runs, "ok"))
	if err != nil || string(reply) != "ok" {
		t.Errorf("retry after a panicking publish = %q, %v; want a fresh publish", reply, err)
	}
}

func waitClosedT(t *testing.T, ch <-chan struct{}) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(waitTimeout):
		t.Fatal("timed out")
	}
}
