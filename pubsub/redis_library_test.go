package pubsub

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/replay"
)

func TestLibraryLoadsShareOneLoadPerNode(t *testing.T) {
	var loads libraryLoads
	var ran atomic.Int32
	started, release := make(chan struct{}), make(chan struct{})
	failed := errors.New("refused")
	load := func(context.Context) error {
		if ran.Add(1) == 1 {
			close(started)
		}
		<-release
		return failed
	}
	first := make(chan error, 1)
	go func() { first <- loads.do(context.Background(), "a:1", load) }()
	<-started

	const waiters = 20
	results := make(chan error, waiters)
	for range waiters {
		go func() { results <- loads.do(context.Background(), "a:1", load) }()
	}
	// another node's load does not wait for this one
	if err := loads.do(context.Background(), "b:1", func(context.Context) error { return nil }); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for waiting(&loads, "a:1") < waiters {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d callers wait for the load under way", waiting(&loads, "a:1"), waiters)
		}
		time.Sleep(time.Millisecond)
	}
	close(release)
	if err := <-first; !errors.Is(err, failed) {
		t.Fatalf("first load: %v", err)
	}
	for range waiters {
		if err := <-results; !errors.Is(err, failed) {
			t.Fatalf("a waiter got %v, want the shared load's result", err)
		}
	}
	if n := ran.Load(); n != 1 {
		t.Fatalf("%d loads of one node ran for %d callers, want 1", n, waiters+1)
	}
	if len(loads.inFlight) != 0 {
		t.Fatalf("loads left in flight: %v", loads.inFlight)
	}
}

func waiting(l *libraryLoads, addr string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	if running, ok := l.inFlight[addr]; ok {
		return running.waiting
	}
	return 0
}

func TestLibraryLoadWaiterLeavesWithItsContext(t *testing.T) {
	var loads libraryLoads
	started, release := make(chan struct{}), make(chan struct{})
	defer close(release)
	go func() {
		_ = loads.do(context.Background(), "a:1", func(context.Context) error { close(started); <-release; return nil })
	}()
	<-started
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if err := loads.do(ctx, "a:1", func(context.Context) error { return nil }); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("got %v, want the waiter's own deadline", err)
	}
}

// A burst of new streams on a fresh Redis (every call finds the library
// missing) loads it about once, not once per call.
func TestRedisBurstOnAFreshRedisLoadsTheLibraryOnce(t *testing.T) {
	srv := redistest.Start(t)
	hub, _ := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: time.Minute})
	const calls = 60
	var wg sync.WaitGroup
	errs := make(chan error, calls)
	for i := range calls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), redisWait)
			defer cancel()
			if _, err := hub.Read(ctx, "burst-"+strconv.Itoa(i), nil, 10); err != nil {
				errs <- fmt.Errorf("read %d: %w", i, err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	loads, _ := strconv.Atoi(strings.TrimPrefix(commandCalls(srv.MustCLI("INFO", "commandstats"), "cmdstat_function|load"), "calls="))
	if loads < 1 || loads > 5 {
		t.Fatalf("FUNCTION LOAD ran %d times for %d concurrent first calls, want about once", loads, calls)
	}
}

// A Redis that holds the library of an earlier release (without the
// function this one reads with) has it replaced at the first read: a
// function of a new name is how a fix of the library reaches a Redis
// loaded before it.
func TestRedisLibraryOfAnEarlierReleaseIsReplaced(t *testing.T) {
	srv := redistest.Start(t)
	register := "redis.register_function { function_name = '" + FunctionRead + "'"
	lines := strings.Split(RedisFunctions(), "\n")
	earlier := slices.DeleteFunc(slices.Clone(lines), func(l string) bool { return strings.HasPrefix(l, register) })
	if len(earlier) != len(lines)-1 {
		t.Fatalf("no line registers %s", FunctionRead)
	}
	srv.MustCLI("FUNCTION", "LOAD", strings.Join(earlier, "\n"))
	hub, _ := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	sent := publishTo(t, hub, "a", "x")
	page, err := hub.Read(context.Background(), "a", &replay.Position{}, 10)
	if err != nil || len(page.Events) != 1 || page.Events[0].Pos != sent {
		t.Fatalf("read %+v, %v; want the event at %+v", page, err, sent)
	}
	if list := srv.MustCLI("FUNCTION", "LIST"); !strings.Contains(list, FunctionRead) {
		t.Fatalf("Redis' library has no %s: %s", FunctionRead, list)
	}
}
