package caddysse

import (
	"strings"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// A stream that opened while Redis was up (not degraded) and whose queue
// overflowed while Redis went down: the fallback-local events its queue
// did not take are in no history. Its catch-up read Redis once it was back
// and went on as if nothing had happened: the local events were a silent
// hole (SPEC S7), although every other stream of the instance got them. It
// must end so that its reconnect is told it was truncated.
func TestOverflowDoesNotSilentlyDropLocalEvents(t *testing.T) {
	rds := redistest.Start(t, "--appendonly", "yes", "--appendfsync", "always")
	site := redisBlockSite("url "+rds.URL()+"\n\t\t\tdial_timeout 300ms\n\t\t\tread_timeout 1s\n\t\t\tmax_retries -1\n\t\t\tcheck_interval 300ms",
		"fallback local", "queue 4", "max_event_size 16KiB", "history 100000", "history_bytes 512MiB",
		"slow_client_timeout 60s", "throttle off", "heartbeat 200ms")
	srv := startCaddy(t, strings.Replace(site, ":{PORT} {", ":{PORT} {\n\tmetrics /metrics", 1))
	c, tap := openValved(t, srv.base+"/events?channels=a", smallReceiveBuffer())
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	srv.publish("/events", map[string]any{"channel": "a", "data": "warm"})
	if ev := c.next(); ev.Data != "warm" {
		t.Fatalf("got %+v", ev)
	}
	tap.stall()
	n := srv.publishConcurrently(strings.Repeat("x", 16000), 600, 4) // ~9.6 MB through Redis: the queue overflows
	time.Sleep(300 * time.Millisecond)

	rds.Kill()
	for i := 1; i <= 3; i++ { // delivered to this instance alone; the stalled stream's queue drops them
		srv.publish("/events", map[string]any{"channel": "a", "data": "local " + itoa(i)})
	}
	rds.Restart() // with its append-only file: the history of a is back
	// the stream subscribes again, unless it has ended: its catch-up (a read
	// of megabytes begun at the overflow) may have failed when Redis was
	// killed, or outlasted read_timeout on a loaded box; it is then told
	// truncated at its reconnect (below), as it is when it ends later
	eventually(t, "the stream subscribed again, or ended", func() bool {
		if rds.ShardSubscribers("sse:{a}") == 1 {
			return true
		}
		if metric(t, srv.scrape(), "caddy_sse_streams_open") == 0 {
			t.Log("the stream ended before Redis was back")
			return true
		}
		return false
	})
	tap.resume()
	// straight into Redis, with the site's history limits (the function's
	// defaults would trim the history to 4 MiB)
	rds.MustCLI("FCALL", "sse_publish_v1", "1", "sse:{a}", "", "sentinel", "100000", "86400000", "536870912")
	locals, events := 0, 0
	for {
		var ev sseEvent
		var ok bool
		select {
		case ev, ok = <-c.events:
		case <-time.After(waitFor):
			t.Fatalf("no event within the deadline (%d read, %d published)", events, n)
		}
		if !ok {
			t.Logf("the stream ended after %d events", events)
			r := srv.subscribe("/events?channels=a", header("Last-Event-ID", *c.lastSeenID.Load()))
			ev := r.next()
			if ev.Type == "sse_degraded" {
				// its history read (megabytes) outlasted read_timeout on a
				// loaded box: it opened live-only (SPEC S9), and replays
				// once Redis answers
				t.Log("the reconnect opened degraded")
				ev = r.next()
			}
			assertTruncatedEvent(t, ev, "a")
			return
		}
		events++
		if strings.HasPrefix(ev.Data, "local ") {
			locals++
		}
		if ev.Data == "sentinel" {
			if locals != 3 {
				t.Fatalf("the stream went on to the next event through Redis having written %d of the 3 local events its queue dropped, without ending or any notice (%d events read)", locals, events)
			}
			return
		}
	}
}

// A reload while a stream catches up on its overflowed queue from a Redis
// that hangs (SIGSTOP): the stream is told to close, but its history read
// is not interrupted, so it neither says server_closing nor ends until
// go-redis gives up on the read (read_timeout 5 s and 3 retries by
// default: about 20 s). SPEC S8: streams are told and end when stopping
// begins; a stop's graceful shutdown waits for such a handler (net/http),
// and a reload's Cleanup waits its 3 s for a taken-over one in vain.
func TestReloadDuringACatchUpFromAHungRedisEndsTheStreamPromptly(t *testing.T) {
	rds := redistest.Start(t)
	site := redisBlockSite("url "+rds.URL(),
		"queue 4", "max_event_size 16KiB", "history 100000", "history_bytes 512MiB",
		"slow_client_timeout 60s", "throttle off", "heartbeat off", "close_jitter 100ms")
	srv := startCaddy(t, site)
	c, tap := openValved(t, srv.base+"/events?channels=a", smallReceiveBuffer())
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	srv.publish("/events", map[string]any{"channel": "a", "data": "warm"})
	if ev := c.next(); ev.Data != "warm" {
		t.Fatalf("got %+v", ev)
	}
	tap.stall()
	srv.publishConcurrently(strings.Repeat("x", 16000), 600, 4) // the queue overflows
	time.Sleep(300 * time.Millisecond)
	rds.Pause()
	t.Cleanup(rds.Resume)
	tap.resume() // the stream writes what it holds, then reads the history: it hangs there
	read := 0
	for quiet := false; !quiet; {
		select {
		case _, ok := <-c.events:
			if !ok {
				t.Fatal("the stream ended before the reload")
			}
			read++
		case <-time.After(time.Second):
			quiet = true
		}
	}
	t.Logf("%d events written before the catch-up's read", read)

	took, closing := reloadUntilTheStreamEnds(t, srv, site, c)
	if took > 3*time.Second || !closing {
		t.Fatalf("a stream told to close while it read the history from a hung Redis ended %v later, server_closing %v (close_jitter 100ms, last words %v)", took.Round(10*time.Millisecond), closing, lastWordsTimeout)
	}
}

// reloadUntilTheStreamEnds reloads site and waits (30 s at most) for c's
// stream to end: how long that took from the reload's start, and whether
// the stream said server_closing first.
func reloadUntilTheStreamEnds(t *testing.T, srv *testServer, site string, c *sseClient) (time.Duration, bool) {
	t.Helper()
	began := time.Now()
	reloaded := make(chan time.Duration, 1)
	go func() {
		srv.reload(site)
		reloaded <- time.Since(began)
	}()
	closing := false
	for ended := false; !ended; {
		select {
		case ev, ok := <-c.events:
			ended = !ok
			closing = closing || ev.Type == "server_closing"
		case <-time.After(30 * time.Second):
			t.Fatal("the stream did not end within 30 s of the reload")
		}
	}
	took := time.Since(began)
	t.Logf("the stream ended %v after the reload began (server_closing: %v); the reload took %v", took.Round(10*time.Millisecond), closing, (<-reloaded).Round(10*time.Millisecond))
	return took, closing
}

// Two handlers of one Redis share its hub and its channels, each with its
// own history settings: a channel published through the one that keeps
// 100000 events holds them all, whatever the other keeps. A stream of the
// handler that keeps 10 whose queue overflowed by hundreds of events read
// its catch-up with its own history size, so the read came back truncated
// and the stream ended (its reconnect replayed the same events, which
// replay_limit allows): it must catch up on the events, which the history
// holds and its replay_limit covers, and go on.
func TestCatchUpReadsAGapAnotherHandlersHistoryHolds(t *testing.T) {
	rds := redistest.Start(t)
	settings := "redis {\n\t\t\turl " + rds.URL() + "\n\t\t\tcheck_interval 300ms\n\t\t}"
	srv := startCaddy(t, `
:{PORT} {
	sse /small {
		channel {query.channels}
		`+settings+`
		history 10
		queue 4
		max_event_size 16KiB
		slow_client_timeout 60s
		throttle off
	}
	sse /events {
		channel {query.channels}
		`+settings+`
		history 100000
		history_bytes 512MiB
		max_event_size 16KiB
		publish {
			secret `+testSecret+`
		}
	}
}
`)
	c, tap := openValved(t, srv.base+"/small?channels=a", smallReceiveBuffer())
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	srv.publish("/events", map[string]any{"channel": "a", "data": "warm"})
	first := c.next()
	if first.Data != "warm" {
		t.Fatalf("got %+v", first)
	}
	tap.stall()
	n := srv.publishConcurrently(strings.Repeat("x", 16000), 600, 4) // ~9.6 MB: more than the sockets hold
	tap.resume()
	want := seqOf(t, first.ID).Seq
	for range n {
		var ev sseEvent
		var ok bool
		select {
		case ev, ok = <-c.events:
		case <-time.After(waitFor):
			t.Fatalf("no event within the deadline after seq %d", want)
		}
		if !ok {
			t.Fatalf("the stream ended after seq %d of %d: its catch-up was cut to its handler's history (10), though the channel's history holds the gap", want, n+1)
		}
		want++
		if got := seqOf(t, ev.ID).Seq; got != want {
			t.Fatalf("event seq %d, want %d: a hole or a duplicate", got, want)
		}
	}
}
