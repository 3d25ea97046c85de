package caddysse

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/replay"
)

// rejectedCalls is the rejected_calls of a command in Redis' INFO
// commandstats (an ACL refusal is one).
func rejectedCalls(t *testing.T, rds *redistest.Server, command string) int {
	t.Helper()
	for _, line := range strings.Split(rds.MustCLI("INFO", "commandstats"), "\n") {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_"+command+":"); ok {
			for _, field := range strings.Split(rest, ",") {
				if v, ok := strings.CutPrefix(field, "rejected_calls="); ok {
					n, _ := strconv.Atoi(v)
					return n
				}
			}
		}
	}
	return 0
}

// aclSite is a site whose sse handler reaches rds as the ACL user app
// (password pw), with /metrics and the handler's extra settings.
// startACLCaddy runs site (an aclSite) and unloads it when the test ends,
// before the test's Redis stops (cleanups run last first).
func startACLCaddy(t *testing.T, site string, globals ...string) *testServer {
	t.Helper()
	srv := startCaddy(t, site, globals...)
	t.Cleanup(func() { _ = caddy.Load([]byte(`{"admin":{"disabled":true}}`), true) })
	return srv
}

func aclSite(rds *redistest.Server, extra ...string) string {
	return `
:{PORT} {
	metrics /metrics
	sse /events {
		channel {query.channels}
		redis {
			url ` + rds.URL() + `
			username app
			password pw
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

// A Redis ACL user that may publish but not subscribe to the shard
// channels (no SSUBSCRIBE). The refused subscription was taken for Redis
// being unreachable: "redis is unreachable" and "reachable again" were
// logged at every retry, every 2 s, and a new stream opened as if all was
// well and never got an event. Redis answers: it is no outage, but its
// channels cannot deliver, so SPEC S9's rules for that apply. The refusal
// is logged once (at error level, naming the permission), the metrics and
// the admin stats say so, a new stream opens degraded (sse_degraded) and,
// once the ACL grants the subscriptions, gets what was published since it
// opened and goes on live.
func TestRedisUserThatMayNotSubscribe(t *testing.T) {
	rds := redistest.Start(t)
	rds.MustCLI("ACL", "SETUSER", "app", "on", ">pw", "~sse:*", "&sse:*", "+@all", "-ssubscribe")
	logFile := filepath.Join(t.TempDir(), "sse.log")
	admin := "127.0.0.1:" + strconv.Itoa(freePort(t))
	srv := startACLCaddy(t, aclSite(rds, "heartbeat 200ms"), "admin "+admin, sseLog(logFile))
	logs := func() string {
		b, _ := os.ReadFile(logFile)
		return string(b)
	}

	c := srv.subscribe("/events?channels=a", nil)
	if ev := c.next(); ev.Type != "sse_degraded" {
		t.Fatalf("first event %+v, want sse_degraded: a stream that can get no live event opened as if it could", ev)
	}
	// Redis refused the subscription a few times meanwhile (retries)
	eventually(t, "the subscription to be refused three times", func() bool { return rejectedCalls(t, rds, "ssubscribe") >= 3 })
	text := logs()
	if n := strings.Count(text, "redis refuses this instance's subscriptions"); n != 1 {
		t.Fatalf("the refusal was logged %d times, want once:\n%s", n, text)
	}
	if !strings.Contains(text, "+ssubscribe &sse:*") || !strings.Contains(text, `"level":"error"`) {
		t.Fatalf("the refusal's log does not name what the user needs at error level:\n%s", text)
	}
	if strings.Contains(text, "unreachable") {
		t.Fatalf("Redis answers, but was logged as unreachable:\n%s", text)
	}
	scrape := srv.scrape()
	if metric(t, scrape, "caddy_sse_redis_up") != 1 || metric(t, scrape, "caddy_sse_redis_channels_denied") != 1 {
		t.Fatalf("metrics while the subscription is refused:\n%s", scrape)
	}
	if _, stats := getStats(t, "http://"+admin+"/sse/stats"); len(stats.Hubs) != 1 || !strings.Contains(stats.Hubs[0].SubscribeError, "NOPERM") {
		t.Fatalf("stats while the subscription is refused: %+v", stats)
	}
	srv.publish("/events", map[string]any{"channel": "a", "data": "meanwhile"}) // publishing works

	rds.MustCLI("ACL", "SETUSER", "app", "+ssubscribe")
	expectCaughtUpThenLive(t, srv, rds, c, "a", "meanwhile", "live")
	if metric(t, srv.scrape(), "caddy_sse_redis_channels_denied") != 0 {
		t.Fatal("the metric still counts the channel as refused")
	}
	eventually(t, "the accepted subscriptions to be logged", func() bool {
		return strings.Contains(logs(), "redis accepts this instance's subscriptions to its shard channels again")
	})
}

// A Redis user granted only some of the prefix's channels: Redis refuses
// an SSUBSCRIBE of several channels as a whole when it denies one, so one
// client asking for a denied channel kept every channel of the primary
// from its live events (the instance subscribes a primary's channels in
// one command). Only the denied channel's streams are treated as while
// Redis cannot deliver (sse_degraded, then its events once the ACL grants
// it); the others stay live, and the metric counts the one refused.
// (Redis refuses the denied channel's publishes too.)
func TestRedisUserGrantedSomeChannelsKeepsTheOthersLive(t *testing.T) {
	rds := redistest.Start(t)
	rds.MustCLI("ACL", "SETUSER", "app", "on", ">pw", "~sse:*", "+@all", "resetchannels",
		"&sse:{a}", "&sse:{c}", "&sse:{sse,throttles}")
	admin := "127.0.0.1:" + strconv.Itoa(freePort(t))
	srv := startACLCaddy(t, aclSite(rds), "admin "+admin)
	a, c := srv.subscribe("/events?channels=a", nil), srv.subscribe("/events?channels=c", nil)
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	rds.WaitShardSubscribers(t, "sse:{c}", 1)

	b := srv.subscribe("/events?channels=b", nil)
	if ev := b.next(); ev.Type != "sse_degraded" {
		t.Fatalf("first event of the denied channel's stream %+v, want sse_degraded", ev)
	}
	srv.publish("/events", map[string]any{"channel": "a", "data": "a-live"})
	srv.publish("/events", map[string]any{"channel": "c", "data": "c-live"})
	if ev := a.next(); ev.Data != "a-live" {
		t.Fatalf("a granted channel's stream got %+v beside a denied one, want its live event", ev)
	}
	if ev := c.next(); ev.Data != "c-live" {
		t.Fatalf("a granted channel's stream got %+v beside a denied one, want its live event", ev)
	}
	if n := metric(t, srv.scrape(), "caddy_sse_redis_channels_denied"); n != 1 {
		t.Fatalf("caddy_sse_redis_channels_denied = %v, want the one denied channel", n)
	}
	if _, stats := getStats(t, "http://"+admin+"/sse/stats"); len(stats.Hubs) != 1 || !strings.Contains(stats.Hubs[0].SubscribeError, "sse:{b}") {
		t.Fatalf("stats do not name the refused channel: %+v", stats)
	}

	rds.MustCLI("ACL", "SETUSER", "app", "&sse:{b}") // publishing to b was refused too until now
	rds.WaitShardSubscribers(t, "sse:{b}", 1)
	srv.publish("/events", map[string]any{"channel": "b", "data": "b-live"})
	if ev := b.next(); ev.Data != "b-live" {
		t.Fatalf("live after the ACL granted the channel: %+v", ev)
	}
	eventually(t, "the metric to count no refused channel", func() bool {
		return metric(t, srv.scrape(), "caddy_sse_redis_channels_denied") == 0
	})
}

// Refused channels are asked for again a few at a time (a user refused
// SSUBSCRIBE altogether would otherwise send every channel every retry),
// and all at once as soon as Redis accepts one: a hundred refused
// channels all go live again promptly once the ACL grants them, not a
// batch per retry period.
func TestRedisManyRefusedChannelsAllGoLiveOnceGranted(t *testing.T) {
	rds := redistest.Start(t)
	rds.MustCLI("ACL", "SETUSER", "app", "on", ">pw", "~sse:*", "&sse:*", "+@all", "-ssubscribe")
	srv := startCaddy(t, aclSite(rds, "max_channels 100"))
	names := make([]string, 100)
	for i := range names {
		names[i] = fmt.Sprintf("ch%d", i)
	}
	c := srv.subscribe("/events?channels="+strings.Join(names, ","), nil)
	if ev := c.next(); ev.Type != "sse_degraded" {
		t.Fatalf("first event %+v, want sse_degraded", ev)
	}
	eventually(t, "every channel to be refused", func() bool {
		return metric(t, srv.scrape(), "caddy_sse_redis_channels_denied") == 100
	})
	rds.MustCLI("ACL", "SETUSER", "app", "+ssubscribe")
	eventually(t, "every channel to be accepted", func() bool {
		return metric(t, srv.scrape(), "caddy_sse_redis_channels_denied") == 0
	})
	last := names[len(names)-1]
	rds.WaitShardSubscribers(t, "sse:{"+last+"}", 1)
	srv.publish("/events", map[string]any{"channel": last, "data": "live"})
	if ev := c.next(); ev.Data != "live" {
		t.Fatalf("after the grant: %+v", ev)
	}
}

// A stream of a granted and a refused channel: it was degraded as a whole
// (no live event of the granted channel either) until Redis accepted the
// refused one, which a deliberate ACL may never do. Now only the refused
// channel waits: sse_degraded names it alone, the granted channel's events
// arrive live (their ids leave out the refused channel, whose position the
// stream does not know), and once the ACL grants it, the stream gets what
// was published to it since it opened (here by a backend's own Redis user)
// and goes on live with both.
func TestRedisStreamOfAGrantedAndARefusedChannelKeepsTheGrantedOneLive(t *testing.T) {
	rds := redistest.Start(t)
	rds.MustCLI("ACL", "SETUSER", "app", "on", ">pw", "~sse:*", "+@all", "resetchannels",
		"&sse:{a}", "&sse:{sse,throttles}")
	srv := startACLCaddy(t, aclSite(rds))
	srv.publish("/events", map[string]any{"channel": "a", "data": "a-before"}) // loads the library

	c := srv.subscribe("/events?channels=a,b", nil)
	if ev := c.next(); ev.Type != "sse_degraded" || ev.Data != `{"channels":["b"]}` {
		t.Fatalf("first event %+v, want sse_degraded naming the refused channel only", ev)
	}
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	srv.publish("/events", map[string]any{"channel": "a", "data": "a-live"})
	ev := c.next()
	if ev.Data != "a-live" {
		t.Fatalf("the granted channel's event beside a refused one: %+v, want it live", ev)
	}
	if cursor, ok := replay.ParseCursor(ev.ID); !ok || len(cursor) != 1 {
		t.Fatalf("id %q of the granted channel's event, want a cursor of that channel alone", ev.ID)
	}

	rds.MustCLI("FCALL", "sse_publish_v1", "1", "sse:{b}", "", "b-meanwhile") // a backend's user may
	rds.MustCLI("ACL", "SETUSER", "app", "&sse:{b}")
	if ev := c.next(); ev.Data != "b-meanwhile" {
		t.Fatalf("after the ACL granted the refused channel: %+v, want what was published to it since the stream opened", ev)
	}
	rds.WaitShardSubscribers(t, "sse:{b}", 1)
	srv.publish("/events", map[string]any{"channel": "b", "data": "b-live"})
	srv.publish("/events", map[string]any{"channel": "a", "data": "a-after"})
	if got := c.nextData(2); got[0] != "b-live" || got[1] != "a-after" {
		t.Fatalf("live after the grant: %q", got)
	}
}

// A stream waiting for a refused channel whose queue overflows catches up
// on the others from the history, and not on the refused one: reading its
// history fails for as long as Redis refuses it, which would end the stream.
func TestRedisStreamWaitingForARefusedChannelCatchesUpOnTheOthers(t *testing.T) {
	rds := redistest.Start(t)
	rds.MustCLI("ACL", "SETUSER", "app", "on", ">pw", "~sse:*", "+@all", "resetchannels",
		"&sse:{a}", "&sse:{sse,throttles}")
	srv := startACLCaddy(t, aclSite(rds, "queue 2", "history 1000", "history_bytes 16MiB", "slow_client_timeout 1m"))
	overflowCatchUp(t, srv, "a,b", func(c *sseClient) {
		if ev := c.next(); ev.Type != "sse_degraded" {
			t.Fatalf("first event %+v, want sse_degraded", ev)
		}
		rds.WaitShardSubscribers(t, "sse:{a}", 1)
	})
}

// A stream all of whose channels Redis refuses is degraded as a whole; once
// the ACL grants one of them, that one starts (what was published to it
// since the stream opened, then live) without waiting for the other.
func TestRedisStreamOfRefusedChannelsStartsEachOneGranted(t *testing.T) {
	rds := redistest.Start(t)
	rds.MustCLI("ACL", "SETUSER", "app", "on", ">pw", "~sse:*", "+@all", "resetchannels", "&sse:{sse,throttles}")
	srv := startACLCaddy(t, aclSite(rds))
	c := srv.subscribe("/events?channels=a,b", nil)
	if ev := c.next(); ev.Type != "sse_degraded" || ev.Data != `{"channels":["a","b"]}` {
		t.Fatalf("first event %+v, want sse_degraded naming both channels", ev)
	}
	eventually(t, "the instance to load its library (for the backend's FCALL)", func() bool {
		return strings.Contains(rds.MustCLI("FUNCTION", "LIST"), "sse_publish_v1")
	})
	rds.MustCLI("FCALL", "sse_publish_v1", "1", "sse:{a}", "", "a-meanwhile")
	rds.MustCLI("ACL", "SETUSER", "app", "&sse:{a}")
	expectCaughtUpThenLive(t, srv, rds, c, "a", "a-meanwhile", "a-live") // while b is refused
	rds.MustCLI("FCALL", "sse_publish_v1", "1", "sse:{b}", "", "b-meanwhile")
	rds.MustCLI("ACL", "SETUSER", "app", "&sse:{b}")
	if ev := c.next(); ev.Data != "b-meanwhile" {
		t.Fatalf("after the ACL granted the other channel: %+v", ev)
	}
}

// A Redis user refused PING (an ACL without +ping). A quiet pub/sub
// connection is pinged every check interval, and the NOPERM that answered
// it, with no subscription awaiting a reply, was taken for Redis refusing
// the shard's subscriptions: the connection was dropped, its channels
// unsubscribed for the reconnection's backoff (up to 2 s, again at every
// quiet check interval), new streams opened degraded meanwhile, and the
// error log asked for +ssubscribe, which the user had. A refused PING is
// an answer: the connection is alive and keeps its subscriptions, and
// what the user lacks is logged once.
func TestRedisUserRefusedPingKeepsItsSubscriptions(t *testing.T) {
	rds := redistest.Start(t)
	grants := slices.DeleteFunc(slices.Concat(aclLibrary, aclCommands), func(g string) bool { return g == "+ping" })
	setACLUser(t, rds, grants...)
	logFile := filepath.Join(t.TempDir(), "sse.log")
	srv := startCaddy(t, aclSite(rds, "heartbeat 200ms"), sseLog(logFile))
	logs := func() string {
		b, _ := os.ReadFile(logFile)
		return string(b)
	}
	c := srv.subscribe("/events?channels=a", nil)
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	eventually(t, "the quiet connection's PING to be refused three times", func() bool { return rejectedCalls(t, rds, "ping") >= 3 })

	if text := logs(); strings.Contains(text, "refuses this instance's subscriptions") {
		t.Fatalf("a refused PING was taken for refused subscriptions:\n%s", text)
	}
	if n := metric(t, srv.scrape(), "caddy_sse_redis_channels_denied"); n != 0 {
		t.Fatalf("caddy_sse_redis_channels_denied = %v after refused PINGs", n)
	}
	d := srv.subscribe("/events?channels=a", nil)
	srv.publish("/events", map[string]any{"channel": "a", "data": "live"})
	for _, s := range []*sseClient{c, d} {
		if ev := s.next(); ev.Data != "live" {
			t.Fatalf("after refused PINGs: %+v, want the live event", ev)
		}
	}
	if n := strings.Count(logs(), `"acl_needed":"+ping"`); n != 1 {
		t.Fatalf("the refused PING was logged %d times, want once:\n%s", n, logs())
	}
}

// A stream that opens with a cursor and waits for refused channels writes
// the replay of the others at once: caddy_sse_replays_total counts it then,
// once. It counted it only when Redis accepted a refused channel (never,
// with an ACL that does not grant it), and again at each refused channel
// started. A replay truncated in any part counts once as truncated.
func TestRedisStreamWaitingForRefusedChannelsCountsItsReplayOnce(t *testing.T) {
	rds := redistest.Start(t)
	rds.MustCLI("ACL", "SETUSER", "app", "on", ">pw", "~sse:*", "+@all", "resetchannels",
		"&sse:{a}", "&sse:{b}", "&sse:{c}", "&sse:{sse,throttles}")
	srv := startACLCaddy(t, aclSite(rds))
	c := srv.subscribe("/events?channels=a,b,c", nil)
	for _, ch := range []string{"a", "b", "c"} {
		rds.WaitShardSubscribers(t, "sse:{"+ch+"}", 1)
	}
	for _, ch := range []string{"a", "b", "c"} {
		srv.publish("/events", map[string]any{"channel": ch, "data": ch + "1"})
	}
	cursor := expectData(t, c, "a1", "b1", "c1")[2].ID
	c.close()
	rds.WaitShardSubscribers(t, "sse:{b}", 0)
	rds.WaitShardSubscribers(t, "sse:{c}", 0)
	rds.MustCLI("ACL", "SETUSER", "app", "resetchannels", "&sse:{a}", "&sse:{sse,throttles}")
	counts := func() (replays, truncated float64) {
		scrape := srv.scrape()
		return metric(t, scrape, "caddy_sse_replays_total"), metric(t, scrape, "caddy_sse_replays_truncated_total")
	}
	replays, truncated := counts()

	srv.publish("/events", map[string]any{"channel": "a", "data": "a2"})
	for _, data := range []string{"b2", "b3", "b4"} { // a history of 2: b's replay is truncated
		rds.MustCLI("FCALL", "sse_publish_v1", "1", "sse:{b}", "", data, "2")
	}
	rds.MustCLI("FCALL", "sse_publish_v1", "1", "sse:{c}", "", "c2")
	c = srv.subscribe("/events?channels=a,b,c", header("Last-Event-ID", cursor))
	if ev := c.next(); ev.Type != "sse_degraded" || ev.Data != `{"channels":["b","c"]}` {
		t.Fatalf("first event %+v, want sse_degraded naming b and c", ev)
	}
	expectData(t, c, "a2")
	if r, tr := counts(); r != replays+1 || tr != truncated {
		t.Fatalf("after the replay of a: replays_total %v, replays_truncated_total %v; want %v, %v", r, tr, replays+1, truncated)
	}
	rds.MustCLI("ACL", "SETUSER", "app", "&sse:{c}")
	expectData(t, c, "c2")
	if r, tr := counts(); r != replays+1 || tr != truncated {
		t.Fatalf("after c started: replays_total %v, replays_truncated_total %v; want %v, %v", r, tr, replays+1, truncated)
	}
	rds.MustCLI("ACL", "SETUSER", "app", "&sse:{b}")
	if ev := c.next(); ev.Type != "sse_truncated" || ev.Data != `{"channels":["b"]}` {
		t.Fatalf("once b started: %+v, want sse_truncated naming b", ev)
	}
	expectData(t, c, "b3", "b4")
	if r, tr := counts(); r != replays+1 || tr != truncated+1 {
		t.Fatalf("after b started, truncated: replays_total %v, replays_truncated_total %v; want %v, %v", r, tr, replays+1, truncated+1)
	}
}

// A reconnect whose cursor names a channel Redis refuses, to an instance
// that did not follow that channel yet. Its read of the history did not
// wait to learn of the refusal (a new stream's does): it replayed and went
// on without sse_degraded, and got no live event of that channel. It now
// opens degraded as a new stream does, and replays after its cursor once
// Redis accepts the channel.
func TestRedisReconnectToARefusedChannelNotYetFollowedOpensDegraded(t *testing.T) {
	rds := redistest.Start(t)
	rds.MustCLI("ACL", "SETUSER", "app", "on", ">pw", "~sse:*", "+@all", "resetchannels",
		"&sse:{b}", "&sse:{sse,throttles}")
	srv := startACLCaddy(t, aclSite(rds))
	cursor := srv.publish("/events", map[string]any{"channel": "b", "data": "b1"})["b"] // no stream follows b
	rds.MustCLI("ACL", "SETUSER", "app", "resetchannels", "&sse:{sse,throttles}")
	rds.MustCLI("FCALL", "sse_publish_v1", "1", "sse:{b}", "", "b2") // a backend's user may

	c := srv.subscribe("/events?channels=b", header("Last-Event-ID", cursor))
	if ev := c.next(); ev.Type != "sse_degraded" || ev.Data != `{"channels":["b"]}` {
		t.Fatalf("first event %+v, want sse_degraded: a reconnect to a refused channel opened as if it were live", ev)
	}
	rds.MustCLI("ACL", "SETUSER", "app", "&sse:{b}")
	expectCaughtUpThenLive(t, srv, rds, c, "b", "b2", "b3")
}

// expectCaughtUpThenLive expects, once Redis accepts channel's
// subscription, what was published to it meanwhile, then a live event.
func expectCaughtUpThenLive(t *testing.T, srv *testServer, rds *redistest.Server, c *sseClient, channel, meanwhile, live string) {
	t.Helper()
	if ev := c.next(); ev.Data != meanwhile {
		t.Fatalf("once Redis accepted %s: %+v, want %q, published to it since the stream opened", channel, ev, meanwhile)
	}
	rds.WaitShardSubscribers(t, "sse:{"+channel+"}", 1)
	srv.publish("/events", map[string]any{"channel": channel, "data": live})
	if ev := c.next(); ev.Data != live {
		t.Fatalf("live on %s once Redis accepted it: %+v, want %q", channel, ev, live)
	}
}

// A stream that waits for a refused channel and whose other channel's
// replay is truncated opens with sse_truncated, its first event as for any
// stream (SPEC S5), then sse_degraded naming the refused channel, then the
// replay. sse_degraded came first: a client that looks for the truncation
// in the first event missed it.
func TestRedisStreamWaitingForARefusedChannelToldTruncatedFirst(t *testing.T) {
	rds := redistest.Start(t)
	rds.MustCLI("ACL", "SETUSER", "app", "on", ">pw", "~sse:*", "+@all", "resetchannels",
		"&sse:{a}", "&sse:{b}", "&sse:{sse,throttles}")
	srv := startACLCaddy(t, aclSite(rds))
	c := srv.subscribe("/events?channels=a,b", nil)
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	rds.WaitShardSubscribers(t, "sse:{b}", 1)
	srv.publish("/events", map[string]any{"channel": "a", "data": "a1"})
	cursor := expectData(t, c, "a1")[0].ID
	c.close()
	rds.WaitShardSubscribers(t, "sse:{b}", 0)
	rds.MustCLI("ACL", "SETUSER", "app", "resetchannels", "&sse:{a}", "&sse:{sse,throttles}")
	for _, data := range []string{"a2", "a3", "a4"} { // a history of 2: a's replay is truncated
		rds.MustCLI("FCALL", "sse_publish_v1", "1", "sse:{a}", "", data, "2")
	}

	c = srv.subscribe("/events?channels=a,b", header("Last-Event-ID", cursor))
	if c.resp.Header.Get("X-Replay-Truncated") != "true" {
		t.Fatal("no X-Replay-Truncated header")
	}
	assertTruncatedEvent(t, c.next(), "a")
	if ev := c.next(); ev.Type != "sse_degraded" || ev.Data != `{"channels":["b"]}` {
		t.Fatalf("second event %+v, want sse_degraded naming b", ev)
	}
	expectData(t, c, "a3", "a4")
}
