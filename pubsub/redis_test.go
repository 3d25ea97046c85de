package pubsub

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/internal/waitfor"
	"github.com/caddy-sse/caddy-sse/replay"
)

const redisWait = 15 * time.Second

var testLimits = replay.Limits{Count: 100, MaxAge: time.Hour, MaxBytes: 1 << 20}

func newRedisHub(t *testing.T, opts RedisOptions) (*Hub, *Redis) {
	t.Helper()
	if opts.CheckInterval == 0 {
		opts.CheckInterval = 500 * time.Millisecond
	}
	var broker *Redis
	hub := NewHub(func(d DeliverFunc) Broker {
		b, err := NewRedis(opts, d)
		if err != nil {
			t.Fatal(err)
		}
		broker = b
		return b
	})
	t.Cleanup(func() { _ = hub.Close() })
	return hub, broker
}

// passThrough is a go-redis hook that changes nothing: a test's hook
// embeds it and writes only the step it acts on.
type passThrough struct{}

func (passThrough) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (passThrough) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }

func (passThrough) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// redisRecorder is a subscriber that keeps what it receives, per slot.
type redisRecorder struct {
	mu     sync.Mutex
	events map[int][]*replay.Event
	signal chan struct{}
}

func newRedisRecorder() *redisRecorder {
	return &redisRecorder{events: map[int][]*replay.Event{}, signal: make(chan struct{}, 1)}
}

// follow subscribes a new recorder to channel on hub and waits until the
// Redis server has the shard subscription and the watch has had its first
// sync; it ends with the test.
//
// A stream starts where that sync put the watch (Read's head, startAt):
// an event published before the sync may be covered by it and not
// announced again, which a stream never misses (it starts after it) but a
// bare recorder would.
func follow(t *testing.T, srv *redistest.Server, hub *Hub, broker *Redis, channel string) *redisRecorder {
	t.Helper()
	rec := newRedisRecorder()
	sub := hub.Subscribe(rec, []string{channel})
	t.Cleanup(func() { sub.Close() })
	srv.WaitShardSubscribers(t, broker.Key(channel), 1)
	waitSynced(t, broker, channel)
	return rec
}

// waitSynced waits until the watch of channel has had its first sync.
func waitSynced(t *testing.T, broker *Redis, channel string) {
	t.Helper()
	wt := broker.watch.lookup(broker.Key(channel))
	if wt == nil {
		t.Fatalf("channel %q is not watched", channel)
	}
	select {
	case <-wt.ready:
	case <-time.After(redisWait):
		t.Fatalf("channel %q: no first sync within %v", channel, redisWait)
	}
}

func (r *redisRecorder) Deliver(slot int, ev *replay.Event) {
	r.mu.Lock()
	r.events[slot] = append(r.events[slot], ev)
	r.mu.Unlock()
	select {
	case r.signal <- struct{}{}:
	default:
	}
}

// waitFor waits until slot has at least n events and returns them.
func (r *redisRecorder) waitFor(t *testing.T, slot, n int) []*replay.Event {
	t.Helper()
	deadline := time.After(redisWait)
	for {
		r.mu.Lock()
		got := append([]*replay.Event(nil), r.events[slot]...)
		r.mu.Unlock()
		if len(got) >= n {
			return got
		}
		select {
		case <-r.signal:
		case <-deadline:
			t.Fatalf("slot %d: %d events within the deadline, want %d", slot, len(got), n)
		}
	}
}

// assertContiguous checks that events are one history's seqs from..from+n-1.
func assertContiguous(t *testing.T, events []*replay.Event, from uint64) {
	t.Helper()
	for i, ev := range events {
		if ev.Pos.Seq != from+uint64(i) || ev.Pos.Epoch != events[0].Pos.Epoch {
			t.Fatalf("event %d has position %+v, want seq %d in one epoch (gap, duplicate or disorder)", i, ev.Pos, from+uint64(i))
		}
	}
}

func dataOf(ev *replay.Event) string {
	s := string(ev.Frame)
	i := strings.Index(s, "data: ")
	if i < 0 {
		return ""
	}
	return strings.TrimSuffix(s[i+len("data: "):], "\n")
}

func publishTo(t *testing.T, hub *Hub, channel, data string) replay.Position {
	t.Helper()
	pos, err := hub.Publish(context.Background(), channel, Message{Type: "t", Data: []byte(data)}, testLimits)
	if err != nil {
		t.Fatalf("publish %s: %v", data, err)
	}
	return pos
}

func TestRedisPublishReachesOtherInstance(t *testing.T) {
	srv := redistest.Start(t)
	a, _ := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	b, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	rec := follow(t, srv, b, broker, "orders")

	var sent []replay.Position
	for i := range 5 {
		sent = append(sent, publishTo(t, a, "orders", fmt.Sprint("o", i)))
	}
	got := rec.waitFor(t, 0, 5)
	assertContiguous(t, got, 1)
	for i, ev := range got {
		if ev.Pos != sent[i] || dataOf(ev) != fmt.Sprint("o", i) {
			t.Fatalf("event %d: %+v %q, want %+v o%d (ids must be the same on every instance)", i, ev.Pos, dataOf(ev), sent[i], i)
		}
	}
}

func TestRedisReadFollowsReplayRules(t *testing.T) {
	srv := redistest.Start(t)
	hub, _ := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	ctx := context.Background()
	lim := replay.Limits{Count: 10, MaxAge: time.Hour, MaxBytes: 1 << 20}
	var pos []replay.Position
	for i := 1; i <= 15; i++ { // seqs 1..15, history keeps 6..15
		p, err := hub.Publish(ctx, "c", Message{Data: []byte(fmt.Sprint(i))}, lim)
		if err != nil {
			t.Fatal(err)
		}
		pos = append(pos, p)
	}
	at := func(seq int) *replay.Position { p := pos[seq-1]; return &p }
	other := *at(12)
	other.Time++
	future := *at(15)
	future.Seq = 16
	wrongEpoch := *at(12)
	wrongEpoch.Epoch++
	cases := []struct {
		name      string
		after     *replay.Position
		limit     int
		first     uint64
		n         int
		truncated bool
	}{
		{"head only", nil, 5, 0, 0, false},
		{"within the limit", at(12), 5, 13, 3, false},
		{"exactly the limit", at(10), 5, 11, 5, false},
		{"beyond the limit", at(9), 5, 11, 5, true},
		{"at the head", at(15), 5, 0, 0, false},
		{"cursor just before the oldest", at(5), 20, 6, 10, false},
		{"cursor trimmed away", at(3), 20, 6, 10, true},
		{"rewritten time", &other, 5, 11, 5, true},
		{"seq beyond the head", &future, 5, 11, 5, true},
		{"other epoch", &wrongEpoch, 5, 11, 5, true},
		{"zero position, seq 1 trimmed", &replay.Position{}, 20, 6, 10, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			page, err := hub.Read(ctx, "c", tc.after, tc.limit)
			if err != nil {
				t.Fatal(err)
			}
			if page.Head != pos[14] {
				t.Fatalf("head %+v, want %+v", page.Head, pos[14])
			}
			if page.Truncated != tc.truncated || len(page.Events) != tc.n {
				t.Fatalf("truncated %v with %d events, want %v with %d", page.Truncated, len(page.Events), tc.truncated, tc.n)
			}
			if tc.n > 0 {
				assertContiguous(t, page.Events, tc.first)
				if page.Events[0].Pos != pos[tc.first-1] {
					t.Fatalf("first event %+v, want %+v", page.Events[0].Pos, pos[tc.first-1])
				}
			}
		})
	}
	t.Run("empty channel", func(t *testing.T) {
		page, err := hub.Read(ctx, "none", &replay.Position{}, 5)
		if err != nil || page.Truncated || len(page.Events) != 0 || !page.Head.IsZero() {
			t.Fatalf("%+v %v", page, err)
		}
		page, err = hub.Read(ctx, "none", at(3), 5)
		if err != nil || !page.Truncated {
			t.Fatalf("a position in a channel without history must be truncated: %+v %v", page, err)
		}
	})
	t.Run("zero position with the whole history", func(t *testing.T) {
		publishTo(t, hub, "fresh", "1")
		publishTo(t, hub, "fresh", "2")
		page, err := hub.Read(ctx, "fresh", &replay.Position{}, 5)
		if err != nil || page.Truncated || len(page.Events) != 2 {
			t.Fatalf("%+v %v", page, err)
		}
	})
}

// The function library is loaded by the broker when Redis says it is
// missing, and a backend can publish with redis-cli alone.
func TestRedisDirectPublishWithRedisCLI(t *testing.T) {
	srv := redistest.Start(t)
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	rec := follow(t, srv, hub, broker, "wallet:7")

	srv.MustCLI("FCALL", FunctionPublish, "1", "sse:{wallet:7}", "balance", "line1\r\nline2")
	ev := rec.waitFor(t, 0, 1)[0]
	if string(ev.Frame) != "event: balance\ndata: line1\ndata: line2\n" {
		t.Fatalf("frame %q", ev.Frame)
	}
	// its position is replayable
	page, err := hub.Read(context.Background(), "wallet:7", &replay.Position{}, 10)
	if err != nil || len(page.Events) != 1 || page.Events[0].Pos != ev.Pos {
		t.Fatalf("read %+v %v", page, err)
	}
	// an invalid type is refused and not written (README: line breaks,
	// NUL, over 200 bytes, the module's own types); 200 bytes is a type
	for _, bad := range []string{"a\nb", "a\rb", "a\x00b", strings.Repeat("t", 201), "server_closing", "sse_truncated"} {
		err := broker.client.Do(context.Background(), "FCALL", FunctionPublish, 1, "sse:{wallet:7}", bad, "x").Err()
		if err == nil || !strings.Contains(err.Error(), "ERR sse:") {
			t.Fatalf("FCALL with type %q answered %v, want an error", bad, err)
		}
	}
	if n := srv.MustCLI("XLEN", "sse:{wallet:7}:s"); n != "1" {
		t.Fatalf("stream has %s entries, want 1", n)
	}
	srv.MustCLI("FCALL", FunctionPublish, "1", "sse:{wallet:7}", strings.Repeat("t", 200), "x")
	if n := srv.MustCLI("XLEN", "sse:{wallet:7}:s"); n != "2" {
		t.Fatalf("a 200-byte type: stream has %s entries, want 2", n)
	}
}

// Anything may write to Redis: an event with an invalid type that reaches
// the stream and the shard channel by other means is not sent raw.
func TestRedisInvalidEventsAreNotSentRaw(t *testing.T) {
	srv := redistest.Start(t)
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	rec := follow(t, srv, hub, broker, "x")
	p := publishTo(t, hub, "x", "good")
	forged := fmt.Sprintf("%d:%d:%d:%d:%s%s", p.Epoch, p.Seq+1, p.Time, 9, "evil\ntype", "data")
	srv.MustCLI("SPUBLISH", "sse:{x}", forged)
	got := rec.waitFor(t, 0, 2)
	if len(got[1].Frame) != 0 || got[1].Pos.Seq != p.Seq+1 {
		t.Fatalf("a forged event with an invalid type was delivered as %q at %+v; want an id-only event", got[1].Frame, got[1].Pos)
	}
}

func TestRedisUnwatchUnsubscribesAndReloadsDoNotDuplicate(t *testing.T) {
	srv := redistest.Start(t)
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	key := broker.Key("news")
	subs := make([]*Subscription, 3)
	for i := range subs {
		subs[i] = hub.Subscribe(newRedisRecorder(), []string{"news"})
	}
	srv.WaitShardSubscribers(t, key, 1) // three local subscribers, one Redis subscription
	subs[0].Close()
	subs[1].Close()
	srv.WaitShardSubscribers(t, key, 1)
	subs[2].Close()
	srv.WaitShardSubscribers(t, key, 0)
	again := hub.Subscribe(newRedisRecorder(), []string{"news"})
	defer again.Close()
	srv.WaitShardSubscribers(t, key, 1)
}

func TestRedisDownPublishFailsAndStreamsResume(t *testing.T) {
	srv := redistest.Start(t)
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, DialTimeout: 200 * time.Millisecond,
		ReadTimeout: 500 * time.Millisecond, WriteTimeout: 500 * time.Millisecond, MaxRetries: -1})
	rec := follow(t, srv, hub, broker, "a")
	publishTo(t, hub, "a", "before")
	rec.waitFor(t, 0, 1)

	srv.Kill()
	_, err := hub.Publish(context.Background(), "a", Message{Data: []byte("lost?")}, testLimits)
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("publish with Redis down: %v, want ErrUnavailable", err)
	}
	if broker.Available() {
		t.Fatal("broker still reports Redis available")
	}
	srv.Restart() // an empty Redis: the history is gone
	srv.WaitShardSubscribers(t, broker.Key("a"), 1)
	publishTo(t, hub, "a", "after")
	got := rec.waitFor(t, 0, 2)
	if dataOf(got[1]) != "after" {
		t.Fatalf("after the restart got %q", dataOf(got[1]))
	}
	if got[1].Pos.Epoch == got[0].Pos.Epoch {
		t.Fatal("a Redis that lost the history must start a new epoch")
	}
	if !broker.Available() {
		t.Fatal("broker does not report Redis available again")
	}
}

// Killing the pub/sub connection while events are published at a steady
// rate loses nothing: the reconnected watcher repairs the gap from the
// stream, in order, without duplicates.
func TestRedisPubSubKillLosesNothing(t *testing.T) {
	srv := redistest.Start(t)
	pub, _ := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	sub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	rec := follow(t, srv, sub, broker, "steady")

	const total = 400
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range total {
			if _, err := pub.Publish(context.Background(), "steady", Message{Data: []byte(fmt.Sprint(i))}, replay.Limits{Count: 1000, MaxAge: time.Hour, MaxBytes: 1 << 20}); err != nil {
				t.Errorf("publish %d: %v", i, err)
				return
			}
			time.Sleep(2 * time.Millisecond)
		}
	}()
	for range 5 {
		time.Sleep(100 * time.Millisecond)
		srv.MustCLI("CLIENT", "KILL", "TYPE", "pubsub")
	}
	<-done
	got := rec.waitFor(t, 0, total)
	assertContiguous(t, got, 1)
	if len(got) != total {
		t.Fatalf("%d events, want %d", len(got), total)
	}
}

// A lost announcement on a channel that then stays quiet is repaired by the
// periodic check.
func TestRedisQuietChannelIsRepaired(t *testing.T) {
	srv := redistest.Start(t)
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: 200 * time.Millisecond})
	rec := follow(t, srv, hub, broker, "quiet")
	first := publishTo(t, hub, "quiet", "1")
	rec.waitFor(t, 0, 1)
	// an event appended as the function would, but never announced: as if
	// its announcement was lost
	id := fmt.Sprintf("%d-%d", first.Time, first.Seq+1)
	srv.MustCLI("XADD", "sse:{quiet}:s", id, "y", "t", "d", "silent")
	srv.MustCLI("HSET", "sse:{quiet}:m", "s", strconv.FormatUint(first.Seq+1, 10))
	got := rec.waitFor(t, 0, 2)
	if dataOf(got[1]) != "silent" || got[1].Pos.Seq != first.Seq+1 {
		t.Fatalf("repaired %+v %q", got[1].Pos, dataOf(got[1]))
	}
}

func TestRedisFlushAllStartsNewEpoch(t *testing.T) {
	srv := redistest.Start(t)
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	rec := follow(t, srv, hub, broker, "f")
	old := publishTo(t, hub, "f", "old")
	srv.MustCLI("FLUSHALL")
	fresh := publishTo(t, hub, "f", "new")
	if fresh.Epoch == old.Epoch || fresh.Seq != 1 {
		t.Fatalf("after FLUSHALL the position is %+v (old %+v): want a new epoch from seq 1", fresh, old)
	}
	page, err := hub.Read(context.Background(), "f", &old, 10)
	if err != nil || !page.Truncated || len(page.Events) != 1 || dataOf(page.Events[0]) != "new" {
		t.Fatalf("reading after the old position: %+v %v; want truncated with the new event", page, err)
	}
	got := rec.waitFor(t, 0, 2)
	if got[1].Pos != fresh {
		t.Fatalf("live delivery after the flush: %+v, want %+v", got[1].Pos, fresh)
	}
}

func TestRedisFallbackLocal(t *testing.T) {
	srv := redistest.Start(t)
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, FallbackLocal: true,
		DialTimeout: 200 * time.Millisecond, ReadTimeout: 500 * time.Millisecond, MaxRetries: -1})
	rec := follow(t, srv, hub, broker, "l")
	real := publishTo(t, hub, "l", "via redis")
	rec.waitFor(t, 0, 1)
	srv.Kill()
	local := publishTo(t, hub, "l", "local only")
	if local.Epoch == real.Epoch {
		t.Fatal("a local fallback event must have an epoch of its own")
	}
	got := rec.waitFor(t, 0, 2)
	if dataOf(got[1]) != "local only" || got[1].Pos != local {
		t.Fatalf("got %+v %q", got[1].Pos, dataOf(got[1]))
	}
}

// WithFallbackLocal chooses the fallback per publish, on a broker that
// does not fall back for every publish (the handlers of one Redis share
// it, each with its own fallback setting).
func TestRedisFallbackLocalPerPublish(t *testing.T) {
	srv := redistest.Start(t)
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()},
		DialTimeout: 200 * time.Millisecond, ReadTimeout: 500 * time.Millisecond, MaxRetries: -1})
	rec := follow(t, srv, hub, broker, "l")
	publishTo(t, hub, "l", "via redis")
	rec.waitFor(t, 0, 1)
	srv.Kill()
	if _, err := hub.Publish(context.Background(), "l", Message{Data: []byte("refused")}, testLimits); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("a publish without the fallback: %v, want ErrUnavailable", err)
	}
	local, err := hub.Publish(WithFallbackLocal(context.Background()), "l", Message{Data: []byte("local only")}, testLimits)
	if err != nil {
		t.Fatal(err)
	}
	got := rec.waitFor(t, 0, 2)
	if dataOf(got[1]) != "local only" || got[1].Pos != local || !got[1].Local {
		t.Fatalf("got %+v %q", got[1], dataOf(got[1]))
	}
}

// A publisher that gave up (its request's context is cancelled, e.g. the
// client disconnected) is not Redis being unreachable: the event may be in
// Redis already, so it is not published again locally (fallback local), and
// Redis is not reported down.
func TestRedisFallbackLocalNotForACancelledPublish(t *testing.T) {
	srv := redistest.Start(t)
	_, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, FallbackLocal: true})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	pos, err := broker.Publish(ctx, "c", Message{Data: []byte("x")}, testLimits)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("a cancelled publish returned %+v, %v; want context.Canceled", pos, err)
	}
	if !broker.Available() {
		t.Fatal("a cancelled publish marked Redis down")
	}
}

// wait_replicas: a publish returns once the replica has the event (WAIT on
// the connection that wrote it), so the replica has it at once.
func TestRedisWaitReplicas(t *testing.T) {
	primary := redistest.Start(t)
	replica := redistest.Start(t, "--replicaof", "127.0.0.1", strconv.Itoa(primary.Port))
	deadline := time.Now().Add(redisWait)
	for !strings.Contains(replica.MustCLI("INFO", "replication"), "master_link_status:up") {
		if time.Now().After(deadline) {
			t.Fatal("the replica did not connect")
		}
		time.Sleep(20 * time.Millisecond)
	}
	hub, _ := newRedisHub(t, RedisOptions{Addrs: []string{primary.Addr()}, WaitReplicas: 1, WaitTimeout: 5 * time.Second})
	for i := 1; i <= 20; i++ {
		publishTo(t, hub, "w", fmt.Sprint(i))
		// no polling: WAIT made sure the replica has it when publish returned
		if n := replica.MustCLI("XLEN", "sse:{w}:s"); n != strconv.Itoa(i) {
			t.Fatalf("after publish %d the replica has %s events", i, n)
		}
	}
}

// A stream that subscribes to a channel this instance already follows
// starts at the last position delivered here, without reading Redis, and
// still gets every later event: no gap between its starting point and its
// live events, also while events are published concurrently.
func TestRedisHeadOfAFollowedChannel(t *testing.T) {
	srv := redistest.Start(t)
	pub, _ := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	follow(t, srv, hub, broker, "orders") // this instance follows the channel
	var last replay.Position
	for i := range 3 {
		last = publishTo(t, pub, "orders", fmt.Sprint("o", i))
	}
	// the watch has caught up (a new watch may deliver only the newest of
	// these: streams read the rest from the history, as gap)
	deadline := time.Now().Add(redisWait)
	for {
		if at, ok := broker.watch.delivered(broker.Key("orders")); ok && at == last {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the watch did not catch up")
		}
		time.Sleep(5 * time.Millisecond)
	}

	reads := func() string { return srv.MustCLI("INFO", "commandstats") }
	before := reads()
	for range 10 {
		page, err := hub.Read(context.Background(), "orders", nil, 100)
		if err != nil || page.Head != last || len(page.Events) != 0 {
			t.Fatalf("head of a followed channel: %+v, %v; want %+v and no events", page, err, last)
		}
	}
	if after := reads(); fcallCalls(after) != fcallCalls(before) {
		t.Fatalf("reading the head of a followed channel called Redis:\n%s\n%s", before, after)
	}

	// new streams joining while events are published: each gets every
	// event after its starting point, in order
	// The publisher goes on until every joiner has joined, and ten events
	// beyond: on a fast machine 200 events are out before 20 joins.
	const events, joiners = 200, 20
	var allJoined atomic.Bool
	var published uint64
	done := make(chan struct{})
	go func() {
		defer close(done)
		beyond := 0
		for i := 0; i < events || beyond < 10; i++ {
			if _, err := pub.Publish(context.Background(), "orders", Message{Type: "t", Data: []byte(fmt.Sprint("p", i))}, testLimits); err != nil {
				t.Errorf("publish: %v", err)
				return
			}
			published++
			if allJoined.Load() {
				beyond++
			}
		}
	}()
	type joined struct {
		rec  *redisRecorder
		head replay.Position
	}
	var all []joined
	for range joiners {
		rec := newRedisRecorder()
		defer hub.Subscribe(rec, []string{"orders"}).Close()
		page, err := hub.Read(context.Background(), "orders", nil, 100)
		if err != nil {
			t.Fatal(err)
		}
		all = append(all, joined{rec, page.Head})
		time.Sleep(2 * time.Millisecond) // spread the joins over the publishing
	}
	allJoined.Store(true)
	<-done
	end := last.Seq + published
	for i, j := range all {
		got := j.rec.waitFor(t, 0, 1)
		deadline := time.Now().Add(redisWait)
		for got[len(got)-1].Pos.Seq < end && time.Now().Before(deadline) {
			got = j.rec.waitFor(t, 0, len(got)+1)
		}
		var after []*replay.Event
		for _, ev := range got {
			if ev.Pos.Seq > j.head.Seq { // what a stream at head skips as seen
				after = append(after, ev)
			}
		}
		if uint64(len(after)) != end-j.head.Seq {
			t.Fatalf("joiner %d at seq %d: %d events after it, want %d", i, j.head.Seq, len(after), end-j.head.Seq)
		}
		assertContiguous(t, after, j.head.Seq+1)
	}
}

// fcallCalls is the number of FCALL and FCALL_RO calls in INFO commandstats.
func fcallCalls(info string) string {
	var calls []string
	for _, line := range strings.Split(info, "\n") {
		if strings.HasPrefix(line, "cmdstat_fcall") {
			calls = append(calls, strings.SplitN(strings.TrimSpace(line), ",", 2)[0])
		}
	}
	return strings.Join(calls, " ")
}

// On a Redis that does not have the library yet, the first check of a new
// watch loads it and syncs the channel at once, not a check interval later:
// streams joining meanwhile would otherwise each read the head from Redis.
func TestRedisNewWatchSyncsOnAFreshRedis(t *testing.T) {
	srv := redistest.Start(t)
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: time.Minute})
	channels := make([]string, 50)
	for i := range channels {
		channels[i] = "orders-" + strconv.Itoa(i)
	}
	defer hub.Subscribe(newRedisRecorder(), channels).Close()
	deadline := time.Now().Add(redisWait)
	for _, channel := range channels {
		for {
			if _, ok := broker.watch.delivered(broker.Key(channel)); ok {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("the new watch of %s was not synced", channel)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	// the check found the library missing: one load serves every channel
	if loads := commandCalls(srv.MustCLI("INFO", "commandstats"), "cmdstat_function|load"); loads != "calls=1" {
		t.Fatalf("FUNCTION LOAD: %s, want calls=1", loads)
	}
}

// A publish with lower limits than the history was kept with drops many
// entries at once (the trim reads them in growing batches): what is left
// is exactly the newest events within the new limits, by count and by
// bytes.
func TestRedisTrimDropsManyEntriesAtOnce(t *testing.T) {
	srv := redistest.Start(t)
	hub, _ := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	ctx := context.Background()
	wide := replay.Limits{Count: 1000, MaxAge: time.Hour, MaxBytes: 1 << 20}
	const kept = 300
	for _, tc := range []struct {
		name   string
		narrow replay.Limits
		left   int
	}{
		{"count", replay.Limits{Count: 10, MaxAge: time.Hour, MaxBytes: 1 << 20}, 10},
		// every event is 10 bytes of data plus the type and the per-entry
		// overhead the script counts: a budget of 7.5 events keeps 7
		{"bytes", replay.Limits{Count: 1000, MaxAge: time.Hour, MaxBytes: 0}, 7},
	} {
		t.Run(tc.name, func(t *testing.T) {
			channel := "trim-" + tc.name
			data := func(i int) []byte { return fmt.Appendf(nil, "%010d", i) }
			for i := 1; i < kept; i++ {
				if _, err := hub.Publish(ctx, channel, Message{Type: "t", Data: data(i)}, wide); err != nil {
					t.Fatal(err)
				}
			}
			if tc.narrow.MaxBytes == 0 {
				tc.narrow.MaxBytes = (10 + 1 + 64) * 15 / 2 // 64: OVERHEAD in redis.lua
			}
			last, err := hub.Publish(ctx, channel, Message{Type: "t", Data: data(kept)}, tc.narrow)
			if err != nil {
				t.Fatal(err)
			}
			page, err := hub.Read(ctx, channel, &replay.Position{}, 1000)
			if err != nil {
				t.Fatal(err)
			}
			if len(page.Events) != tc.left || page.Head != last {
				t.Fatalf("%d events left (head %+v), want the newest %d (head %+v)", len(page.Events), page.Head, tc.left, last)
			}
			assertContiguous(t, page.Events, uint64(kept-tc.left+1))
			if oldest := page.Events[0].Frame; !strings.Contains(string(oldest), string(data(kept-tc.left+1))) {
				t.Fatalf("oldest kept event %q, want data %s", oldest, data(kept-tc.left+1))
			}
		})
	}
}

// A subscription Redis never confirms (its reply lost on a connection that
// otherwise works) would leave the channel unwatched for good: after a
// check interval without any confirmation the shard reconnects and
// subscribes every key again.
func TestRedisUnconfirmedSubscriptionsAreSentAgain(t *testing.T) {
	srv := redistest.Start(t)
	pub, _ := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: 200 * time.Millisecond})
	rec := follow(t, srv, hub, broker, "orders")
	pubsubClients := func() string { // their ids
		var ids []string
		for _, field := range strings.Fields(srv.MustCLI("CLIENT", "LIST", "TYPE", "pubsub")) {
			if strings.HasPrefix(field, "id=") {
				ids = append(ids, field)
			}
		}
		return strings.Join(ids, " ")
	}
	before := pubsubClients()

	broker.watch.mu.Lock()
	s := broker.watch.shards["main"]
	broker.watch.mu.Unlock()
	s.mu.Lock()
	s.unconfirmed++ // a subscription whose confirmation never comes
	s.mu.Unlock()

	deadline := time.Now().Add(redisWait)
	for pubsubClients() == before {
		if time.Now().After(deadline) {
			t.Fatal("the shard kept a connection with an unconfirmed subscription")
		}
		time.Sleep(20 * time.Millisecond)
	}
	srv.WaitShardSubscribers(t, broker.Key("orders"), 1)
	publishTo(t, pub, "orders", "after")
	if got := rec.waitFor(t, 0, 1); !strings.Contains(string(got[len(got)-1].Frame), "after") {
		t.Fatalf("last event %q, want the one published after the connection was replaced", got[len(got)-1].Frame)
	}
}

// A direct publish without limits keeps the README's defaults: 1000 events,
// 24 h, 4 MiB.
func TestRedisDirectPublishDefaultLimits(t *testing.T) {
	srv := redistest.Start(t)
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	publishTo(t, hub, "warm", "loads the library") // the broker loads it at its first publish
	ctx := context.Background()
	publishOne := func(key, data string) {
		t.Helper()
		if err := broker.client.Do(ctx, "FCALL", FunctionPublish, 1, key, "t", data).Err(); err != nil {
			t.Fatal(err)
		}
	}
	pipe := broker.client.Pipeline()
	for i := range 1003 {
		pipe.Do(ctx, "FCALL", FunctionPublish, 1, "sse:{count}", "t", strconv.Itoa(i))
	}
	if _, err := pipe.Exec(ctx); err != nil {
		t.Fatal(err)
	}
	if n := srv.MustCLI("XLEN", "sse:{count}:s"); n != "1000" {
		t.Fatalf("1003 events without a count: the history holds %s, want 1000", n)
	}
	if age := srv.MustCLI("HGET", "sse:{count}:m", "a"); age != "86400000" {
		t.Fatalf("the history's age without a max_age: %s ms, want 24 h", age)
	}
	mib := strings.Repeat("m", 1000<<10) // under 1 MiB with its type and overhead
	for range 5 {
		publishOne("sse:{bytes}", mib)
	}
	if n := srv.MustCLI("XLEN", "sse:{bytes}:s"); n != "4" {
		t.Fatalf("five events of 1000 KiB without max_bytes: the history holds %s, want the 4 that fit in 4 MiB", n)
	}
}

// sse_publish_once_v2 publishes once per token: a call again with the same
// token (go-redis retrying after a timeout) gets the first call's reply,
// and neither appends nor announces the event again, as a function or as
// a script.
func TestRedisPublishOncePerToken(t *testing.T) {
	srv := redistest.Start(t)
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	rec := follow(t, srv, hub, broker, "o")
	publishTo(t, hub, "o", "loads the library")
	args := func(token, data string) []string {
		return []string{"3", "sse:{o}:m", "sse:{o}:s", "sse:{o}:p:" + token, token, "30000", "t", data}
	}
	first := srv.MustCLI(append([]string{"FCALL", FunctionPublishOnce}, args("tok-1", "once")...)...)
	again := srv.MustCLI(append([]string{"FCALL", FunctionPublishOnce}, args("tok-1", "once")...)...)
	if first != again {
		t.Fatalf("the same token answered %q, then %q", first, again)
	}
	script := []string{"EVAL", evalScript(FunctionPublishOnce)}
	viaScript := srv.MustCLI(append(script, args("tok-1", "once")...)...)
	if viaScript != first {
		t.Fatalf("the script answered %q for the token, the function %q", viaScript, first)
	}
	srv.MustCLI(append(script, args("tok-2", "second")...)...)
	// an announcement of a call again would come before the second event
	got := rec.waitFor(t, 0, 3)
	if dataOf(got[1]) != "once" || dataOf(got[2]) != "second" {
		t.Fatalf("delivered %q, %q, want once, second", dataOf(got[1]), dataOf(got[2]))
	}
	assertContiguous(t, got, 1)
	if n := srv.MustCLI("XLEN", "sse:{o}:s"); n != "3" {
		t.Fatalf("the history holds %s events, want 3", n)
	}
	if ttl, _ := strconv.Atoi(srv.MustCLI("PTTL", "sse:{o}:p:tok-1")); ttl <= 0 || ttl > 30000 {
		t.Fatalf("the token's reply is kept for %d ms, want up to 30000", ttl)
	}
	keys := func(token string) []string { return []string{"3", "sse:{o}:m", "sse:{o}:s", "sse:{o}:p:" + token} }
	long := strings.Repeat("k", 65) // a token is 1 to 64 letters, digits, - or _
	for _, bad := range [][]string{
		append(keys(""), "", "1000", "t", "x"), append(keys("a b"), "a b", "1000", "t", "x"), append(keys("tok"), "tok", "0", "t", "x"),
		append(keys("other"), "tok", "1000", "t", "x"), {"1", "sse:{o}", "tok", "1000", "t", "x"},
		append(keys(long), long, "1000", "t", "x"), append(keys("a.b"), "a.b", "1000", "t", "x"),
	} {
		if out, _ := srv.CLI(append([]string{"FCALL", FunctionPublishOnce}, bad...)...); !strings.Contains(out, "ERR sse:") {
			t.Fatalf("FCALL %v answered %q, want an error", bad, out)
		}
	}
	if n := srv.MustCLI("XLEN", "sse:{o}:s"); n != "3" {
		t.Fatalf("after the refused calls the history holds %s events, want 3", n)
	}
	// a token's reply is kept for ttl_ms only: then the token publishes again
	longest := "K_-9" + strings.Repeat("k", 60)
	short := []string{"3", "sse:{o}:m", "sse:{o}:s", "sse:{o}:p:" + longest, longest, "50", "t", "brief"}
	before := srv.MustCLI(append([]string{"FCALL", FunctionPublishOnce}, short...)...)
	waitfor.Until(t, "the token's reply to expire", redisWait, 10*time.Millisecond, func() bool {
		return srv.MustCLI("EXISTS", "sse:{o}:p:"+longest) == "0"
	})
	if after := srv.MustCLI(append([]string{"FCALL", FunctionPublishOnce}, short...)...); after == before {
		t.Fatalf("the token answered %q again after its ttl_ms", after)
	}
	if n := srv.MustCLI("XLEN", "sse:{o}:s"); n != "5" {
		t.Fatalf("a 64-character token published %s events in all, want 5 (once before, once after its ttl_ms)", n)
	}
}

// A Redis that has an older library (without the publish function the
// broker calls) answers "Function not found": the broker loads its own
// library, which keeps sse_publish_v1 for direct publishers.
func TestRedisOlderLibraryIsReplaced(t *testing.T) {
	srv := redistest.Start(t)
	older := strings.ReplaceAll(redisFunctions, "redis.register_function('"+FunctionPublishCounted+"', publish_once_v3)\n", "")
	if older == redisFunctions {
		t.Fatal("no registration of " + FunctionPublishCounted + " in the library")
	}
	srv.MustCLI("FUNCTION", "LOAD", older)
	hub, _ := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	publishTo(t, hub, "u", "through the broker")
	srv.MustCLI("FCALL", FunctionPublish, "1", "sse:{u}", "t", "direct")
	if n := srv.MustCLI("XLEN", "sse:{u}:s"); n != "2" {
		t.Fatalf("the history holds %s events, want 2", n)
	}
}

// A publish's reply says whether it is an earlier call's (the same token:
// a keyed retry), as a function and as a script, so that the module counts
// each event once; the direct publishers' form answers as before.
func TestRedisPublishCountedSaysARepeat(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	for name, opts := range map[string]RedisOptions{
		"functions": {Addrs: []string{srv.Addr()}},
		"scripts":   withoutFunctions(RedisOptions{Addrs: []string{srv.Addr()}}, srv),
	} {
		t.Run(name, func(t *testing.T) {
			hub, _ := newRedisHub(t, opts)
			msg := Message{Type: "t", Data: []byte("x"), Once: "tok-" + name}
			first, repeat, err := hub.PublishCounted(ctx, name, msg, testLimits)
			if err != nil || repeat {
				t.Fatalf("the first call: %+v, repeat %v, %v", first, repeat, err)
			}
			again, repeat, err := hub.PublishCounted(ctx, name, msg, testLimits)
			if err != nil || !repeat || again != first {
				t.Fatalf("the call again: %+v (first %+v), repeat %v, %v", again, first, repeat, err)
			}
		})
	}
	reply := srv.MustCLI("FCALL", FunctionPublishOnce, "3", "sse:{d}:m", "sse:{d}:s", "sse:{d}:p:tok", "tok", "30000", "t", "d")
	if n := len(strings.Fields(reply)); n != 3 {
		t.Fatalf("%s answered %q, want {epoch, seq, time}", FunctionPublishOnce, reply)
	}
}

func TestPublishOnceTTLCoversTheRetries(t *testing.T) {
	for _, tc := range []struct {
		opts RedisOptions
		want time.Duration
	}{
		{RedisOptions{}, 4*(5+5+5)*time.Second + 3*time.Second}, // go-redis v9: dial 5 s, read 5 s, write = read, backoff up to 1 s
		{RedisOptions{DialTimeout: 300 * time.Millisecond, ReadTimeout: time.Second, MaxRetries: -1}, 30 * time.Second},
		{RedisOptions{ReadTimeout: 10 * time.Second, MaxRetries: 5, MaxRetryBackoff: time.Second}, 6*(5+10+10)*time.Second + 5*time.Second},
	} {
		if got := tc.opts.publishOnceTTL(); got != tc.want {
			t.Errorf("%+v: %v, want %v", tc.opts, got, tc.want)
		}
	}
}

// A publish into a hung Redis marks it down as soon as its first attempt
// times out (while go-redis retries it), so that later publishes fail at
// once rather than each waiting for a retry cycle; once Redis runs again,
// the next publish reaches it.
func TestRedisPublishFailsFastWhileRedisHangs(t *testing.T) {
	srv := redistest.Start(t)
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, ReadTimeout: 500 * time.Millisecond})
	publishTo(t, hub, "h", "before")
	srv.Pause()
	resumed := false
	defer func() {
		if !resumed {
			srv.Resume()
		}
	}()
	began := time.Now()
	first := make(chan error, 1)
	go func() {
		_, err := hub.Publish(context.Background(), "h", Message{Data: []byte("first")}, testLimits)
		first <- err
	}()
	for broker.Available() {
		if time.Since(began) > 2*time.Second {
			t.Fatal("Redis not marked down 2 s into a publish that got no answer")
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("marked down after %v", time.Since(began))
	for i := range 3 {
		start := time.Now()
		_, err := hub.Publish(context.Background(), "h", Message{Data: []byte("refused")}, testLimits)
		if took := time.Since(start); !errors.Is(err, ErrUnavailable) || took > 300*time.Millisecond {
			t.Fatalf("publish %d with Redis known down: %v after %v, want ErrUnavailable at once", i, err, took)
		}
	}
	// with an Idempotency-Key too (the keys fall back to this instance)
	start := time.Now()
	_, _, err := hub.Idempotency().Do(context.Background(), "k", "f", func() ([]byte, error) {
		_, err := hub.Publish(context.Background(), "h", Message{Data: []byte("keyed")}, testLimits)
		return nil, err
	})
	if took := time.Since(start); !errors.Is(err, ErrUnavailable) || took > 300*time.Millisecond {
		t.Fatalf("a keyed publish with Redis known down: %v after %v, want ErrUnavailable at once", err, took)
	}
	err = <-first
	t.Logf("the first publish: %v after %v", err, time.Since(began))
	srv.Resume()
	resumed = true
	start = time.Now()
	for {
		_, err := hub.Publish(context.Background(), "h", Message{Data: []byte("after")}, testLimits)
		if err == nil {
			break
		}
		if time.Since(start) > 2*time.Second {
			t.Fatalf("no publish reached Redis within 2 s of it running again: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("a publish reached Redis %v after it ran again", time.Since(start))
}

// A channel quiet for longer than twice its max age loses its stream (it
// expires), but not its epoch: the events in it were too old to replay, so
// the next event follows on, and a stream or cursor on the channel missed
// nothing. A stream lost while it held events younger than the max age
// (evicted, flushed) still starts a new epoch.
func TestRedisQuietChannelKeepsItsEpochWhenItsStreamExpires(t *testing.T) {
	srv := redistest.Start(t)
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	rec := follow(t, srv, hub, broker, "q")
	lim := replay.Limits{Count: 10, MaxAge: 200 * time.Millisecond, MaxBytes: 1 << 20}
	publish := func(data string) replay.Position {
		t.Helper()
		pos, err := hub.Publish(context.Background(), "q", Message{Data: []byte(data)}, lim)
		if err != nil {
			t.Fatal(err)
		}
		return pos
	}
	first := publish("first")
	deadline := time.Now().Add(redisWait)
	for srv.MustCLI("EXISTS", "sse:{q}:s") != "0" {
		if time.Now().After(deadline) {
			t.Fatal("the stream did not expire")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if srv.MustCLI("EXISTS", "sse:{q}:m") != "1" {
		t.Fatal("the hash expired with the stream")
	}
	second := publish("second")
	if second.Epoch != first.Epoch || second.Seq != first.Seq+1 {
		t.Fatalf("after the stream expired: %+v, want the epoch of %+v going on", second, first)
	}
	assertContiguous(t, rec.waitFor(t, 0, 2), first.Seq)
	page, err := hub.Read(context.Background(), "q", &first, 10)
	if err != nil || page.Truncated || len(page.Events) != 1 || page.Events[0].Pos != second {
		t.Fatalf("read after the first event: %+v %v, want the second, not truncated", page, err)
	}

	srv.MustCLI("DEL", "sse:{q}:s") // evicted while it held a young event
	if third := publish("third"); third.Epoch == second.Epoch {
		t.Fatalf("a stream lost with a young event kept its epoch: %+v after %+v", third, second)
	}
}

// A publish with a Token and a later one with that token as Once (the
// retry of a failed request under the key it was offered) are one event:
// the retry gets the first one's position, and the first one's own
// instance delivered it once.
func TestRedisPublishTokenMakesTheRetryUnderItOne(t *testing.T) {
	srv := redistest.Start(t)
	hub, _ := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	rec := newRecorder()
	sub := hub.Subscribe(rec, []string{"u"})
	defer sub.Close()
	srv.WaitShardSubscribers(t, "sse:{u}", 1)

	const token = "0123456789abcdef0123456789abcdef"
	first, err := hub.Publish(context.Background(), "u", Message{Type: "t", Data: []byte("x"), Token: token}, testLimits)
	if err != nil {
		t.Fatal(err)
	}
	retry, err := hub.Publish(context.Background(), "u", Message{Type: "t", Data: []byte("x"), Once: token}, testLimits)
	if err != nil {
		t.Fatal(err)
	}
	if retry != first {
		t.Fatalf("the retry under the token got %+v, the first publish %+v", retry, first)
	}
	if n := srv.MustCLI("XLEN", "sse:{u}:s"); n != "1" {
		t.Fatalf("the history holds %s events, want 1", n)
	}
	if ttl := srv.MustCLI("PTTL", "sse:{u}:p:"+token); ttl == "-2" || ttl == "-1" {
		t.Fatalf("the token's key has PTTL %s, want a TTL", ttl)
	}
	publishTo(t, hub, "u", "after")
	if got := rec.waitFor(t, 2); got[0].ev.Pos != first || !strings.Contains(string(got[1].ev.Frame), "data: after\n") {
		t.Fatalf("delivered %+v", got)
	}
}
