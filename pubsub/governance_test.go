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

// Concurrent acquires never hold more leases than the limit, and every
// released lease makes room for exactly one more.
func TestMemoryLeasesCapConcurrentAcquires(t *testing.T) {
	l := NewMemoryLeases()
	ctx := context.Background()
	const limit, racers = 2, 100
	var admitted atomic.Int32
	var wg sync.WaitGroup
	start := make(chan struct{})
	leases := make(chan Lease, racers)
	for range racers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			lease, err := l.Acquire(ctx, "p", limit, time.Second)
			switch {
			case err == nil:
				admitted.Add(1)
				leases <- lease
			case !errors.Is(err, ErrLimitReached):
				t.Errorf("acquire: %v", err)
			}
		}()
	}
	close(start)
	wg.Wait()
	if n := admitted.Load(); n != limit {
		t.Fatalf("%d leases admitted for a limit of %d", n, limit)
	}
	if _, err := l.Acquire(ctx, "other", limit, time.Second); err != nil {
		t.Fatalf("another principal is capped apart: %v", err)
	}
	first := <-leases
	first.Release()
	first.Release() // a second release gives nothing back
	if _, err := l.Acquire(ctx, "p", limit, time.Second); err != nil {
		t.Fatalf("after a release: %v", err)
	}
	if _, err := l.Acquire(ctx, "p", limit, time.Second); !errors.Is(err, ErrLimitReached) {
		t.Fatalf("a double release made room for two: %v", err)
	}
	if held, _ := l.Held(ctx, "p"); held != limit {
		t.Fatalf("held %d, want %d", held, limit)
	}
}

func TestMemoryLeasesForgetReleasedPrincipals(t *testing.T) {
	l := NewMemoryLeases()
	for i := range 100 {
		lease, err := l.Acquire(context.Background(), fmt.Sprint(i), 1, time.Second)
		if err != nil {
			t.Fatal(err)
		}
		lease.Release()
	}
	if n := len(l.held); n != 0 {
		t.Fatalf("%d principals kept after every lease was released", n)
	}
}

func TestMemoryThrottles(t *testing.T) {
	th := NewMemoryThrottles()
	now := time.Unix(1000, 0)
	th.now = func() time.Time { return now }
	ctx := context.Background()
	if left, _ := th.Remaining(ctx, "a"); left != 0 {
		t.Fatalf("unthrottled key has %v left", left)
	}
	_ = th.Throttle(ctx, "a", 10*time.Second)
	now = now.Add(4 * time.Second)
	if left, _ := th.Remaining(ctx, "a"); left != 6*time.Second {
		t.Fatalf("left %v, want 6s", left)
	}
	_ = th.Throttle(ctx, "a", time.Second) // shorter: the longer one stays
	if left, _ := th.Remaining(ctx, "a"); left != 6*time.Second {
		t.Fatalf("a shorter throttle cut the longer one: %v left", left)
	}
	if left, _ := th.Remaining(ctx, "b"); left != 0 {
		t.Fatalf("another key is throttled: %v", left)
	}
	now = now.Add(6 * time.Second)
	if left, _ := th.Remaining(ctx, "a"); left != 0 {
		t.Fatalf("throttle outlived its period: %v left", left)
	}
	_ = th.Throttle(ctx, "c", time.Second) // expires what has ended
	if _, kept := th.until["a"]; kept {
		t.Fatal("an ended throttle is kept")
	}
}

func TestMemoryThrottlesAreBounded(t *testing.T) {
	th := NewMemoryThrottles()
	ctx := context.Background()
	for i := range maxThrottles + 10 {
		_ = th.Throttle(ctx, fmt.Sprint(i), time.Hour)
	}
	if n := len(th.until); n > maxThrottles {
		t.Fatalf("%d throttles kept, bound %d", n, maxThrottles)
	}
	if left, _ := th.Remaining(ctx, fmt.Sprint(maxThrottles+9)); left == 0 {
		t.Fatal("the newest throttle was forgotten")
	}
}

func TestCensusInstanceCapAndTop(t *testing.T) {
	c := NewCensus()
	const limit = 3
	var wg sync.WaitGroup
	var entered atomic.Int32
	for range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if c.Enter("p", limit) {
				entered.Add(1)
			}
		}()
	}
	wg.Wait()
	if entered.Load() != limit || c.Total() != limit {
		t.Fatalf("entered %d, total %d, limit %d", entered.Load(), c.Total(), limit)
	}
	c.Leave("p")
	if !c.Enter("p", limit) || c.Enter("p", limit) {
		t.Fatal("a stream that left must make room for exactly one")
	}
	c = NewCensus()
	for _, p := range []string{"a", "b", "b", "c", "c", "c", ""} {
		c.Enter(p, 0)
	}
	got, n := c.TopPrincipals(2)
	if n != 3 || fmt.Sprint(got) != "[{c 3} {b 2}]" {
		t.Fatalf("top %v of %d", got, n)
	}
	if c.Total() != 7 {
		t.Fatalf("total %d, want 7 (streams without a principal count too)", c.Total())
	}
}

func TestHubTopChannels(t *testing.T) {
	h := NewMemoryHub()
	defer h.Close()
	subs := []*Subscription{
		h.Subscribe(newRecorder(), []string{"x", "y"}),
		h.Subscribe(newRecorder(), []string{"y"}),
		h.Subscribe(newRecorder(), []string{"z", "y"}),
	}
	got, n := h.TopChannels(2)
	if n != 3 || fmt.Sprint(got) != "[{y 3} {x 1}]" {
		t.Fatalf("top %v of %d", got, n)
	}
	for _, s := range subs {
		s.Close()
	}
	if got, n := h.TopChannels(10); n != 0 || len(got) != 0 {
		t.Fatalf("after every subscription closed: %v of %d", got, n)
	}
	if h.Name() != "embedded" {
		t.Fatalf("name %q", h.Name())
	}
}

func TestHubOptions(t *testing.T) {
	leases, throttles := NewMemoryLeases(), NewMemoryThrottles()
	h := NewHub(func(d DeliverFunc) Broker { return NewMemory(d) }, WithName("x"), WithLeases(leases), WithThrottles(throttles))
	defer h.Close()
	if h.Name() != "x" || h.Leases() != Leases(leases) || h.Throttles() != Throttles(throttles) || h.Census() == nil {
		t.Fatal("options not applied")
	}
}
