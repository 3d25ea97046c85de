package caddysse

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/pubsub"
	"github.com/caddy-sse/caddy-sse/replay"
)

const replaySite = `
:{PORT} {
	sse /events {
		channel {query.channels}
		history 50
		replay_limit 5
		publish {
			secret ` + testSecret + `
		}
	}
}
`

// publishN publishes data "<prefix><i>" for i in [from, to] and returns
// the id of each.
func (s *testServer) publishN(channel, prefix string, from, to int) map[int]string {
	ids := map[int]string{}
	for i := from; i <= to; i++ {
		ids[i] = s.publish("/events", map[string]any{"channel": channel, "data": prefix + strconv.Itoa(i)})[channel]
	}
	return ids
}

func TestReplayAfterLastEventID(t *testing.T) {
	srv := startCaddy(t, replaySite)
	ids := srv.publishN("a", "e", 1, 7)
	c := srv.subscribe("/events?channels=a", header("Last-Event-ID", ids[4]))
	if c.resp.Header.Get("X-Replay-Truncated") != "" {
		t.Fatal("a replay within the limit is not truncated")
	}
	got := c.nextData(3)
	if fmt.Sprint(got) != "[e5 e6 e7]" {
		t.Fatalf("replay = %v, want [e5 e6 e7]", got)
	}
	srv.publish("/events", map[string]any{"channel": "a", "data": "live"})
	if ev := c.next(); ev.Data != "live" {
		t.Fatalf("after the replay got %+v, want the live event", ev)
	}
}

func TestFreshStreamStartsLive(t *testing.T) {
	srv := startCaddy(t, replaySite)
	srv.publishN("a", "old", 1, 3)
	c := srv.subscribe("/events?channels=a", nil)
	srv.publish("/events", map[string]any{"channel": "a", "data": "new"})
	if ev := c.next(); ev.Data != "new" {
		t.Fatalf("a stream without cursor must start live, got %+v", ev)
	}
}

func TestTruncatedReplayWhenMoreThanLimit(t *testing.T) {
	srv := startCaddy(t, replaySite)
	ids := srv.publishN("a", "e", 1, 12)
	c := srv.subscribe("/events?channels=a", header("Last-Event-ID", ids[2]))
	if c.resp.Header.Get("X-Replay-Truncated") != "true" {
		t.Fatal("missing X-Replay-Truncated: true")
	}
	assertTruncatedEvent(t, c.next(), "a")
	// the newest replay_limit events
	if got := c.nextData(5); fmt.Sprint(got) != "[e8 e9 e10 e11 e12]" {
		t.Fatalf("replay = %v", got)
	}
}

func TestTruncatedReplayWhenHistoryDropped(t *testing.T) {
	srv := startCaddy(t, replaySite)
	first := srv.publishN("a", "e", 1, 1)
	srv.publishN("a", "e", 2, 60) // history keeps 50: e1..e10 are gone
	c := srv.subscribe("/events?channels=a", header("Last-Event-ID", first[1]))
	if c.resp.Header.Get("X-Replay-Truncated") != "true" {
		t.Fatal("missing X-Replay-Truncated: true")
	}
	assertTruncatedEvent(t, c.next(), "a")
	if got := c.nextData(5); fmt.Sprint(got) != "[e56 e57 e58 e59 e60]" {
		t.Fatalf("replay = %v", got)
	}
}

// embeddedHub returns the embedded hub of the running server.
func embeddedHub(t *testing.T) *pubsub.Hub {
	t.Helper()
	var hub *pubsub.Hub
	hubs.Range(func(key, value any) bool {
		if key == embeddedHubKey {
			hub = value.(pooledHub).Hub
		}
		return hub == nil
	})
	if hub == nil {
		t.Fatal("no embedded hub")
	}
	return hub
}

// sweepEmbeddedHistory runs the embedded hub's history sweep now, as it
// does once a minute.
func sweepEmbeddedHistory(t *testing.T) {
	t.Helper()
	embeddedHub(t).Broker().(*pubsub.Memory).Sweep()
}

// A stream open on a channel that stays quiet for longer than twice the
// history's max age: the sweep must not forget the channel (its head and
// epoch) while the stream is subscribed, or the next publish starts a new
// epoch and the stream, which missed nothing, is ended as if it had a gap.
func TestQuietChannelDoesNotEndOpenStreams(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	sse /events {
		channel quiet
		history 100 10ms
		heartbeat 5s
		publish {
			secret `+testSecret+`
		}
	}
}
`)
	c := srv.subscribe("/events", nil)
	srv.publish("/events", map[string]any{"channel": "quiet", "data": "e1"})
	ev := c.next()
	if ev.Data != "e1" {
		t.Fatalf("got %+v", ev)
	}
	id1 := ev.ID
	time.Sleep(50 * time.Millisecond) // e1 expired, the channel empty for 2*max age
	sweepEmbeddedHistory(t)
	srv.publish("/events", map[string]any{"channel": "quiet", "data": "e2"})
	select {
	case ev, ok := <-c.events:
		if !ok {
			r := srv.subscribe("/events", header("Last-Event-ID", id1))
			t.Fatalf("the open stream was ended by the first publish after a quiet spell, though it missed nothing; "+
				"its reconnect with e1's id gets X-Replay-Truncated: %q", r.resp.Header.Get("X-Replay-Truncated"))
		}
		if ev.Data != "e2" {
			t.Fatalf("got %+v, want e2", ev)
		}
	case <-time.After(waitFor):
		t.Fatal("no event")
	}
}

func TestGarbageCursorIsLiveAndTruncated(t *testing.T) {
	srv := startCaddy(t, replaySite)
	srv.publishN("a", "old", 1, 3)
	c := srv.subscribe("/events?channels=a", header("Last-Event-ID", "not-a-cursor,{}"))
	if c.resp.Header.Get("X-Replay-Truncated") != "true" {
		t.Fatal("a cursor that does not parse must be reported truncated")
	}
	assertTruncatedEvent(t, c.next(), "a")
	srv.publish("/events", map[string]any{"channel": "a", "data": "new"})
	if ev := c.next(); ev.Data != "new" {
		t.Fatalf("got %+v, want the live event (no replay)", ev)
	}
}

func TestHeaderLastEventIDBeatsQuery(t *testing.T) {
	srv := startCaddy(t, replaySite)
	ids := srv.publishN("a", "e", 1, 5)
	c := srv.subscribe("/events?channels=a&lastEventID="+ids[1], header("Last-Event-ID", ids[3]))
	if got := c.nextData(2); fmt.Sprint(got) != "[e4 e5]" {
		t.Fatalf("replay = %v, want [e4 e5] (from the header's id)", got)
	}
	// without the header, the query parameter is used
	q := srv.subscribe("/events?channels=a&lastEventID="+ids[2], nil)
	if got := q.nextData(3); fmt.Sprint(got) != "[e3 e4 e5]" {
		t.Fatalf("replay = %v, want [e3 e4 e5] (from the query)", got)
	}
}

func TestMultiChannelCursorResumesBoth(t *testing.T) {
	srv := startCaddy(t, replaySite)
	c := srv.subscribe("/events?channels=a,b", nil)
	srv.publish("/events", map[string]any{"channel": "a", "data": "a1"})
	srv.publish("/events", map[string]any{"channel": "b", "data": "b1"})
	c.nextData(2)
	srv.publish("/events", map[string]any{"channel": "a", "data": "a2"})
	ev := c.next()
	if ev.Data != "a2" {
		t.Fatalf("got %+v", ev)
	}
	c.close()
	if len(ev.ID) > 2*40*4/3+4 {
		t.Errorf("a two-channel cursor of %d bytes is longer than ~40 bytes per channel", len(ev.ID))
	}
	srv.publish("/events", map[string]any{"channel": "b", "data": "b2"})
	srv.publish("/events", map[string]any{"channel": "a", "data": "a3"})
	r := srv.subscribe("/events?channels=a,b", header("Last-Event-ID", ev.ID))
	if r.resp.Header.Get("X-Replay-Truncated") != "" {
		t.Fatal("not truncated")
	}
	// merged by publish time; these two may share a millisecond, and then
	// their order across channels is not defined
	if got := r.nextData(2); fmt.Sprint(got) != "[b2 a3]" && fmt.Sprint(got) != "[a3 b2]" {
		t.Fatalf("replay = %v, want b2 and a3", got)
	}
}

// A channel the client saw empty is replayed from its first event: the
// cursor of a two-channel stream names b at "before the first event".
func TestChannelSeenEmptyReplaysFromItsStart(t *testing.T) {
	srv := startCaddy(t, replaySite)
	c := srv.subscribe("/events?channels=a,b", nil)
	srv.publish("/events", map[string]any{"channel": "a", "data": "a1"})
	ev := c.next()
	c.close()
	srv.publish("/events", map[string]any{"channel": "b", "data": "b1"})
	r := srv.subscribe("/events?channels=a,b", header("Last-Event-ID", ev.ID))
	if got := r.next(); got.Data != "b1" {
		t.Fatalf("got %+v, want b1", got)
	}
}

func TestPublishIDResumesAnyStreamWithThatChannel(t *testing.T) {
	srv := startCaddy(t, replaySite)
	ids := srv.publishN("a", "e", 1, 3)
	// the snapshot id of channel a, on a stream of a and b: a resumes, b is live
	c := srv.subscribe("/events?channels=a,b", header("Last-Event-ID", ids[2]))
	if got := c.next(); got.Data != "e3" {
		t.Fatalf("got %+v", got)
	}
	srv.publish("/events", map[string]any{"channel": "b", "data": "b-live"})
	if got := c.next(); got.Data != "b-live" {
		t.Fatalf("got %+v", got)
	}
}

// Hundreds of events are published concurrently while a client replays
// from an old id: it must see every event after its id exactly once, in
// the channel's order, and then continue live.
func TestReplayDuringConcurrentPublishingHasNoGapNorDuplicate(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	sse /events {
		channel {query.channels}
		history 5000
		replay_limit 5000
		publish {
			secret `+testSecret+`
		}
	}
}
`)
	ids := srv.publishN("a", "pre", 1, 300)
	from := seqOf(t, ids[100]).Seq

	const publishers, each = 6, 100
	var wg sync.WaitGroup
	start := make(chan struct{})
	for p := range publishers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			for i := range each {
				status, body := srv.post("/events", "application/json", mustJSON(t, map[string]any{"channel": "a", "data": fmt.Sprintf("p%d-%d", p, i)}), nil)
				if status != http.StatusOK {
					t.Errorf("publish: %d %s", status, body)
					return
				}
			}
		}()
	}
	close(start)
	c := srv.subscribe("/events?channels=a", header("Last-Event-ID", ids[100]))
	wg.Wait()
	srv.publish("/events", map[string]any{"channel": "a", "data": "sentinel"})

	total := 300 + publishers*each + 1
	expected := from + 1
	for expected <= uint64(total) {
		ev := c.next()
		if got := seqOf(t, ev.ID).Seq; got != expected {
			t.Fatalf("event %q has seq %d, want %d (gap or duplicate)", ev.Data, got, expected)
		}
		expected++
	}
}

func assertTruncatedEvent(t *testing.T, ev sseEvent, channels ...string) {
	t.Helper()
	if ev.Type != "sse_truncated" {
		t.Fatalf("first event is %+v, want sse_truncated", ev)
	}
	var body struct {
		Channels []string `json:"channels"`
	}
	if err := json.Unmarshal([]byte(ev.Data), &body); err != nil || fmt.Sprint(body.Channels) != fmt.Sprint(channels) {
		t.Fatalf("sse_truncated data %q, want channels %v", ev.Data, channels)
	}
	if ev.OwnID {
		t.Fatalf("sse_truncated must not carry an id line, got one (%q)", ev.ID)
	}
}

// A multi-channel cursor whose channel b is truncated with nothing left to
// replay (its history is gone) while channel a replays: the ids written
// during the replay carry b's head, not its old unusable position, so a
// client that reconnects with the last replayed id is not told b is
// truncated a second time.
func TestTruncatedChannelIsAtItsHeadInTheReplaysIDs(t *testing.T) {
	srv := startCaddy(t, replaySite)
	ids := srv.publishN("a", "a", 1, 3)
	posA := seqOf(t, ids[1])
	stale := replay.Position{Epoch: posA.Epoch ^ 0x5a5a, Seq: 7, Time: posA.Time}
	cursor := replay.EncodeCursor(
		replay.ChannelPosition{Hash: replay.HashChannel("a"), Pos: posA},
		replay.ChannelPosition{Hash: replay.HashChannel("b"), Pos: stale})
	c := srv.subscribe("/events?channels=a,b", header("Last-Event-ID", cursor))
	assertTruncatedEvent(t, c.next(), "b")
	c.next() // a2
	a3 := c.next()
	if a3.Data != "a3" {
		t.Fatalf("got %+v, want a3", a3)
	}
	c.close()
	// nothing was published since: the client has missed nothing
	r := srv.subscribe("/events?channels=a,b", header("Last-Event-ID", a3.ID))
	if tr := r.resp.Header.Get("X-Replay-Truncated"); tr != "" {
		t.Fatalf("b reported truncated again (X-Replay-Truncated: %s) on a reconnect with the id of the last event, "+
			"though the client was told already and nothing was published to b", tr)
	}
}

// Seed 003: "Ingest 1100 events while disconnected, reconnect, assert replay
// is capped at 1000 and X-Replay-Truncated: true is set" -- with the
// defaults (history 1000, replay_limit 1000).
func TestReplayIsCappedAtTheDefaultLimit(t *testing.T) {
	srv := startCaddy(t, basicSite)
	first := srv.publish("/events", map[string]any{"channel": "w", "data": "e0"})["w"]
	for i := 1; i <= 1100; i++ {
		srv.publish("/events", map[string]any{"channel": "w", "data": fmt.Sprintf("e%d", i)})
	}
	c := srv.subscribe("/events?channels=w", header("Last-Event-ID", first))
	if c.resp.Header.Get("X-Replay-Truncated") != "true" {
		t.Fatal("missing X-Replay-Truncated: true")
	}
	assertTruncatedEvent(t, c.next(), "w")
	got := c.nextData(1000)
	if got[0] != "e101" || got[999] != "e1100" {
		t.Fatalf("replay from %s to %s, want e101..e1100", got[0], got[999])
	}
	srv.publish("/events", map[string]any{"channel": "w", "data": "live"})
	if ev := c.next(); ev.Data != "live" {
		t.Fatalf("after the replay: %+v, want live", ev)
	}
}

// A replay truncated with nothing to replay (the client's cursor is of a
// history that is gone, or does not parse) moves the client's
// Last-Event-ID to where the stream starts: otherwise the client keeps its
// unusable cursor until the next event, and every reconnect until then (a
// reload, a network blip) is told truncated again though it missed nothing.
func TestTruncatedWithNothingToReplayMovesTheClientsID(t *testing.T) {
	srv := startCaddy(t, replaySite)
	ids := srv.publishN("a", "a", 1, 2)
	posA := seqOf(t, ids[1])
	stale := replay.EncodeCursor(replay.ChannelPosition{Hash: replay.HashChannel("b"),
		Pos: replay.Position{Epoch: posA.Epoch ^ 0x5a5a, Seq: 7, Time: posA.Time}})
	for _, tc := range []struct {
		name, path, cursor string
		onA                bool
	}{
		{"stale cursor", "/events?channels=b", stale, false},
		{"garbage cursor", "/events?channels=a", "not-a-cursor", true},
		{"garbage cursor, two channels", "/events?channels=a,b", "not-a-cursor", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := srv.subscribe(tc.path, header("Last-Event-ID", tc.cursor))
			if c.resp.Header.Get("X-Replay-Truncated") != "true" {
				t.Fatal("missing X-Replay-Truncated: true")
			}
			c.next() // sse_truncated
			// the id comes with the notice, in the same flush
			deadline := time.Now().Add(2 * time.Second)
			for c.lastSeenID.Load() == nil && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
			}
			last := c.lastSeenID.Load()
			if last == nil {
				t.Fatal("the stream did not move the client's Last-Event-ID: its reconnect sends the unusable cursor again")
			}
			c.close()
			// nothing was published since: the client has missed nothing
			r := srv.subscribe(tc.path, header("Last-Event-ID", *last))
			if tr := r.resp.Header.Get("X-Replay-Truncated"); tr != "" {
				t.Fatalf("reconnect with the stream's id told truncated again (X-Replay-Truncated: %s)", tr)
			}
			srv.publish("/events", map[string]any{"channel": "a", "data": "live-" + tc.name})
			if tc.onA {
				if ev := r.next(); ev.Data != "live-"+tc.name {
					t.Fatalf("got %+v, want the live event", ev)
				}
			}
		})
	}
}

// A replay of several channels is merged by publish time (SPEC S5), and
// each channel keeps its own order even where events of both channels
// share a millisecond (a sort that is not stable would swap them: the
// client would get a channel's events out of order, and its Last-Event-ID
// would end at an older one).
func TestMultiChannelReplayIsMergedByTimeInEachChannelsOrder(t *testing.T) {
	srv := startCaddy(t, `
:{PORT} {
	sse /events {
		channel {query.channels}
		history 1000
		replay_limit 1000
		publish {
			secret `+testSecret+`
		}
	}
}
`)
	fromStart := replay.EncodeCursor(
		replay.ChannelPosition{Hash: replay.HashChannel("a")},
		replay.ChannelPosition{Hash: replay.HashChannel("b")})

	// events a millisecond apart at least: the replay is in publish order
	var want []string
	for i := 1; i <= 3; i++ {
		for _, ch := range []string{"b", "a"} {
			data := ch + strconv.Itoa(i)
			srv.publish("/events", map[string]any{"channel": ch, "data": data})
			want = append(want, data)
			time.Sleep(2 * time.Millisecond) // the hub's clock has millisecond steps
		}
	}
	c := srv.subscribe("/events?channels=a,b", header("Last-Event-ID", fromStart))
	if got := c.nextData(len(want)); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("replay = %v, want %v (by publish time)", got, want)
	}
	c.close()

	// many events of both channels in the same milliseconds: each
	// channel's events come in its order
	fromStart = replay.EncodeCursor(
		replay.ChannelPosition{Hash: replay.HashChannel("c")},
		replay.ChannelPosition{Hash: replay.HashChannel("d")})
	const n = 200
	for i := 1; i <= n; i++ {
		for _, ch := range []string{"c", "d"} {
			srv.publish("/events", map[string]any{"channel": ch, "data": ch + strconv.Itoa(i)})
		}
	}
	r := srv.subscribe("/events?channels=c,d", header("Last-Event-ID", fromStart))
	next := map[byte]int{'c': 1, 'd': 1}
	for range 2 * n {
		ev := r.next()
		ch := ev.Data[0]
		if ev.Data != string(ch)+strconv.Itoa(next[ch]) {
			t.Fatalf("replay of channel %c: got %s, want %c%d", ch, ev.Data, ch, next[ch])
		}
		next[ch]++
	}
}

// A client whose cursor saw a channel while it was empty (b) is away while
// an event is published there, and the embedded hub's history is lost
// meanwhile (a config without sse ends the hub, as a restart does): its
// reconnect must be told b was truncated (SPEC S5: the history is not the
// one its cursor was made in), as a is, not replayed nothing on b as if it
// had missed nothing. (Found with Chromium: after a restart, a page on
// news,alerts was told only news was truncated.)
func TestCursorOfAnEmptyChannelIsTruncatedWhenTheHistoryIsLost(t *testing.T) {
	srv := startCaddy(t, replaySite)
	id := idHoldingBEmpty(t, srv, nil)
	srv.publish("/events", map[string]any{"channel": "b", "data": "lost"})
	srv.reload(`
:{PORT} {
	respond "no sse here"
}
`)
	srv.reload(replaySite)
	r := srv.subscribe("/events?channels=a,b", header("Last-Event-ID", id))
	if r.resp.Header.Get("X-Replay-Truncated") != "true" {
		t.Fatal("missing X-Replay-Truncated: true")
	}
	assertTruncatedEvent(t, r.next(), "a", "b")
}

// idHoldingBEmpty has a stream of channels a and b get event a1 and leave,
// and returns a1's id: it holds b as before its first event. subscribed,
// if not nil, waits until the hub delivers to the stream.
func idHoldingBEmpty(t *testing.T, srv *testServer, subscribed func()) string {
	t.Helper()
	c := srv.subscribe("/events?channels=a,b", nil)
	if subscribed != nil {
		subscribed()
	}
	srv.publish("/events", map[string]any{"channel": "a", "data": "a1"})
	ev := c.next()
	if ev.Data != "a1" || ev.ID == "" {
		t.Fatalf("got %+v, want a1 with an id", ev)
	}
	c.close()
	return ev.ID
}
