package pubsub

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/replay"
)

// heldReads counts the history reads sent to Redis and, when armed, holds
// the next one after Redis has answered it, until released: a read in the
// air while others ask the same.
type heldReads struct {
	passThrough
	sent    atomic.Int64
	armed   atomic.Bool
	held    chan struct{} // closed once a read is held
	release chan struct{}
}

func newHeldReads() *heldReads {
	return &heldReads{held: make(chan struct{}), release: make(chan struct{})}
}

func (h *heldReads) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if args := cmd.Args(); cmd.Name() == "fcall_ro" && len(args) > 1 && args[1] == FunctionRead {
			h.sent.Add(1)
			if h.armed.CompareAndSwap(true, false) {
				close(h.held)
				<-h.release
			}
		}
		return err
	}
}

// readsSettled waits until n readers of q wait for a read of it (in the
// air or the next), or those of them not held have returned (reads that
// are not shared, as before they were).
func readsSettled(t *testing.T, b *Redis, q readQuestion, n, held int, returned *atomic.Int64) {
	t.Helper()
	for deadline := time.Now().Add(redisWait); ; time.Sleep(time.Millisecond) {
		waiting, gone := readersOf(b, q), int(returned.Load())
		if waiting == n || gone == n-held {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d readers wait for a read, %d returned", waiting, n, gone)
		}
	}
}

// readersOf counts the readers that wait for a read of q.
func readersOf(b *Redis, q readQuestion) int {
	b.reads.mu.Lock()
	defer b.reads.mu.Unlock()
	n := 0
	for fl := b.reads.inAir[q]; fl != nil; fl = fl.next {
		n += fl.waiters
	}
	return n
}

// redisWithHeldReads is a broker whose reads pass heldReads, with events
// 1 to n published on channel "c" and read once (which loads the library:
// page); reads held in the air stay there for overdue at most.
func redisWithHeldReads(t *testing.T, overdue time.Duration, n int) (b *Redis, hook *heldReads, page replay.Page) {
	t.Helper()
	b = newTestRedis(t, redistest.Start(t))
	b.reads.overdue = overdue
	hook = newHeldReads()
	b.client.AddHook(hook)
	publishN(t, b, "c", 1, n)
	page, err := b.Read(context.Background(), "c", &replay.Position{}, 100)
	if err != nil || len(page.Events) != n {
		t.Fatalf("first read: %q, %v", pageData(page), err)
	}
	hook.sent.Store(0)
	return b, hook, page
}

func publishN(t *testing.T, b *Redis, channel string, from, to int) {
	t.Helper()
	for i := from; i <= to; i++ {
		if _, err := b.Publish(context.Background(), channel, Message{Data: []byte(fmt.Sprint(i))}, replay.Limits{}); err != nil {
			t.Fatal(err)
		}
	}
}

func pageData(p replay.Page) string {
	s := ""
	for _, ev := range p.Events {
		s += fmt.Sprintf("%d ", ev.Pos.Seq)
	}
	return s
}

type readResult struct {
	page replay.Page
	err  error
}

// readAsync reads in the background; returned counts the reads done.
func readAsync(ctx context.Context, b *Redis, channel string, after replay.Position, limit int, returned *atomic.Int64) <-chan readResult {
	got := make(chan readResult, 1)
	go func() {
		page, err := b.Read(ctx, channel, &after, limit)
		returned.Add(1)
		got <- readResult{page, err}
	}()
	return got
}

func awaitRead(t *testing.T, got <-chan readResult) readResult {
	t.Helper()
	select {
	case r := <-got:
		return r
	case <-time.After(redisWait):
		t.Fatal("a read did not return")
		return readResult{}
	}
}

// Streams that ask Redis for the same page at once (a reconnect storm: every
// client of a channel back with the same Last-Event-ID) share one read: the
// ones that ask while a read is in the air wait for it to land and share
// the next, which holds what was published after the first was sent.
func TestRedisReadsOfTheSamePageShareOneRead(t *testing.T) {
	b, hook, first := redisWithHeldReads(t, time.Hour, 3) // the read in the air is held as long as the test needs
	ctx := context.Background()
	after := first.Events[0].Pos
	hook.armed.Store(true)
	var returned atomic.Int64
	inAir := readAsync(ctx, b, "c", after, 100, &returned)
	<-hook.held // Redis answered it; its page ends at 3
	publishN(t, b, "c", 4, 4)
	const followers = 50
	var waiting []<-chan readResult
	for range followers {
		waiting = append(waiting, readAsync(ctx, b, "c", after, 100, &returned))
	}
	readsSettled(t, b, newReadQuestion(b.Key("c"), &after, 100), 1+followers, 1, &returned)
	close(hook.release)
	if r := awaitRead(t, inAir); r.err != nil || pageData(r.page) != "2 3 " {
		t.Fatalf("the read in the air: %q, %v", pageData(r.page), r.err)
	}
	for i, got := range waiting {
		r := awaitRead(t, got)
		if r.err != nil || pageData(r.page) != "2 3 4 " || r.page.Head.Seq != 4 {
			t.Fatalf("reader %d: %q head %v, %v; want events 2 3 4 (4 was published before it asked)", i, pageData(r.page), r.page.Head, r.err)
		}
	}
	if n := hook.sent.Load(); n != 2 {
		t.Errorf("%d reads sent to Redis for %d readers of the same page, want 2", n, followers+1)
	}
	b.reads.mu.Lock()
	defer b.reads.mu.Unlock()
	if n := len(b.reads.inAir); n != 0 {
		t.Errorf("%d reads left in the air", n)
	}
}

// A reader that gives up leaves the read to the others; a read that no one
// waits for any more is cancelled, and the next sent at once.
func TestRedisReadOfTheSamePageOutlivesAReaderThatGivesUp(t *testing.T) {
	b, hook, _ := redisWithHeldReads(t, time.Hour, 2)
	after := replay.Position{}
	hook.armed.Store(true)
	var returned atomic.Int64
	ctxFirst, cancelFirst := context.WithCancel(context.Background())
	inAir := readAsync(ctxFirst, b, "c", after, 10, &returned)
	<-hook.held
	ctxQuitter, cancelQuitter := context.WithCancel(context.Background())
	quitter := readAsync(ctxQuitter, b, "c", after, 10, &returned)
	stayer := readAsync(context.Background(), b, "c", after, 10, &returned)
	q := newReadQuestion(b.Key("c"), &after, 10)
	readsSettled(t, b, q, 3, 1, &returned)
	// the quitter first: once the first reader is gone the next read is
	// sent at once, and it may be answered before a later cancel
	cancelQuitter()
	cancelFirst()
	for name, got := range map[string]<-chan readResult{"the first reader": inAir, "the reader that gave up": quitter} {
		if r := awaitRead(t, got); !errors.Is(r.err, context.Canceled) {
			t.Fatalf("%s, its context canceled while the read was in the air: %v", name, r.err)
		}
	}
	// the read no one waits for is cancelled, and may linger in go-redis: the
	// next is sent without waiting for it
	if r := awaitRead(t, stayer); r.err != nil || pageData(r.page) != "1 2 " {
		t.Fatalf("the reader that stayed: %q, %v", pageData(r.page), r.err)
	}
	close(hook.release)
}

// A read whose one reader leaves before it is sent is not sent.
func TestRedisReadOfTheSamePageNotSentForNoOne(t *testing.T) {
	b, hook, _ := redisWithHeldReads(t, time.Hour, 2)
	after := replay.Position{}
	q := newReadQuestion(b.Key("c"), &after, 10)
	hook.armed.Store(true)
	sentBefore := hook.sent.Load()
	var returned atomic.Int64
	inAir := readAsync(context.Background(), b, "c", after, 10, &returned)
	<-hook.held
	ctxLeaver, cancelLeaver := context.WithCancel(context.Background())
	leaver := readAsync(ctxLeaver, b, "c", after, 10, &returned)
	readsSettled(t, b, q, 2, 1, &returned)
	cancelLeaver()
	awaitRead(t, leaver)
	close(hook.release)
	if r := awaitRead(t, inAir); r.err != nil {
		t.Fatal(r.err)
	}
	if n := hook.sent.Load() - sentBefore; n != 1 {
		t.Errorf("%d reads sent, want 1: the next read had no one waiting", n)
	}
	b.reads.mu.Lock()
	defer b.reads.mu.Unlock()
	if n := len(b.reads.inAir); n != 0 {
		t.Errorf("%d reads left in the air", n)
	}
}

// A read that hangs (a connection Redis no longer answers on: go-redis
// gives up on it only at its read timeout) does not hold up the streams
// that ask the same after it: the next read is sent once it is overdue.
func TestRedisReadOfTheSamePageDoesNotWaitForOneThatHangs(t *testing.T) {
	b, hook, _ := redisWithHeldReads(t, 50*time.Millisecond, 2)
	after := replay.Position{}
	hook.armed.Store(true)
	var returned atomic.Int64
	hung := readAsync(context.Background(), b, "c", after, 10, &returned)
	<-hook.held
	defer close(hook.release)
	publishN(t, b, "c", 3, 3)
	for i := range 3 { // the first boards the read after the hung one; later ones, reads after that
		if r := awaitRead(t, readAsync(context.Background(), b, "c", after, 10, &returned)); r.err != nil || pageData(r.page) != "1 2 3 " {
			t.Fatalf("read %d after one that hangs: %q, %v", i, pageData(r.page), r.err)
		}
	}
	select {
	case <-hung:
		t.Fatal("the held read returned before it was released")
	default:
	}
}
