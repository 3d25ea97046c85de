package pubsub

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/replay"
)

// The head of a channel without events names the epoch its first event
// will have: a position before that event which a lost history does not
// have. Each mode the broker calls the library in (functions, scripts, a
// cluster's primary of the channel).
func TestRedisEmptyChannelHeadNamesItsEpoch(t *testing.T) {
	for name, start := range map[string]func(t *testing.T) (opts RedisOptions, flush func()){
		"functions": func(t *testing.T) (RedisOptions, func()) {
			srv := redistest.Start(t)
			return RedisOptions{Addrs: []string{srv.Addr()}}, func() { srv.MustCLI("FLUSHALL") }
		},
		"scripts": func(t *testing.T) (RedisOptions, func()) {
			srv := redistest.Start(t)
			return withoutFunctions(RedisOptions{Addrs: []string{srv.Addr()}}, srv), func() { srv.MustCLI("FLUSHALL") }
		},
		"cluster": func(t *testing.T) (RedisOptions, func()) {
			cluster := redistest.StartCluster(t, 3)
			return RedisOptions{Addrs: cluster.Addrs()}, func() {
				for _, n := range cluster.Nodes {
					n.MustCLI("FLUSHALL")
				}
			}
		},
	} {
		t.Run(name, func(t *testing.T) {
			opts, flush := start(t)
			hub, _ := newRedisHub(t, opts)
			ctx := context.Background()
			head := readHead(t, hub, "a")
			if head.Epoch == 0 || head.Seq != 0 || head.Time != 0 {
				t.Fatalf("head of an empty channel %+v, want an epoch at seq 0, time 0", head)
			}
			if again := readHead(t, hub, "a"); again != head {
				t.Fatalf("second read %+v, want the same epoch %+v", again, head)
			}
			// an id from before epochs were started for empty channels
			page, err := hub.Read(ctx, "a", &replay.Position{}, 10)
			if err != nil || page.Truncated || len(page.Events) != 0 || page.Head != head {
				t.Fatalf("read after the zero position: %+v, %v", page, err)
			}
			first := publishTo(t, hub, "a", "x")
			if first.Epoch != head.Epoch || first.Seq != 1 {
				t.Fatalf("first event at %+v, want seq 1 of the epoch %d", first, head.Epoch)
			}
			page, err = hub.Read(ctx, "a", &head, 10)
			if err != nil || page.Truncated || len(page.Events) != 1 || page.Events[0].Pos != first {
				t.Fatalf("read after the empty head: %+v, %v; want the first event, not truncated", page, err)
			}
			flush()
			publishTo(t, hub, "a", "y")
			page, err = hub.Read(ctx, "a", &head, 10)
			if err != nil || !page.Truncated || len(page.Events) != 1 {
				t.Fatalf("read after the empty head of a lost history: %+v, %v; want truncated, y", page, err)
			}
		})
	}
}

// An instance that follows an empty channel whose epoch another instance
// started goes on handing new streams its head from the watch: the check
// that reads that epoch is not a gap to repair. It was, and the watch
// stayed behind, so every new stream of the channel read Redis itself.
func TestRedisWatchAdoptsAnEmptyChannelsEpoch(t *testing.T) {
	srv := redistest.Start(t)
	other, _ := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: 50 * time.Millisecond})
	follow(t, srv, hub, broker, "a")
	head := readHead(t, other, "a")
	deadline := time.Now().Add(redisWait)
	for {
		at, ok := broker.watch.delivered(broker.Key("a"))
		if ok && at == head {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the watch is at %+v (caught up: %v), want %+v", at, ok, head)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// readHead reads a channel's head as a new stream does.
func readHead(t *testing.T, hub *Hub, channel string) replay.Position {
	t.Helper()
	page, err := hub.Read(context.Background(), channel, nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	return page.Head
}

// A Redis that refuses to start an empty channel's epoch (here an ACL
// without HSET) fails no stream: its head is the zero position, as before
// epochs were started for empty channels.
func TestRedisEmptyChannelWhoseEpochIsRefused(t *testing.T) {
	srv := redistest.Start(t)
	srv.MustCLI("ACL", "SETUSER", "nohset", "on", ">pw", "~*", "&*", "+@all", "-hset")
	hub, _ := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, Username: "nohset", Password: "pw"})
	page, err := hub.Read(context.Background(), "a", nil, 0)
	if err != nil || page.Head != (replay.Position{}) {
		t.Fatalf("read %+v, %v; want the zero head and no error", page, err)
	}
	if log := srv.MustCLI("ACL", "LOG"); !strings.Contains(log, "hset") {
		t.Fatalf("Redis refused no HSET: %s", log)
	}
}

// Streams that join a new channel together wait for its watch's first
// sync, which starts the channel's epoch for all of them: one call, not
// one per stream (a ramp over new channels grew the connection pool and
// doubled its connect p99 with one each).
func TestRedisNewChannelsEpochIsStartedOnceForItsStreams(t *testing.T) {
	srv := redistest.Start(t)
	hub, _ := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: time.Minute})
	srv.MustCLI("CONFIG", "RESETSTAT")
	const streams = 50
	heads := make(chan replay.Position, streams)
	for range streams {
		go func() {
			t.Cleanup(hub.Subscribe(newRedisRecorder(), []string{"a"}).Close)
			page, err := hub.Read(context.Background(), "a", nil, 0)
			if err != nil {
				t.Error(err)
			}
			heads <- page.Head
		}()
	}
	first := <-heads
	for range streams - 1 {
		if head := <-heads; head != first || head.Epoch == 0 {
			t.Fatalf("streams started at %+v and %+v, want one epoch", first, head)
		}
	}
	if calls := commandCounts(t, srv, "cmdstat_fcall"); calls[0] != 1 {
		t.Fatalf("%d streams of a new channel: %d FCALLs, want the one that started its epoch", streams, calls[0])
	}
}

// An empty channel whose epoch Redis lost (a flush) while its watch held
// it gets a new one at the next check: streams that join it later hold a
// position that a history lost again can be told by.
func TestRedisWatchStartsALostEmptyEpochAgain(t *testing.T) {
	srv := redistest.Start(t)
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: 50 * time.Millisecond})
	follow(t, srv, hub, broker, "a")
	head := readHead(t, hub, "a")
	srv.MustCLI("FLUSHALL")
	deadline := time.Now().Add(redisWait)
	for {
		at, ok := broker.watch.delivered(broker.Key("a"))
		if ok && at.Epoch != 0 && at.Epoch != head.Epoch {
			if now := srv.MustCLI("HGET", broker.Key("a")+":m", "e"); now != fmt.Sprint(at.Epoch) {
				t.Fatalf("the watch is at epoch %d, Redis at %q", at.Epoch, now)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the watch is at %+v after the flush, want a new epoch (was %d)", at, head.Epoch)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
