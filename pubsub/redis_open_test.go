package pubsub

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/replay"
)

// The head of a channel without events names the epoch its first event
// will have: a position before that event which a lost history does not
// have. Each mode the broker calls the library in (functions, scripts).
func TestRedisEmptyChannelHeadNamesItsEpoch(t *testing.T) {
	for name, opts := range map[string]func(*redistest.Server) RedisOptions{
		"functions": func(srv *redistest.Server) RedisOptions { return RedisOptions{Addrs: []string{srv.Addr()}} },
		"scripts": func(srv *redistest.Server) RedisOptions {
			return withoutFunctions(RedisOptions{Addrs: []string{srv.Addr()}}, srv)
		},
	} {
		t.Run(name, func(t *testing.T) {
			srv := redistest.Start(t)
			hub, _ := newRedisHub(t, opts(srv))
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
			srv.MustCLI("FLUSHALL")
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
