package caddysse

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/pubsub"
	"github.com/caddy-sse/caddy-sse/replay"
)

// A stream on a,b that opens degraded with a cursor naming b, and then
// writes a local-fallback event of a: the id of that event must still hold
// b's position from the client's cursor. It held the zero position ("the
// client saw b while it was empty"), so a client that reconnects with it
// once Redis is back (a reload, a network blip) is replayed b's whole
// history again, events it had, without being told b was truncated.
func TestDegradedLocalEventIDKeepsTheOtherChannelsPosition(t *testing.T) {
	rds := redistest.Start(t, "--appendonly", "yes", "--appendfsync", "always")
	srv := startCaddy(t, redisSite(rds.URL(), "fallback local", "heartbeat 200ms"))
	ids := srv.publishN("b", "b", 1, 3)
	cursorB := ids[3] // the client has seen b1..b3

	rds.Kill()
	srv.publish("/events", map[string]any{"channel": "a", "data": "local 0"}) // this instance learns Redis is down
	c := srv.subscribe("/events?channels=a,b", header("Last-Event-ID", cursorB))
	if ev := c.next(); ev.Type != "sse_degraded" {
		t.Fatalf("got %+v, want sse_degraded", ev)
	}
	srv.publish("/events", map[string]any{"channel": "a", "data": "local 1"})
	ev := c.next()
	if ev.Data != "local 1" {
		t.Fatalf("degraded stream got %+v, want local 1", ev)
	}
	entries, ok := replay.ParseCursor(ev.ID)
	if !ok {
		t.Fatalf("id %q does not parse", ev.ID)
	}
	posB, _ := replay.Lookup(entries, replay.HashChannel("b"))
	t.Logf("id of the local event holds b at %+v; the client's cursor had %+v", posB, seqOf(t, cursorB))

	// the client reconnects with that id once Redis is back
	c.close()
	rds.Restart()
	r := srv.subscribe("/events?channels=a,b", header("Last-Event-ID", ev.ID))
	assertTruncatedEvent(t, r.next(), "a") // a's local event is in no history: told
	srv.publishWhileRefused("b", "b4")
	if got := r.next(); got.Data != "b4" {
		t.Fatalf("after the truncation notice for a, the reconnect got %q (want b4: the client had b1..b3 and was not told b was truncated)", got.Data)
	}
}

// The same for a stream that opened degraded without a cursor (live, SPEC
// S4): the id of its local-fallback event of a names b at the zero
// position, so a reconnect with it replays b's whole history, events
// published before the client ever connected, with no truncation notice.
func TestDegradedLocalEventIDDoesNotReplayAFreshChannel(t *testing.T) {
	rds := redistest.Start(t, "--appendonly", "yes", "--appendfsync", "always")
	srv := startCaddy(t, redisSite(rds.URL(), "fallback local", "heartbeat 200ms"))
	srv.publishN("b", "old b", 1, 3) // before the client connects

	rds.Kill()
	srv.publish("/events", map[string]any{"channel": "a", "data": "local 0"}) // this instance learns Redis is down
	c := srv.subscribe("/events?channels=a,b", nil)
	if ev := c.next(); ev.Type != "sse_degraded" {
		t.Fatalf("got %+v, want sse_degraded", ev)
	}
	srv.publish("/events", map[string]any{"channel": "a", "data": "local 1"})
	ev := c.next()
	if ev.Data != "local 1" {
		t.Fatalf("degraded stream got %+v, want local 1", ev)
	}

	c.close()
	rds.Restart()
	r := srv.subscribe("/events?channels=a,b", header("Last-Event-ID", ev.ID))
	assertTruncatedEvent(t, r.next(), "a")
	srv.publishWhileRefused("b", "new b")
	if got := r.next(); got.Data != "new b" {
		t.Fatalf("after the truncation notice for a, the reconnect got %q (want new b: the client opened live on b)", got.Data)
	}
}

// A degraded stream (Redis down, fallback local) whose queue overflows:
// the local events it did not queue are in no history, so it cannot catch
// up on them. It must not go on as if nothing happened (a stream that was
// not degraded ends, and its reconnect is told it was truncated): a
// client that reads every event it is sent must not find a hole in them.
func TestDegradedStreamOverflowDoesNotSilentlyDropLocalEvents(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, redisBlockSite("url "+rds.URL()+"\n\t\t\tdial_timeout 300ms\n\t\t\tread_timeout 1s\n\t\t\tmax_retries -1\n\t\t\tcheck_interval 300ms",
		"fallback local", "queue 4", "max_event_size 16KiB", "slow_client_timeout 60s", "throttle off", "heartbeat 200ms"))
	rds.Kill()
	srv.publish("/events", map[string]any{"channel": "a", "data": "local 0"}) // this instance learns Redis is down
	c, tap := openValved(t, srv.base+"/events?channels=a", smallReceiveBuffer())
	if ev := c.next(); ev.Type != "sse_degraded" {
		t.Fatalf("got %+v, want sse_degraded", ev)
	}
	srv.publish("/events", map[string]any{"channel": "a", "data": "warm"})
	warm := c.next()
	if warm.Data != "warm" {
		t.Fatalf("got %+v", warm)
	}
	tap.stall()
	n := srv.publishConcurrently(strings.Repeat("x", 16000), 600, 4) // ~9.6 MB: more than the sockets hold
	tap.resume()
	srv.publish("/events", map[string]any{"channel": "a", "data": "sentinel"})
	want, lastID := seqOf(t, warm.ID).Seq+1, warm.ID
	for {
		var ev sseEvent
		var ok bool
		select {
		case ev, ok = <-c.events:
		case <-time.After(waitFor):
			t.Fatalf("no event after local seq %d within the deadline (%d published)", want-1, n)
		}
		if !ok {
			// ended: its reconnect must be told, once Redis is back
			t.Logf("the stream ended after local seq %d (of %d published)", want-1, n)
			rds.Restart()
			r := srv.subscribe("/events?channels=a", header("Last-Event-ID", lastID))
			ev := r.next()
			if ev.Type == "sse_degraded" { // this instance has not yet seen Redis back: told once it has
				ev = r.next()
			}
			assertTruncatedEvent(t, ev, "a")
			return
		}
		got := seqOf(t, ev.ID).Seq
		if got != want {
			t.Fatalf("the degraded stream skipped local events: after seq %d it wrote seq %d (%q...), without ending or any notice",
				want-1, got, ev.Data[:min(len(ev.Data), 10)])
		}
		if ev.Data == "sentinel" {
			return
		}
		want, lastID = want+1, ev.ID
	}
}

// A stream opened without a cursor starts live (SPEC S4), degraded or not.
// One that opened while Redis was down, within 5 s (openedSlack) of events
// published before the outage, was written those old events once Redis was
// back, as if they were new, although this instance was following the
// channel and knew where it was when Redis went down: it starts there now.
func TestDegradedFreshStreamIsNotReplayedEventsFromBeforeItOpened(t *testing.T) {
	rds := redistest.Start(t, "--appendonly", "yes", "--appendfsync", "always")
	srv := startCaddy(t, redisSite(rds.URL(), "heartbeat 200ms"))
	old := srv.subscribe("/events?channels=a", nil)
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	srv.publishN("a", "old", 1, 2)
	old.nextData(2)
	rds.Kill()
	if status, _ := srv.post("/events", "application/json", mustJSON(t, map[string]any{"channel": "a", "data": "x"}), nil); status != 503 {
		t.Fatalf("publish with Redis down: %d", status)
	}
	c := srv.subscribe("/events?channels=a", nil) // opened after old1, old2
	if ev := c.next(); ev.Type != "sse_degraded" {
		t.Fatalf("got %+v, want sse_degraded", ev)
	}
	rds.Restart()
	srv.publishWhileRefused("a", "new")
	if ev := c.next(); ev.Data != "new" {
		t.Fatalf("a stream opened without a cursor after old1 and old2 were published got %q first, want new", ev.Data)
	}
}

// wait_replicas: the publish function ran (the event is in the history and
// was announced to every instance), then Redis went away while WAIT waited
// for replicas. The publish is then taken as failed: with fallback local it
// is delivered a second time, under a local id, to this instance's streams;
// without, it answers 503 for an event every stream got (the publisher's
// retry publishes it again).
func TestAPublishThatRanIsNotFailedByItsWait(t *testing.T) {
	for _, fallback := range []bool{true, false} {
		t.Run(map[bool]string{true: "fallback local", false: "no fallback"}[fallback], func(t *testing.T) {
			rds := redistest.Start(t)
			extra := "heartbeat 200ms"
			if fallback {
				extra += "\n\t\tfallback local"
			}
			// no replica: WAIT waits its whole timeout (2 s) for one
			srv := startCaddy(t, redisBlockSite("url "+rds.URL()+"\n\t\t\tdial_timeout 300ms\n\t\t\tread_timeout 1s\n\t\t\tmax_retries -1\n\t\t\tcheck_interval 300ms\n\t\t\twait_replicas 1 2s", extra))
			c := srv.subscribe("/events?channels=a", nil)
			rds.WaitShardSubscribers(t, "sse:{a}", 1)
			type answer struct {
				status int
				body   string
			}
			done := make(chan answer, 1)
			go func() {
				status, body := srv.post("/events", "application/json", mustJSON(t, map[string]any{"channel": "a", "data": "once"}), nil)
				done <- answer{status, string(body)}
			}()
			if ev := c.next(); ev.Data != "once" { // announced by the publish function, before WAIT
				t.Fatalf("got %+v", ev)
			}
			rds.Kill() // while WAIT waits
			got := <-done
			t.Logf("the publish answered %d %s", got.status, got.body)
			if got.status != 200 {
				t.Fatalf("a publish whose event every stream got answered %d %s", got.status, got.body)
			}
			select {
			case ev := <-c.events:
				t.Fatalf("the stream got the event a second time: %+v", ev)
			case <-time.After(500 * time.Millisecond):
			}
		})
	}
}

// addSinceOpened with a history shorter than replay_limit (history 100 and
// the default replay_limit 1000 is a usual setting): more events were
// published since the degraded stream opened than the history keeps, so
// the oldest of them are gone, and the page read is not full. The stream
// gets the newest and must be told the channel was truncated (cutShort
// only counted a page as cut short when it held replay_limit events).
func TestADegradedStreamIsToldWhenTheHistoryLostEventsSinceItOpened(t *testing.T) {
	h := validHandler()
	h.HistorySize = 5 // replay_limit stays 1000
	h.logger = zap.NewNop()
	h.metrics = newMetrics()
	h.hub = pubsub.NewMemoryHub()
	defer h.hub.Close()
	h.limits = h.hubLimits()
	s := newStream(h, []string{"a"})
	s.began = time.Now().UnixNano()
	sp, err := s.startingPoint(context.Background(), "")
	if err != nil {
		t.Fatal(err)
	}
	var last replay.Position
	for i := range 8 { // since it opened; the history keeps the newest 5
		if last, err = h.hub.Publish(context.Background(), "a", pubsub.Message{Data: []byte(strconv.Itoa(i))}, h.limits); err != nil {
			t.Fatal(err)
		}
	}
	sp.pages[0].Head = last
	if err := s.addSinceOpened(context.Background(), &sp); err != nil {
		t.Fatal(err)
	}
	if len(sp.truncated) == 0 {
		t.Fatalf("8 events published since the stream opened, %d of them left in the history and written, and the channel is not reported truncated", len(sp.pages[0].Events))
	}
}

// A reload while Redis is down: the degraded stream is told
// server_closing; its client reconnects with the id it holds (its
// original cursor: a degraded stream writes no id of its own without
// fallback local), opens degraded again, and once Redis is back replays
// what it missed, exactly once.
func TestReloadWhileDegradedLosesNothing(t *testing.T) {
	rds := redistest.Start(t, "--appendonly", "yes", "--appendfsync", "always")
	site := redisSite(rds.URL(), "heartbeat 200ms", "close_jitter 100ms")
	srv := startCaddy(t, site)
	ids := srv.publishN("a", "e", 1, 3)
	rds.Kill()
	if status, _ := srv.post("/events", "application/json", mustJSON(t, map[string]any{"channel": "a", "data": "x"}), nil); status != 503 {
		t.Fatalf("publish with Redis down: %d", status)
	}
	c := srv.subscribe("/events?channels=a", header("Last-Event-ID", ids[1]))
	if ev := c.next(); ev.Type != "sse_degraded" {
		t.Fatalf("got %+v", ev)
	}
	srv.reload(site)
	ev := c.next()
	if ev.Type != "server_closing" {
		t.Fatalf("got %+v, want server_closing", ev)
	}
	last := ev.ID
	if last == "" {
		last = ids[1]
	}
	r := srv.subscribe("/events?channels=a", header("Last-Event-ID", last))
	if ev := r.next(); ev.Type != "sse_degraded" {
		t.Fatalf("got %+v", ev)
	}
	rds.Restart()
	srv.publishWhileRefused("a", "e4")
	if got := r.nextData(3); strings.Join(got, ",") != "e2,e3,e4" {
		t.Fatalf("after the reload and Redis' return the stream got %v, want [e2 e3 e4]", got)
	}
}
