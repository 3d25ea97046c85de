package caddysse

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/replay"
	"github.com/caddy-sse/caddy-sse/wire"
)

// hammerSite is an embedded-hub site with the given extra settings.
func hammerSite(extra ...string) string {
	return `
:{PORT} {
	sse /events {
		channel {query.channels}
		` + strings.Join(extra, "\n\t\t") + `
		publish {
			secret ` + testSecret + `
		}
	}
}
`
}

// hammerClusterSite is a site on a Redis Cluster.
func hammerClusterSite(addrs []string, extra ...string) string {
	return `
:{PORT} {
	sse /events {
		channel {query.channels}
		redis {
			addresses ` + strings.Join(addrs, " ") + `
			check_interval 300ms
		}
		` + strings.Join(extra, "\n\t\t") + `
		publish {
			secret ` + testSecret + `
		}
	}
}
`
}

// posOf returns the position a multi-channel id holds for channel.
func posOf(t testing.TB, id, channel string) (replay.Position, bool) {
	t.Helper()
	entries, ok := replay.ParseCursor(id)
	if !ok {
		t.Fatalf("id %q does not parse", id)
	}
	return replay.Lookup(entries, replay.HashChannel(channel))
}

// hammerReconnects publishes `total` events round-robin over channels from
// two publishers while `clients` clients keep reading a few events,
// disconnecting and reconnecting with the id of the last event they read.
// Every client must see, per channel, every seq exactly once, in order.
// The clients are on the channels before the first publish (waitReady is
// called after they opened), so every channel starts at seq 1.
func hammerReconnects(t *testing.T, srv *testServer, channels []string, total, clients int, waitReady func()) {
	t.Helper()
	path := "/events?channels=" + strings.Join(channels, ",")
	first := make([]*sseClient, clients)
	for i := range first {
		first[i] = srv.subscribe(path, nil)
	}
	if waitReady != nil {
		waitReady()
	}
	perChannel := total / len(channels)
	var pubWG sync.WaitGroup
	var published atomic.Int64
	for p := range 2 {
		pubWG.Add(1)
		go func() {
			defer pubWG.Done()
			for i := p; i < total; i += 2 {
				ch := channels[i%len(channels)]
				status, body := srv.post("/events", "application/json",
					mustJSON(t, map[string]any{"channel": ch, "data": ch + ":" + strconv.Itoa(i)}), nil)
				if status != http.StatusOK {
					t.Errorf("publish: %d %s", status, body)
					return
				}
				published.Add(1)
			}
		}()
	}
	var wg sync.WaitGroup
	errs := make(chan string, clients)
	for ci := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(ci), 7))
			last := map[string]uint64{}
			var epochs = map[string]uint32{}
			lastID := ""
			c := first[ci]
			reconnects := 0
			for {
				if allDone(last, channels, perChannel) {
					if c != nil {
						c.close()
					}
					return
				}
				if c == nil {
					reconnects++
					c = openStream(t, srv.base+path, header("Last-Event-ID", lastID), nil)
					if c.resp.StatusCode != 200 {
						errs <- fmt.Sprintf("client %d: reconnect status %d", ci, c.resp.StatusCode)
						return
					}
					if tr := c.resp.Header.Get("X-Replay-Truncated"); tr != "" {
						errs <- fmt.Sprintf("client %d: reconnect %d truncated with id %s (last %v)", ci, reconnects, lastID, last)
						c.close()
						return
					}
				}
				n := 1 + rng.IntN(40)
				for range n {
					var ev sseEvent
					var ok bool
					select {
					case ev, ok = <-c.events:
					case <-time.After(waitFor):
						errs <- fmt.Sprintf("client %d: no event within the deadline after reconnect %d (last %v, published %d)", ci, reconnects, last, published.Load())
						c.close()
						return
					}
					if !ok {
						errs <- fmt.Sprintf("client %d: stream ended (last %v)", ci, last)
						return
					}
					if ev.Type != "message" {
						errs <- fmt.Sprintf("client %d: unexpected %+v", ci, ev)
						c.close()
						return
					}
					ch, _, _ := strings.Cut(ev.Data, ":")
					pos, named := posOf(t, ev.ID, ch)
					if !named {
						errs <- fmt.Sprintf("client %d: id does not name %s", ci, ch)
						c.close()
						return
					}
					if e, seen := epochs[ch]; seen && e != pos.Epoch {
						errs <- fmt.Sprintf("client %d: channel %s changed epoch", ci, ch)
						c.close()
						return
					}
					epochs[ch] = pos.Epoch
					if pos.Seq != last[ch]+1 {
						errs <- fmt.Sprintf("client %d: channel %s: event %q has seq %d after %d (reconnect %d): gap or duplicate",
							ci, ch, ev.Data, pos.Seq, last[ch], reconnects)
						c.close()
						return
					}
					for _, other := range channels {
						if other == ch {
							continue
						}
						if op, _ := posOf(t, ev.ID, other); op.Seq != last[other] {
							errs <- fmt.Sprintf("client %d: id of a %s event moved %s from %d to %d", ci, ch, other, last[other], op.Seq)
							c.close()
							return
						}
					}
					last[ch] = pos.Seq
					lastID = ev.ID
					if allDone(last, channels, perChannel) {
						break
					}
				}
				c.close()
				c = nil
			}
		}()
	}
	wg.Wait()
	pubWG.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
}

// Embedded hub: reconnects while publishing, one channel, and three.
func TestReplayHammerEmbedded(t *testing.T) {
	srv := startCaddy(t, hammerSite("history 100000", "replay_limit 100000"))
	hammerReconnects(t, srv, []string{"h"}, 600, 3, nil)
}

func TestReplayHammerEmbeddedMultiChannel(t *testing.T) {
	srv := startCaddy(t, hammerSite("history 100000", "replay_limit 100000"))
	hammerReconnects(t, srv, []string{"x", "y", "z"}, 600, 3, nil)
}

func TestReplayHammerRedis(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, redisSite(rds.URL(), "history 100000", "replay_limit 100000"))
	hammerReconnects(t, srv, []string{"x", "y", "z"}, 600, 3, func() {
		for _, ch := range []string{"x", "y", "z"} {
			rds.WaitShardSubscribers(t, "sse:{"+ch+"}", 1)
		}
	})
}

func TestReplayHammerCluster(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	srv := startCaddy(t, hammerClusterSite(cluster.Addrs(), "history 100000", "replay_limit 100000"))
	hammerReconnects(t, srv, []string{"a", "b", "c"}, 600, 3, func() {
		for _, ch := range []string{"a", "b", "c"} {
			cluster.NodeOfSlot(t, redistest.SlotOf(ch)).WaitShardSubscribers(t, "sse:{"+ch+"}", 1)
		}
	})
}

func allDone(last map[string]uint64, channels []string, perChannel int) bool {
	for _, ch := range channels {
		if last[ch] < uint64(perChannel) {
			return false
		}
	}
	return true
}

// dataAndIDs reads n events and returns their data.
func expectData(t *testing.T, c *sseClient, want ...string) []sseEvent {
	t.Helper()
	var evs []sseEvent
	var got []string
	for range want {
		ev, ok := c.nextOrEnd()
		if !ok {
			t.Fatalf("events %+v, then the stream ended (%s); want data %v", evs, c.ended, want)
		}
		evs = append(evs, ev)
		got = append(got, ev.Data)
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("events %v, want %v", got, want)
	}
	return evs
}

// sameSet reports whether a and b hold the same strings (any order).
func sameSet(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	m := map[string]int{}
	for _, x := range a {
		m[x]++
	}
	for _, x := range b {
		m[x]--
		if m[x] < 0 {
			return false
		}
	}
	return true
}

// threeChannelCursor: a connection on a, b, c; on reconnect a has new
// events, b none, c's position is older than its retained history: only c
// is truncated, a replays exactly, b is live, and all three continue live.
func threeChannelCursor(t *testing.T, srv *testServer, waitReady func(*sseClient)) {
	t.Helper()
	c := srv.subscribe("/events?channels=a,b,c", nil)
	if waitReady != nil {
		waitReady(c)
	}
	srv.publishN("a", "a", 1, 1)
	srv.publishN("b", "b", 1, 1)
	srv.publishN("c", "c", 1, 1)
	evs := c.nextData(3)
	if !sameSet(evs, []string{"a1", "b1", "c1"}) {
		t.Fatalf("live: %v", evs)
	}
	// the id of the last event names all three channels
	var last sseEvent
	for {
		srv.publishN("a", "a", 2, 2)
		last = c.next()
		if last.Data == "a2" {
			break
		}
	}
	c.close()
	for _, ch := range []string{"a", "b", "c"} {
		if _, ok := posOf(t, last.ID, ch); !ok {
			t.Fatalf("the id %q does not name %s", last.ID, ch)
		}
	}
	if n := len(last.ID); n > 3*40 {
		t.Errorf("a three-channel id is %d bytes, more than ~40 per channel", n)
	}
	srv.publishN("a", "a", 3, 4)
	srv.publishN("c", "c", 2, 11) // history 5: c2..c6 are gone
	r := srv.subscribe("/events?channels=a,b,c", header("Last-Event-ID", last.ID))
	if r.resp.Header.Get("X-Replay-Truncated") != "true" {
		t.Fatal("missing X-Replay-Truncated: true")
	}
	assertTruncatedEvent(t, r.next(), "c")
	got := r.nextData(7)
	var as, cs []string
	for _, d := range got {
		switch d[0] {
		case 'a':
			as = append(as, d)
		case 'c':
			cs = append(cs, d)
		default:
			t.Fatalf("replayed %s", d)
		}
	}
	if fmt.Sprint(as) != "[a3 a4]" || fmt.Sprint(cs) != "[c7 c8 c9 c10 c11]" {
		t.Fatalf("replay %v, want a3 a4 and c7..c11", got)
	}
	srv.publishN("b", "b", 2, 2)
	srv.publishN("c", "c", 12, 12)
	srv.publishN("a", "a", 5, 5)
	live := r.nextData(3)
	if !sameSet(live, []string{"b2", "c12", "a5"}) {
		t.Fatalf("live after the replay: %v", live)
	}
}

func TestReplayThreeChannelsOnlyStaleOneTruncatedEmbedded(t *testing.T) {
	srv := startCaddy(t, hammerSite("history 5", "replay_limit 10"))
	threeChannelCursor(t, srv, nil)
}

func TestReplayThreeChannelsOnlyStaleOneTruncatedRedis(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, redisSite(rds.URL(), "history 5", "replay_limit 10"))
	threeChannelCursor(t, srv, func(*sseClient) {
		for _, ch := range []string{"a", "b", "c"} {
			rds.WaitShardSubscribers(t, "sse:{"+ch+"}", 1)
		}
	})
}

func TestReplayThreeChannelsOnlyStaleOneTruncatedCluster(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	srv := startCaddy(t, hammerClusterSite(cluster.Addrs(), "history 5", "replay_limit 10"))
	threeChannelCursor(t, srv, func(*sseClient) {
		for _, ch := range []string{"a", "b", "c"} {
			cluster.NodeOfSlot(t, redistest.SlotOf(ch)).WaitShardSubscribers(t, "sse:{"+ch+"}", 1)
		}
	})
}

// A cursor naming a channel the connection no longer has is ignored for it;
// a channel added on reconnect starts live; nothing is truncated.
func TestReplayChannelDroppedAndAdded(t *testing.T) {
	srv := startCaddy(t, hammerSite("history 50", "replay_limit 10"))
	c := srv.subscribe("/events?channels=a,b", nil)
	srv.publishN("b", "b", 1, 1)
	srv.publishN("a", "a", 1, 1)
	evs := expectData(t, c, "b1", "a1")
	c.close()
	srv.publishN("a", "a", 2, 3)
	srv.publishN("b", "b", 2, 3)
	srv.publishN("c", "c", 1, 3) // before the reconnect: not replayed
	r := srv.subscribe("/events?channels=a,c", header("Last-Event-ID", evs[1].ID))
	if tr := r.resp.Header.Get("X-Replay-Truncated"); tr != "" {
		t.Fatalf("X-Replay-Truncated: %s", tr)
	}
	expectData(t, r, "a2", "a3")
	srv.publishN("c", "c", 4, 4)
	srv.publishN("b", "b", 4, 4)
	srv.publishN("a", "a", 4, 4)
	got := expectData(t, r, "c4", "a4")
	if _, ok := posOf(t, got[1].ID, "b"); ok {
		t.Fatal("the new ids still name b")
	}
}

// A cursor of another namespace names none of this connection's channels:
// ignored, live, not truncated; the other namespace's own cursor replays.
func TestReplayCursorOfAnotherNamespace(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	sse /one {
		channel {query.channels}
		namespace one
		publish {
			secret `+testSecret+`
		}
	}
	sse /two {
		channel {query.channels}
		namespace two
		publish {
			secret `+testSecret+`
		}
	}
}
`)
	pub := func(path, ch, data string) string {
		status, body := srv.post(path, "application/json", mustJSON(t, map[string]any{"channel": ch, "data": data}), nil)
		if status != 200 {
			t.Fatalf("publish %d %s", status, body)
		}
		return string(body)
	}
	first := srv.publishOn("/one", "a", "one1")
	pub("/one", "a", "one2")
	pub("/two", "a", "two1")
	c := srv.subscribe("/two?channels=a", header("Last-Event-ID", first))
	if tr := c.resp.Header.Get("X-Replay-Truncated"); tr != "" {
		t.Fatalf("X-Replay-Truncated: %s", tr)
	}
	pub("/two", "a", "two2")
	expectData(t, c, "two2")
	o := srv.subscribe("/one?channels=a", header("Last-Event-ID", first))
	expectData(t, o, "one2")
}

func (s *testServer) publishOn(path, ch, data string) string {
	s.t.Helper()
	return s.publish(path, map[string]any{"channel": ch, "data": data})[ch]
}

// Header vs query: an unparsable header wins over a valid query cursor
// (live, truncated); an unparsable query alone is the same.
func TestReplayGarbageHeaderBeatsValidQuery(t *testing.T) {
	srv := startCaddy(t, replaySite)
	ids := srv.publishN("a", "e", 1, 3)
	c := srv.subscribe("/events?channels=a&lastEventID="+ids[1], header("Last-Event-ID", "zzz"))
	if c.resp.Header.Get("X-Replay-Truncated") != "true" {
		t.Fatal("an unparsable Last-Event-ID header must be truncated (it wins over the query)")
	}
	assertTruncatedEvent(t, c.next(), "a")
	srv.publishN("a", "e", 4, 4)
	expectData(t, c, "e4")
	q := srv.subscribe("/events?channels=a&lastEventID=%25%25", nil)
	if q.resp.Header.Get("X-Replay-Truncated") != "true" {
		t.Fatal("an unparsable lastEventID must be truncated")
	}
	assertTruncatedEvent(t, q.next(), "a")
	srv.publishN("a", "e", 5, 5)
	expectData(t, q, "e5")
}

// History trimmed by max age: a cursor whose next event expired is
// truncated, in embedded and Redis mode.
func maxAgeTruncates(t *testing.T, srv *testServer) {
	ids := srv.publishN("a", "e", 1, 3)
	time.Sleep(700 * time.Millisecond) // max age 500ms: e1..e3 expired
	srv.publishN("a", "e", 4, 5)
	c := srv.subscribe("/events?channels=a", header("Last-Event-ID", ids[1]))
	if c.resp.Header.Get("X-Replay-Truncated") != "true" {
		t.Fatal("a cursor whose next event expired must be truncated")
	}
	assertTruncatedEvent(t, c.next(), "a")
	expectData(t, c, "e4", "e5")
	// the cursor of the newest expired event misses nothing
	d := srv.subscribe("/events?channels=a", header("Last-Event-ID", ids[3]))
	if tr := d.resp.Header.Get("X-Replay-Truncated"); tr != "" {
		t.Fatalf("cursor at e3 (followed by retained e4): X-Replay-Truncated %s", tr)
	}
	expectData(t, d, "e4", "e5")
}

func TestReplayMaxAgeEmbedded(t *testing.T) {
	srv := startCaddy(t, hammerSite("history 50 500ms", "replay_limit 10"))
	maxAgeTruncates(t, srv)
}

func TestReplayMaxAgeRedis(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, redisSite(rds.URL(), "history 50 500ms", "replay_limit 10"))
	maxAgeTruncates(t, srv)
}

// History trimmed by bytes.
func historyBytesTruncates(t *testing.T, srv *testServer) {
	big := strings.Repeat("x", 1000)
	first := srv.publish("/events", map[string]any{"channel": "a", "data": "e1" + big})["a"]
	second := srv.publish("/events", map[string]any{"channel": "a", "data": "e2" + big})["a"]
	for i := 3; i <= 6; i++ {
		srv.publish("/events", map[string]any{"channel": "a", "data": "e" + itoa(i) + big})
	}
	// 4000 bytes hold 3 events of ~1070: e4..e6
	c := srv.subscribe("/events?channels=a", header("Last-Event-ID", first))
	if c.resp.Header.Get("X-Replay-Truncated") != "true" {
		t.Fatal("missing truncation")
	}
	assertTruncatedEvent(t, c.next(), "a")
	got := c.nextData(3)
	for i, d := range got {
		if !strings.HasPrefix(d, "e"+itoa(i+4)+"x") {
			t.Fatalf("replay event %d = %.5s, want e%d", i, d, i+4)
		}
	}
	_ = second
}

func TestReplayHistoryBytesEmbedded(t *testing.T) {
	srv := startCaddy(t, hammerSite("history 50", "history_bytes 4000", "max_event_size 1500", "replay_limit 10"))
	historyBytesTruncates(t, srv)
}

func TestReplayHistoryBytesRedis(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, redisSite(rds.URL(), "history 50", "history_bytes 4000", "max_event_size 1500", "replay_limit 10"))
	historyBytesTruncates(t, srv)
}

// replay_limit in Redis mode: newest replay_limit, truncated.
func TestReplayLimitRedisCluster(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	srv := startCaddy(t, hammerClusterSite(cluster.Addrs(), "history 50", "replay_limit 5"))
	ids := srv.publishN("b", "e", 1, 12)
	c := srv.subscribe("/events?channels=b", header("Last-Event-ID", ids[2]))
	if c.resp.Header.Get("X-Replay-Truncated") != "true" {
		t.Fatal("missing truncation")
	}
	assertTruncatedEvent(t, c.next(), "b")
	expectData(t, c, "e8", "e9", "e10", "e11", "e12")
	// a publish id replays exactly what follows
	d := srv.subscribe("/events?channels=b", header("Last-Event-ID", ids[9]))
	if tr := d.resp.Header.Get("X-Replay-Truncated"); tr != "" {
		t.Fatalf("X-Replay-Truncated %s", tr)
	}
	expectData(t, d, "e10", "e11", "e12")
	srv.publishN("b", "e", 13, 13)
	expectData(t, d, "e13")
}

// DEL of a channel's keys, then as many events published again: the old
// cursor (same seq) must be truncated.
func delKeysTruncates(t *testing.T, srv *testServer, cli func(args ...string) string, ch string) {
	ids := srv.publishN(ch, "old", 1, 3)
	cli("DEL", "sse:{"+ch+"}:s", "sse:{"+ch+"}:m")
	srv.publishN(ch, "new", 1, 5)
	c := srv.subscribe("/events?channels="+ch, header("Last-Event-ID", ids[3]))
	if c.resp.Header.Get("X-Replay-Truncated") != "true" {
		t.Fatal("missing truncation after the keys were deleted")
	}
	assertTruncatedEvent(t, c.next(), ch)
	expectData(t, c, "new1", "new2", "new3", "new4", "new5")
	// only the stream deleted (evicted) while its events are young
	ids = srv.publishN(ch, "x", 1, 2)
	cli("DEL", "sse:{"+ch+"}:s")
	srv.publishN(ch, "y", 1, 3)
	d := srv.subscribe("/events?channels="+ch, header("Last-Event-ID", ids[2]))
	if d.resp.Header.Get("X-Replay-Truncated") != "true" {
		t.Fatal("missing truncation after the stream was deleted")
	}
	assertTruncatedEvent(t, d.next(), ch)
	expectData(t, d, "y1", "y2", "y3")
}

func TestReplayDelKeysRedis(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, redisSite(rds.URL(), "history 50", "replay_limit 10"))
	delKeysTruncates(t, srv, func(args ...string) string { return rds.MustCLI(args...) }, "a")
}

func TestReplayDelKeysCluster(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	srv := startCaddy(t, hammerClusterSite(cluster.Addrs(), "history 50", "replay_limit 10"))
	node := cluster.NodeOfSlot(t, redistest.SlotOf("c"))
	delKeysTruncates(t, srv, func(args ...string) string { return node.MustCLI(args...) }, "c")
}

// The same seq with another time (a failover lost acknowledged events and
// their seqs went to new ones), simulated by rolling the history back.
func TestReplaySameSeqOtherTimeRedis(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, redisSite(rds.URL(), "history 50", "replay_limit 10"))
	ids := srv.publishN("a", "e", 1, 4)
	p2, p4 := seqOf(t, ids[2]), seqOf(t, ids[4])
	// roll back to e2, as a replica that missed e3 and e4 would have it
	p3 := seqOf(t, ids[3])
	rds.MustCLI("XDEL", "sse:{a}:s", strconv.FormatInt(p3.Time, 10)+"-3", strconv.FormatInt(p4.Time, 10)+"-4")
	rds.MustCLI("HSET", "sse:{a}:m", "s", "2", "t", strconv.FormatInt(p2.Time, 10))
	time.Sleep(5 * time.Millisecond) // the new events get other times
	srv.publishN("a", "n", 3, 5)
	c := srv.subscribe("/events?channels=a", header("Last-Event-ID", ids[4]))
	if c.resp.Header.Get("X-Replay-Truncated") != "true" {
		t.Fatalf("cursor at seq %d whose event was rewritten: not truncated", p4.Seq)
	}
	assertTruncatedEvent(t, c.next(), "a")
	expectData(t, c, "e1", "e2", "n3", "n4", "n5")
}

// Reload (embedded): the hub and its history live on.
func TestReplayAcrossReloadEmbedded(t *testing.T) {
	site := hammerSite("history 50", "replay_limit 10")
	srv := startCaddy(t, site)
	ids := srv.publishN("a", "e", 1, 3)
	srv.reload(strings.Replace(site, "replay_limit 10", "replay_limit 9", 1))
	srv.publishN("a", "e", 4, 4)
	// the reload's old server may still take the connection
	// (TestReplayAcrossReloadReachingTheOldConfig)
	expectResumed(t, srv, "/events?channels=a", ids[2], "e3", "e4")
}

// A reconnect that reaches the config a reload replaces, after the reload
// returned: caddy.Load returns once the old server's shutdown goroutine has
// started, and until that goroutine closes the old listening socket (a
// socket per config, SO_REUSEPORT) the kernel may give that socket new
// connections, which the old server serves with its cleaned-up handler: it
// tells them server_closing with the client's cursor as the id (SPEC S8;
// TestAStreamRequestToAConfigOnItsWayOutIsToldToReconnect). The client,
// reconnecting with that cursor as an EventSource does, loses nothing.
// Made deterministic by a front that serves the first request with such a
// handler and passes the others to the running config.
func TestReplayAcrossReloadReachingTheOldConfig(t *testing.T) {
	srv := startCaddy(t, hammerSite("history 50", "replay_limit 10"))
	ids := srv.publishN("a", "e", 1, 4)
	front := srv.behindAConfigOnItsWayOut(t)
	expectResumed(t, front, "/events?channels=a", ids[2], "e3", "e4")
}

// expectResumed opens a stream of path from the cursor lastID, expects it
// not truncated and its first events' data to be want, and returns them.
// It follows server_closing as an EventSource does, reconnecting with the
// Last-Event-ID that the answer left it (without waiting the retry given):
// a stream request sent right after a reload may reach the config the
// reload replaced (TestReplayAcrossReloadReachingTheOldConfig).
func expectResumed(t *testing.T, srv *testServer, path, lastID string, want ...string) []sseEvent {
	t.Helper()
	for attempt := 1; ; attempt++ {
		c := srv.subscribe(path, header("Last-Event-ID", lastID))
		if tr := c.resp.Header.Get("X-Replay-Truncated"); tr != "" {
			t.Fatalf("X-Replay-Truncated %s (attempt %d)", tr, attempt)
		}
		first := c.next()
		if first.Type == wire.TypeServerClosing && attempt < 5 {
			c.expectEnd()
			if id := c.lastSeenID.Load(); id != nil {
				lastID = *id
			}
			continue
		}
		evs := []sseEvent{first}
		if len(want) > 1 {
			evs = append(evs, expectData(t, c, want[1:]...)...)
		}
		if first.Data != want[0] {
			t.Fatalf("events %+v, want data %v", evs, want)
		}
		return evs
	}
}

// behindAConfigOnItsWayOut returns a server in front of s that answers its
// first request with the handler of a config a reload replaced (provisioned
// in an HTTP server, then cleaned up), and passes the others to s.
func (s *testServer) behindAConfigOnItsWayOut(t *testing.T) *testServer {
	t.Helper()
	old := &Handler{Channels: []string{"{http.request.uri.query.channels}"}}
	ctx := caddy.ActiveContext()
	ctx.Context = context.WithValue(ctx.Context, caddyhttp.ServerCtxKey, &caddyhttp.Server{})
	if err := old.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	if err := old.Cleanup(); err != nil {
		t.Fatal(err)
	}
	target, err := url.Parse(s.base)
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(target)
	proxy.FlushInterval = -1
	var served atomic.Bool
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if served.Swap(true) {
			proxy.ServeHTTP(w, r)
			return
		}
		r = caddyhttp.PrepareRequest(r, caddy.NewReplacer(), w, &caddyhttp.Server{})
		if err := old.ServeHTTP(w, r, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })); err != nil {
			t.Error(err)
		}
	}))
	t.Cleanup(front.Close)
	return &testServer{t: t, port: s.port, base: front.URL}
}

// Caddy restart in Redis mode: a cursor replays from Redis.
func TestReplayAcrossRestartRedis(t *testing.T) {
	rds := redistest.Start(t)
	site := redisSite(rds.URL(), "history 50", "replay_limit 10")
	srv := startCaddy(t, site)
	ids := srv.publishN("a", "e", 1, 3)
	c := srv.subscribe("/events?channels=a", header("Last-Event-ID", ids[1]))
	evs := expectData(t, c, "e2", "e3")
	if err := caddyStopForTest(); err != nil {
		t.Fatal(err)
	}
	<-c.done
	srv2 := startCaddy(t, site)
	srv2.publishN("a", "e", 4, 5)
	r := srv2.subscribe("/events?channels=a", header("Last-Event-ID", evs[1].ID))
	if tr := r.resp.Header.Get("X-Replay-Truncated"); tr != "" {
		t.Fatalf("X-Replay-Truncated %s", tr)
	}
	expectData(t, r, "e4", "e5")
}

// Overflow: queue 2, a burst of 100 events while the reader is stalled;
// once it reads again every event arrives once, in order.
// The stream's channels are a, or a and others (which get no event);
// waitReady, if set, reads what precedes a's events.
func overflowCatchUp(t *testing.T, srv *testServer, channels string, waitReady func(*sseClient)) {
	c, v := openValved(t, srv.base+"/events?channels="+channels, smallReceiveBuffer())
	if waitReady != nil {
		waitReady(c)
	}
	srv.publishN("a", "w", 1, 1)
	expectData(t, c, "w1")
	v.stall()
	big := strings.Repeat("y", 60000) // 6 MB in all: more than the sockets hold
	for i := 2; i <= 101; i++ {
		srv.publish("/events", map[string]any{"channel": "a", "data": "w" + itoa(i) + big})
	}
	v.resume()
	for want := uint64(2); want <= 101; want++ {
		ev := c.next()
		if got := seqOf(t, ev.ID).Seq; got != want {
			t.Fatalf("seq %d, want %d", got, want)
		}
	}
	srv.publishN("a", "w", 102, 102)
	ev := c.next()
	if ev.Data != "w102" {
		t.Fatalf("live after the catch-up: %.10s", ev.Data)
	}
}

func TestReplayOverflowCatchUpEmbedded(t *testing.T) {
	srv := startCaddy(t, hammerSite("queue 2", "history 1000", "history_bytes 16MiB", "slow_client_timeout 1m"))
	overflowCatchUp(t, srv, "a", nil)
}

func TestReplayOverflowCatchUpRedis(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, redisSite(rds.URL(), "queue 2", "history 1000", "history_bytes 16MiB", "slow_client_timeout 1m"))
	overflowCatchUp(t, srv, "a", func(*sseClient) { rds.WaitShardSubscribers(t, "sse:{a}", 1) })
}

// Overflow where the history no longer covers the gap: the stream ends and
// the reconnect is told it was truncated.
func TestReplayOverflowBeyondHistoryEnds(t *testing.T) {
	srv := startCaddy(t, hammerSite("queue 2", "history 10", "history_bytes 16MiB", "replay_limit 10", "slow_client_timeout 1m"))
	c, v := openValved(t, srv.base+"/events?channels=a", smallReceiveBuffer())
	srv.publishN("a", "w", 1, 1)
	first := expectData(t, c, "w1")
	v.stall()
	big := strings.Repeat("y", 60000) // 6 MB in all: more than the sockets hold
	for i := 2; i <= 101; i++ {
		srv.publish("/events", map[string]any{"channel": "a", "data": "w" + itoa(i) + big})
	}
	v.resume()
	lastID := first[0].ID
	prev := uint64(1)
	for prev < 101 {
		var ev sseEvent
		var ok bool
		select {
		case ev, ok = <-c.events:
		case <-time.After(waitFor):
			t.Fatalf("after seq %d the stream neither went on nor ended: a silent hole", prev)
		}
		if !ok {
			break
		}
		if got := seqOf(t, ev.ID).Seq; got != prev+1 {
			t.Fatalf("seq %d after %d: a hole", got, prev)
		}
		prev = seqOf(t, ev.ID).Seq
		lastID = ev.ID
	}
	if prev == 101 {
		t.Fatal("every event arrived: the history of 10 could not cover the overflow")
	}
	r := srv.subscribe("/events?channels=a", header("Last-Event-ID", lastID))
	if r.resp.Header.Get("X-Replay-Truncated") != "true" {
		t.Fatalf("stream ended at seq %d; its reconnect is not told truncated", prev)
	}
}

var caddyStopForTest = caddy.Stop

// FLUSHALL on one primary of a cluster, then as many events again on its
// channel: only that channel of a three-channel cursor is truncated.
func TestReplayClusterFlushOneNode(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	srv := startCaddy(t, hammerClusterSite(cluster.Addrs(), "history 50", "replay_limit 10"))
	c := srv.subscribe("/events?channels=a,b,c", nil)
	for _, ch := range []string{"a", "b", "c"} {
		cluster.NodeOfSlot(t, redistest.SlotOf(ch)).WaitShardSubscribers(t, "sse:{"+ch+"}", 1)
	}
	srv.publishN("a", "a", 1, 1)
	srv.publishN("b", "b", 1, 2)
	srv.publishN("c", "c", 1, 1)
	got := c.nextData(4)
	var last string
	for {
		srv.publishN("a", "a", 2, 2)
		ev := c.next()
		if ev.Data == "a2" {
			last = ev.ID
			break
		}
	}
	_ = got
	c.close()
	cluster.NodeOfSlot(t, redistest.SlotOf("b")).MustCLI("FLUSHALL")
	srv.publishN("b", "nb", 1, 2)
	srv.publishN("a", "a", 3, 3)
	r := srv.subscribe("/events?channels=a,b,c", header("Last-Event-ID", last))
	if r.resp.Header.Get("X-Replay-Truncated") != "true" {
		t.Fatal("missing truncation")
	}
	assertTruncatedEvent(t, r.next(), "b")
	rest := r.nextData(3)
	if !sameSet(rest, []string{"nb1", "nb2", "a3"}) {
		t.Fatalf("replay %v", rest)
	}
	srv.publishN("c", "c", 2, 2)
	expectData(t, r, "c2")
}
