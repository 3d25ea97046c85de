package pubsub

import (
	"strconv"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/replay"
)

// The periodic check reads every channel's head with HMGET, not with a
// call of the library: a function call costs Redis about a hundred times
// as much, and Redis serves no other client while it runs a pipeline of
// them (docs/PERFORMANCE.md). A check calls the library once per pipeline,
// to find it missing.
func TestRedisChecksReadHeadsWithoutTheLibrary(t *testing.T) {
	srv := redistest.Start(t)
	pub, _ := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: 50 * time.Millisecond})
	const channels, checks = 40, 4
	for c := range channels {
		publishTo(t, pub, "head-"+strconv.Itoa(c), "kept")
	}
	for c := range channels {
		follow(t, srv, hub, broker, "head-"+strconv.Itoa(c))
	}
	// both counts from one INFO: a check (every 50 ms) may run between
	// two reads of them
	counts := func() (reads, heads int) {
		c := commandCounts(t, srv, "cmdstat_fcall_ro", "cmdstat_hmget")
		return c[0], c[1]
	}
	reads0, heads0 := counts()
	deadline := time.Now().Add(redisWait)
	for {
		reads, heads := counts()
		// every check reads 40 heads in one pipeline: at most one library
		// call each, and one for a check under way
		ran := (heads - heads0) / channels
		if n := reads - reads0; n > ran+1 {
			t.Fatalf("%d library reads in %d checks of %d channels, want at most %d", n, ran, channels, ran+1)
		}
		if ran >= checks {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d heads read in %v, want %d checks of %d channels", heads-heads0, redisWait, checks, channels)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A check's head is the library's: the zero position without history, the
// meta hash's epoch, seq and time otherwise.
func TestHeadOfMetaIsTheLibraryHead(t *testing.T) {
	for _, tc := range []struct {
		fields []any
		want   replay.Position
	}{
		{[]any{nil, nil, nil}, replay.Position{}},
		{[]any{"3", "17", "1733333333333"}, replay.Position{Epoch: 3, Seq: 17, Time: 1733333333333}},
		{[]any{"3", nil, "1733333333333"}, replay.Position{}},
		{[]any{"3", "x", "1"}, replay.Position{}},
		{[]any{"3", "17"}, replay.Position{}},
	} {
		if got := headOfMeta(tc.fields); got != tc.want {
			t.Errorf("headOfMeta(%v) = %+v, want %+v", tc.fields, got, tc.want)
		}
	}
}

// A channel's first sync delivers its newest event even where Redis lost
// the library (FUNCTION FLUSH) but kept the history: the heads are read
// without the library, and the one call of it that goes with them finds it
// missing; one load serves the channels synced together.
func TestRedisFirstSyncLoadsAFlushedLibrary(t *testing.T) {
	srv := redistest.Start(t)
	pub, _ := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}})
	const channels = 30
	names := make([]string, channels)
	heads := make([]replay.Position, channels)
	for c := range names {
		names[c] = "kept-" + strconv.Itoa(c)
		heads[c] = publishTo(t, pub, names[c], "newest")
	}
	srv.MustCLI("FUNCTION", "FLUSH")
	srv.MustCLI("CONFIG", "RESETSTAT") // the publisher's load
	hub, broker := newRedisHub(t, RedisOptions{Addrs: []string{srv.Addr()}, CheckInterval: time.Minute})
	rec := newRedisRecorder()
	defer hub.Subscribe(rec, names).Close()
	for c, name := range names {
		waitSynced(t, broker, name)
		got := rec.waitFor(t, c, 1)
		if got[0].Pos != heads[c] || dataOf(got[0]) != "newest" {
			t.Fatalf("%s: first sync delivered %+v %q, want %+v newest", name, got[0].Pos, dataOf(got[0]), heads[c])
		}
	}
	if loads := commandCalls(srv.MustCLI("INFO", "commandstats"), "cmdstat_function|load"); loads != "calls=1" {
		t.Fatalf("FUNCTION LOAD: %s, want calls=1", loads)
	}
}
