package caddysse

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/pubsub"
)

// redisSite is a site whose sse handler uses the Redis at url.
func redisSite(url string, extra ...string) string {
	return `
:{PORT} {
	sse /events {
		channel {query.channels}
		redis {
			url ` + url + `
			dial_timeout 300ms
			read_timeout 1s
			write_timeout 1s
			max_retries -1
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

func TestRedisPublishSubscribeAndReplay(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, redisSite(rds.URL()))
	c := srv.subscribe("/events?channels=a", nil)
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	ids := srv.publishN("a", "e", 1, 5)
	if got := c.nextData(5); fmt.Sprint(got) != "[e1 e2 e3 e4 e5]" {
		t.Fatalf("live: %v", got)
	}
	if n := rds.MustCLI("XLEN", "sse:{a}:s"); n != "5" {
		t.Fatalf("the history in Redis has %s events", n)
	}
	r := srv.subscribe("/events?channels=a", header("Last-Event-ID", ids[2]))
	if got := r.nextData(3); fmt.Sprint(got) != "[e3 e4 e5]" {
		t.Fatalf("replay from Redis: %v", got)
	}
}

// While Redis is down: publishing answers 503 with Retry-After, open
// streams stay open with heartbeats, a new stream opens live-only with
// sse_degraded; once Redis is back that stream replays from its cursor and
// continues live.
func TestRedisOutage(t *testing.T) {
	rds := redistest.Start(t, "--appendonly", "yes", "--appendfsync", "always")
	srv := startCaddy(t, redisSite(rds.URL(), "heartbeat 200ms"))
	open := srv.subscribe("/events?channels=a", nil)
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	ids := srv.publishN("a", "e", 1, 3)
	open.nextData(3)

	rds.Kill()
	status, body := srv.post("/events", "application/json", mustJSON(t, map[string]any{"channel": "a", "data": "x"}), nil)
	if status != http.StatusServiceUnavailable || !strings.Contains(string(body), "publish_failed") {
		t.Fatalf("publish with Redis down: %d %s", status, body)
	}
	resp := do(t, http.MethodPost, srv.base+"/events", header("Content-Type", "application/json", "Authorization", "Bearer "+testSecret), `{"channel":"a"}`)
	resp.Body.Close()
	if resp.Header.Get("Retry-After") == "" {
		t.Fatal("503 without Retry-After")
	}
	open.comment("heartbeat") // the open stream survives

	degraded := srv.subscribe("/events?channels=a", header("Last-Event-ID", ids[1]))
	ev := degraded.next()
	if ev.Type != "sse_degraded" {
		t.Fatalf("first event %+v, want sse_degraded", ev)
	}
	rds.Restart() // with its append-only file: the history is back
	if got := degraded.nextData(2); fmt.Sprint(got) != "[e2 e3]" {
		t.Fatalf("replay after Redis came back: %v", got)
	}
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	srv.publish("/events", map[string]any{"channel": "a", "data": "e4"})
	for _, c := range []*sseClient{open, degraded} {
		if got := c.next(); got.Data != "e4" {
			t.Fatalf("live after the outage: %+v", got)
		}
	}
}

// A reload with the same Redis settings keeps the hub: no duplicate Redis
// subscription, and the history stays.
func TestRedisReloadDoesNotDuplicateSubscriptions(t *testing.T) {
	rds := redistest.Start(t)
	site := redisSite(rds.URL())
	srv := startCaddy(t, site)
	c := srv.subscribe("/events?channels=a", nil)
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	srv.publish("/events", map[string]any{"channel": "a", "data": "before"})
	last := c.next()
	srv.reload(site)
	if ev := c.next(); ev.Type != "server_closing" {
		t.Fatalf("got %+v", ev)
	}
	r := openCountedStream(t, srv, rds, "a", header("Last-Event-ID", last.ID))
	srv.publish("/events", map[string]any{"channel": "a", "data": "after"})
	if got := r.next(); got.Data != "after" {
		t.Fatalf("got %+v", got)
	}
	// and again after a few more reloads
	for range 3 {
		srv.reload(site)
	}
	openCountedStream(t, srv, rds, "a", nil)
}

// openCountedStream opens a stream of channel and waits until Redis counts
// one subscriber of its shard channel, opening it again if it ended:
// Caddy's reload returns once the old servers' shutdowns are under way, so
// a connection made right after it may still reach the old server's
// socket and be told server_closing at once (as a browser would, the test
// comes back; seen about once in 200 runs on a loaded machine).
func openCountedStream(t *testing.T, srv *testServer, rds *redistest.Server, channel string, h http.Header) *sseClient {
	t.Helper()
	c := srv.subscribe("/events?channels="+channel, h)
	shard := "sse:{" + channel + "}"
	deadline := time.Now().Add(waitFor)
	for {
		out := rds.MustCLI("PUBSUB", "SHARDNUMSUB", shard)
		select {
		case <-c.done:
			t.Logf("the stream of %s ended (served by the old config?); opening another", channel)
			c = srv.subscribe("/events?channels="+channel, h)
			continue
		default:
		}
		if f := strings.Fields(out); len(f) == 2 && f[1] == "1" {
			return c
		}
		if time.Now().After(deadline) {
			t.Fatalf("shard channel %s has subscribers %q, want 1", shard, out)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestRedisFallbackLocal(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, redisSite(rds.URL(), "fallback local"))
	c := srv.subscribe("/events?channels=a", nil)
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	srv.publish("/events", map[string]any{"channel": "a", "data": "via redis"})
	c.next()
	rds.Kill()
	srv.publish("/events", map[string]any{"channel": "a", "data": "local"})
	ev := c.next()
	if ev.Data != "local" {
		t.Fatalf("got %+v", ev)
	}
	// a cursor that includes the local event is answered as truncated
	rds.Restart()
	r := srv.subscribe("/events?channels=a", header("Last-Event-ID", ev.ID))
	if r.resp.Header.Get("X-Replay-Truncated") != "true" {
		t.Fatal("a cursor with a local-fallback event must be truncated")
	}
}

// With fallback local, a stream open through a Redis outage goes on once
// Redis is back: the events Redis delivers then follow where the stream
// was in the shared history, not the local events it wrote meanwhile. It
// used to end at Redis' first event (a gap after the local position, which
// no history holds), and its reconnect was told sse_truncated and given
// the channel's kept history again, though it had missed nothing. A
// reconnect with an id that includes a local event is still truncated
// (TestRedisFallbackLocal); one with the id of a shared event after it is
// not. Two outages in a row, as one.
func TestRedisFallbackLocalStreamGoesOnOnceRedisIsBack(t *testing.T) {
	rds := redistest.Start(t, "--appendonly", "yes", "--appendfsync", "always")
	srv := startCaddy(t, redisSite(rds.URL(), "fallback local"))
	c := srv.subscribe("/events?channels=a", nil)
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	srv.publish("/events", map[string]any{"channel": "a", "data": "r1"})
	if ev := c.next(); ev.Data != "r1" {
		t.Fatalf("got %+v", ev)
	}
	for outage := 1; outage <= 2; outage++ {
		rds.Kill()
		local := "local " + itoa(outage)
		srv.publish("/events", map[string]any{"channel": "a", "data": local})
		if ev := c.next(); ev.Data != local {
			t.Fatalf("got %+v, want %q", ev, local)
		}
		rds.Restart()
		rds.WaitShardSubscribers(t, "sse:{a}", 1)
		rds.WaitFunction(t, pubsub.FunctionPublish)
		shared := "r" + itoa(outage+1)
		rds.MustCLI("FCALL", pubsub.FunctionPublish, "1", "sse:{a}", "", shared) // a backend's publish
		select {
		case ev, open := <-c.events:
			if !open || ev.Data != shared {
				t.Fatalf("after outage %d the stream got %+v (open %v), want %q: it missed nothing", outage, ev, open, shared)
			}
			r := srv.subscribe("/events?channels=a", header("Last-Event-ID", ev.ID))
			if r.resp.Header.Get("X-Replay-Truncated") == "true" {
				t.Fatalf("a reconnect with the id of %q was told truncated", shared)
			}
			rds.MustCLI("FCALL", "sse_publish_v1", "1", "sse:{a}", "", "next")
			if ev := r.next(); ev.Data != "next" {
				t.Fatalf("the reconnect got %+v, want the next event alone", ev)
			}
			if ev := c.next(); ev.Data != "next" {
				t.Fatalf("got %+v", ev)
			}
		case <-time.After(waitFor):
			t.Fatalf("after outage %d the stream got nothing", outage)
		}
	}
}

func TestRedisConfigErrors(t *testing.T) {
	cases := []struct{ name, redis, want string }{
		{"malformed url", "redis ftp://nope", "malformed URL"},
		{"options in the url", "redis redis://127.0.0.1:6379/0?pool_size=7&read_timeout=9s", "query are not used"},
		// a password with an unescaped %: the error must not show it
		{"malformed url with a password", "redis redis://app:p%ssw0rd-SECRET@127.0.0.1:6379/0", "malformed URL"},
		{"unset url variable", "redis {env.CADDY_SSE_TEST_UNSET_REDIS_URL}", "URL is empty"},
		// it connected without a password: every stream and publish was refused 503
		{"unset password variable", "redis {\n\t\t\turl redis://127.0.0.1:1\n\t\t\tpassword {env.CADDY_SSE_TEST_UNSET_REDIS_PASSWORD}\n\t\t}", "password is empty"},
		{"unset sentinel password variable", "redis {\n\t\t\taddresses 127.0.0.1:1\n\t\t\tsentinel m\n\t\t\tsentinel_password {env.CADDY_SSE_TEST_UNSET_REDIS_PASSWORD}\n\t\t}", "sentinel_password is empty"},
		{"address without port", "redis {\n\t\t\taddresses localhost\n\t\t}", "not host:port"},
		{"cluster with db", "redis {\n\t\t\taddresses 127.0.0.1:1 127.0.0.1:2\n\t\t\tdb 2\n\t\t}", "only database 0"},
		{"sentinel password without sentinel", "redis {\n\t\t\taddresses 127.0.0.1:1\n\t\t\tsentinel_password x\n\t\t}", "need sentinel"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg := adapt(t, globalOptions("")+`
:`+itoa(freePort(t))+` {
	sse /events {
		channel a
		`+tc.redis+`
	}
}
`)
			err := caddy.Load(cfg, true)
			if err == nil {
				_ = caddy.Stop()
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
			if strings.Contains(err.Error(), "SECRET") {
				t.Fatalf("the error shows the password: %v", err)
			}
		})
	}
	t.Run("fallback without redis", func(t *testing.T) {
		h := validHandler()
		h.Fallback = "local"
		if err := h.Validate(); err == nil || !strings.Contains(err.Error(), "needs redis") {
			t.Fatalf("error %v", err)
		}
	})
}

// A stream that opened degraded costs nothing while Redis stays down: it
// waits for the registry's ticker, in every writer (the takeover writer
// once serviced it over and over, a core's worth of CPU per stream).
func TestDegradedStreamIdlesWhileRedisIsDown(t *testing.T) {
	port := redistest.FreePort(t) // nothing listens there
	srv := startCaddy(t, redisSite(fmt.Sprintf("redis://127.0.0.1:%d", port), "heartbeat 1m"))
	c := srv.subscribe("/events?channels=a", nil)
	if ev := c.next(); ev.Type != "sse_degraded" {
		t.Fatalf("got %+v", ev)
	}
	before := processCPU()
	time.Sleep(time.Second)
	// idle is a few ms; the spin was the whole second
	if used := processCPU() - before; used > 300*time.Millisecond {
		t.Fatalf("the process used %v of CPU in a second with one degraded stream and nothing to do", used)
	}
}

// processCPU is the CPU time this process has used.
func processCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// Caddy starts while Redis is down: provisioning never touches the network.
// A stream opens degraded, and gets heartbeats meanwhile like any other
// (proxies must not cut it while Redis is away).
func TestRedisDownAtStart(t *testing.T) {
	port := redistest.FreePort(t) // nothing listens there
	srv := startCaddy(t, redisSite(fmt.Sprintf("redis://127.0.0.1:%d", port), "heartbeat 200ms"))
	c := srv.subscribe("/events?channels=a", nil)
	if ev := c.next(); ev.Type != "sse_degraded" {
		t.Fatalf("got %+v", ev)
	}
	c.comment("heartbeat")
	c.comment("heartbeat")
}

func TestRedisMetricsAndStats(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, redisSite(rds.URL())+`
:{PORT2} {
	metrics /metrics
}
`)
	srv.subscribe("/events?channels=a,b", nil)
	rds.WaitShardSubscribers(t, "sse:{b}", 1)
	resp := do(t, http.MethodGet, srv.base2+"/metrics", nil, "")
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	text := string(raw)
	for _, want := range []string{"caddy_sse_redis_up 1", "caddy_sse_redis_channels_subscribed 2"} {
		if !strings.Contains(text, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
}

// A Redis Cluster through Caddy: channels on every primary fan out and
// replay, whether the config lists every node or, as with a managed
// service's configuration endpoint, one address and `cluster` (SPEC S9);
// that one is a plain client without `cluster`, which the cluster answers
// MOVED for the other primaries' channels.
func TestRedisClusterThroughCaddy(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	for name, settings := range map[string]string{
		"every node":        "addresses " + strings.Join(cluster.Addrs(), " "),
		"one seed, cluster": "url redis://" + cluster.Nodes[0].Addr() + "\n\t\t\tcluster",
	} {
		t.Run(name, func(t *testing.T) {
			clusterFansOutAndReplays(t, cluster, startCaddy(t, redisBlockSite(settings)))
		})
	}
	// the same seed without `cluster`: what the other primaries hold fails,
	// and the log says why, once, at error level
	t.Run("one seed, no cluster", func(t *testing.T) {
		logFile := filepath.Join(t.TempDir(), "sse.log")
		srv := startCaddy(t, redisBlockSite("url redis://"+cluster.Nodes[0].Addr()), sseLog(logFile))
		for _, ch := range []string{"a", "b", "c"} {
			if cluster.NodeOfSlot(t, redistest.SlotOf(ch)) == cluster.Nodes[0] {
				continue
			}
			status, body := srv.post("/events", "application/json", mustJSON(t, map[string]any{"channel": ch, "data": "x"}), nil)
			if status != http.StatusServiceUnavailable || !strings.Contains(string(body), "MOVED") {
				t.Fatalf("publish to %s through a seed of another primary: %d %s", ch, status, body)
			}
		}
		b, _ := os.ReadFile(logFile)
		if n := strings.Count(string(b), `"msg":"redis is a cluster: list its nodes in addresses, or add cluster to use one address as a seed"`); n != 1 ||
			!strings.Contains(string(b), `"level":"error"`) {
			t.Fatalf("the MOVED answers were logged %d times (want once, at error level):\n%s", n, b)
		}
	})
}

// clusterFansOutAndReplays checks that srv, on cluster, fans out and
// replays channels of every primary.
func clusterFansOutAndReplays(t *testing.T, cluster *redistest.Cluster, srv *testServer) {
	// names whose hash slots are on three different primaries (0-5460,
	// 5461-10922, 10923-16383 after --cluster create)
	channels := "a,b,c"
	c := srv.subscribe("/events?channels="+channels, nil)
	for _, ch := range strings.Split(channels, ",") {
		cluster.NodeOfSlot(t, redistest.SlotOf(ch)).WaitShardSubscribers(t, "sse:{"+ch+"}", 1)
	}
	owners := map[string]bool{}
	for _, ch := range strings.Split(channels, ",") {
		owners[cluster.NodeOfSlot(t, redistest.SlotOf(ch)).Addr()] = true
	}
	if len(owners) != 3 {
		t.Fatalf("channels %s are on %d primaries, want 3", channels, len(owners))
	}
	var first map[int]string
	for i, ch := range strings.Split(channels, ",") {
		ids := srv.publishN(ch, ch, 1, 2)
		if i == 0 {
			first = ids
		}
	}
	// each channel is in order; channels on different primaries arrive
	// through different connections, so not in the order of publishing
	perChannel := map[byte][]string{}
	for _, data := range c.nextData(6) {
		perChannel[data[0]] = append(perChannel[data[0]], data)
	}
	if got := fmt.Sprint(perChannel['a'], perChannel['b'], perChannel['c']); got != "[a1 a2] [b1 b2] [c1 c2]" {
		t.Fatalf("live: %v", got)
	}
	r := srv.subscribe("/events?channels=a", header("Last-Event-ID", first[1]))
	if got := r.nextData(1); got[0] != "a2" {
		t.Fatalf("replay: %v", got)
	}
}

// After FLUSHALL a reconnect with an old id is told its replay is
// truncated (header and event), then gets the correct new events.
func TestRedisFlushAllTruncatesOldCursors(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, redisSite(rds.URL()))
	old := srv.publishN("a", "old", 1, 3)
	rds.MustCLI("FLUSHALL")
	srv.publishN("a", "new", 1, 2)
	c := srv.subscribe("/events?channels=a", header("Last-Event-ID", old[3]))
	if c.resp.Header.Get("X-Replay-Truncated") != "true" {
		t.Fatal("missing X-Replay-Truncated")
	}
	assertTruncatedEvent(t, c.next(), "a")
	if got := c.nextData(2); fmt.Sprint(got) != "[new1 new2]" {
		t.Fatalf("after the truncation: %v", got)
	}
}

// Sentinels that require their own password (requirepass in
// sentinel.conf), in front of data nodes with another one: with
// sentinel_password the master is found and events flow, also after a
// failover; without it, publishing fails loudly with 503.
func TestRedisSentinelWithPasswords(t *testing.T) {
	s := redistest.StartSentinelAuth(t, redistest.SentinelAuth{Data: "data-pw", Sentinel: "sentinel-pw"})
	site := func(path, sentinelPassword string) string {
		return `
	sse ` + path + ` {
		channel {query.channels}
		redis {
			addresses ` + s.Sentinel.Addr() + `
			sentinel ` + s.Master + `
			` + sentinelPassword + `
			password data-pw
			dial_timeout 300ms
			read_timeout 1s
			write_timeout 1s
			check_interval 300ms
			max_retries -1
		}
		publish {
			secret ` + testSecret + `
		}
	}`
	}
	srv := startCaddy(t, ":{PORT} {"+site("/events", "sentinel_password sentinel-pw")+site("/nopass", "")+"\n}\n")

	c := srv.subscribe("/events?channels=p", nil)
	s.Primary.WaitShardSubscribers(t, "sse:{p}", 1)
	srv.publish("/events", map[string]any{"channel": "p", "data": "one"})
	first := c.next()
	if first.Data != "one" {
		t.Fatalf("got %+v", first)
	}

	status, body := srv.post("/nopass", "application/json", mustJSON(t, map[string]any{"channel": "q", "data": "x"}), nil)
	if status != http.StatusServiceUnavailable || !strings.Contains(string(body), `"error"`) {
		t.Fatalf("without the sentinel password: %d %s", status, body)
	}

	s.Replica.WaitStreamLength(t, "sse:{p}:s", 1)
	s.Primary.Kill()
	deadline := time.Now().Add(30 * time.Second)
	s.WaitFailedOver(t, deadline)
	for {
		status, body := srv.post("/events", "application/json", mustJSON(t, map[string]any{"channel": "p", "data": "two"}), nil)
		if status == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("publishing after the failover: %d %s", status, body)
		}
		time.Sleep(100 * time.Millisecond)
	}
	r := srv.subscribe("/events?channels=p", header("Last-Event-ID", first.ID))
	if ev := r.next(); ev.Data != "two" {
		t.Fatalf("after the failover: %+v", ev)
	}
}

// A Sentinel failover that loses an acknowledged event: the stream that
// wrote it is not fed the event that took its seq on the new primary as
// if nothing happened — it ends — and its reconnect with the lost event's
// id is answered as truncated, then gets the new events.
func TestRedisFailoverLosingAnEventIsTruncation(t *testing.T) {
	s := redistest.StartSentinel(t)
	srv := startCaddy(t, sentinelSite(s))
	c, lost := publishAnEventTheReplicaMisses(t, s, srv)
	failOver(t, s)
	defer logChannelOnFailure(t, s.Replica, "f") // it failed once in CI, unexplained
	publishUntilAccepted(t, srv, "f", "new")     // the new primary gives the lost event's seq to it
	c.expectEnd()                                // never "new" in place of "lost"
	r := srv.subscribe("/events?channels=f", header("Last-Event-ID", lost.ID))
	if r.resp.Header.Get("X-Replay-Truncated") != "true" {
		t.Fatal("a cursor at an event lost in the failover must be truncated")
	}
	assertTruncatedEvent(t, r.next(), "f")
	if got := r.nextData(2); fmt.Sprint(got) != "[kept new]" {
		t.Fatalf("after the truncation: %v", got)
	}
}

// After a Sentinel failover that lost an event, a stream opened without a
// cursor gets the first event published on the new primary. This instance
// delivered the lost event before the failover; a stream that started
// there (and not at the new primary's head) ended at the new event that
// took the lost event's seq, with nothing written, and its client, which
// holds no id, reconnected live past that event.
func TestRedisFreshStreamAfterAFailoverThatLostAnEvent(t *testing.T) {
	s := redistest.StartSentinel(t)
	srv := startCaddy(t, sentinelSite(s))
	publishAnEventTheReplicaMisses(t, s, srv)
	failOver(t, s)
	time.Sleep(time.Second) // the watch compares the new primary's head
	fresh := srv.subscribe("/events?channels=f", nil)
	publishUntilAccepted(t, srv, "f", "new")
	if ev := fresh.next(); ev.Data != "new" {
		t.Fatalf("a fresh stream after the failover got %+v", ev)
	}
}

// publishAnEventTheReplicaMisses publishes "kept" to channel f, which the
// replica gets, then "lost", which it does not: it is frozen, and cut off
// by the primary so that nothing waits for it in its socket either. It
// returns the stream that got both, and the lost event as it got it.
func publishAnEventTheReplicaMisses(t *testing.T, s *redistest.Sentinel, srv *testServer) (*sseClient, sseEvent) {
	t.Helper()
	c := srv.subscribe("/events?channels=f", nil)
	s.Primary.WaitShardSubscribers(t, "sse:{f}", 1)
	srv.publish("/events", map[string]any{"channel": "f", "data": "kept"})
	c.next()
	s.Replica.WaitStreamLength(t, "sse:{f}:s", 1)
	s.Replica.Pause()
	s.Primary.MustCLI("CLIENT", "KILL", "TYPE", "replica")
	srv.publish("/events", map[string]any{"channel": "f", "data": "lost"})
	lost := c.next()
	if lost.Data != "lost" {
		t.Fatalf("got %+v", lost)
	}
	return c, lost
}

// failOver kills the primary and waits until the replica is the master
// and the instance follows channel f there.
func failOver(t *testing.T, s *redistest.Sentinel) {
	t.Helper()
	s.Primary.Kill()
	s.Replica.Resume()
	s.WaitFailedOver(t, time.Now().Add(30*time.Second))
	s.Replica.WaitShardSubscribers(t, "sse:{f}", 1)
}

// logChannelOnFailure logs, if the test failed, what Redis holds of
// channel: a failed run then says whether an event was missing there or
// on its way to the client.
func logChannelOnFailure(t *testing.T, rds *redistest.Server, channel string) {
	if !t.Failed() {
		return
	}
	for _, args := range [][]string{
		{"HGETALL", "sse:{" + channel + "}:m"},
		{"XRANGE", "sse:{" + channel + "}:s", "-", "+"},
		{"INFO", "replication"},
	} {
		out, err := rds.CLI(args...)
		t.Logf("%v on %d: %v\n%s", args, rds.Port, err, out)
	}
}

// publishUntilAccepted publishes data to channel until the publish is
// answered 200 (Redis may still be failing over).
func publishUntilAccepted(t *testing.T, srv *testServer, channel, data string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		status, _ := srv.post("/events", "application/json", mustJSON(t, map[string]any{"channel": channel, "data": data}), nil)
		if status == http.StatusOK {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("publishing %q: %d", data, status)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// A stream opened without a cursor after this instance delivered an event
// that a failover then lost (it started there, at the channel's head, and
// has written nothing) gets the events published on the new primary: its
// client holds no position that could be truncated. It ended at the first
// of them (it took the lost event's seq), and the client, without an id,
// reconnected live past it.
func TestRedisStreamOpenedAtAnEventAFailoverLostGetsTheNewEvents(t *testing.T) {
	s := redistest.StartSentinel(t)
	srv := startCaddy(t, sentinelSite(s))
	publishAnEventTheReplicaMisses(t, s, srv)
	fresh := srv.subscribe("/events?channels=f", nil)
	failOver(t, s)
	publishUntilAccepted(t, srv, "f", "new")
	publishUntilAccepted(t, srv, "f", "newer")
	if got := fresh.nextData(2); fmt.Sprint(got) != "[new newer]" {
		t.Fatalf("a stream opened at the lost event got %v", got)
	}
}

// sentinelSite is a site whose sse handler uses the Sentinel set-up s.
func sentinelSite(s *redistest.Sentinel) string {
	return `
:{PORT} {
	sse /events {
		channel {query.channels}
		redis {
			addresses ` + s.Sentinel.Addr() + `
			sentinel ` + s.Master + `
			dial_timeout 300ms
			read_timeout 1s
			write_timeout 1s
			check_interval 300ms
		}
		publish {
			secret ` + testSecret + `
		}
	}
}
`
}

// With Redis, the admin stats add each top principal's streams across
// every instance (the leases in Redis), and name the Redis backend.
func TestRedisAdminStatsCountPrincipalsAcrossInstances(t *testing.T) {
	rds := redistest.Start(t)
	srv, admin := startCaddyWithAdmin(t, redisSite(rds.URL(), "principal {query.user}", "max_connections_per_principal 5"))
	srv.subscribe("/events?channels=a&user=u1", nil).comment("ok")
	// another instance's lease for the same principal, as its leases would
	// be stored (prefix sse:, score = expiry in ms)
	rds.MustCLI("ZADD", "sse:lease:{u1}", fmt.Sprint(time.Now().Add(time.Minute).UnixMilli()), "other-instance:1")
	status, got := getStats(t, admin+"/sse/stats")
	if status != 200 || len(got.Hubs) != 1 || len(got.Hubs[0].TopPrincipals) != 1 {
		t.Fatalf("stats: %d %+v", status, got)
	}
	p := got.Hubs[0].TopPrincipals[0]
	if p.Principal != "u1" || p.Streams != 1 || p.ClusterStreams == nil || *p.ClusterStreams != 2 {
		t.Fatalf("principal stats %+v (cluster %v), want u1 with 1 stream here and 2 across instances", p, p.ClusterStreams)
	}
	if !strings.HasPrefix(got.Hubs[0].Backend, "redis ") {
		t.Fatalf("backend %q", got.Hubs[0].Backend)
	}
}

// With fallback local, a stream that opened while Redis was down (degraded,
// live-only) gets the events published meanwhile on this instance, as the
// streams opened before the outage do: no history has them to replay later.
func TestRedisDegradedStreamGetsLocalFallbackEvents(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, redisSite(rds.URL(), "fallback local", "heartbeat 200ms"))
	old := srv.subscribe("/events?channels=a", nil)
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	rds.Kill()
	srv.publish("/events", map[string]any{"channel": "a", "data": "local 1"}) // this instance learns Redis is down
	if ev := old.next(); ev.Data != "local 1" {
		t.Fatalf("the stream opened before the outage got %+v", ev)
	}
	degraded := srv.subscribe("/events?channels=a", nil)
	if ev := degraded.next(); ev.Type != "sse_degraded" {
		t.Fatalf("got %+v", ev)
	}
	srv.publish("/events", map[string]any{"channel": "a", "data": "local 2"})
	for name, c := range map[string]*sseClient{"old": old, "degraded": degraded} {
		if ev := c.next(); ev.Data != "local 2" {
			t.Fatalf("%s stream got %+v", name, ev)
		}
	}
}

// Seed 001: "On indexer event, publish to Redis channel stream:{streamId}
// and user:{address}" -- the backend publishes straight into Redis (README:
// "Caddy loads it on every primary it talks to"), Caddy only holds the
// streams (no publish through Caddy first).
func TestDirectRedisPublishReachesStreamsWithoutAPublishThroughCaddy(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, redisSite(rds.URL()))
	c := srv.subscribe("/events?channels=stream:42,user:GABC", nil)
	c.comment("ok")
	rds.WaitShardSubscribers(t, "sse:{stream:42}", 1)
	rds.WaitShardSubscribers(t, "sse:{user:GABC}", 1)
	var out string
	deadline := time.Now().Add(5 * time.Second)
	for {
		out, _ = rds.CLI("FCALL", "sse_publish_v1", "1", "sse:{stream:42}", "status", `{"s":"paid"}`)
		if !strings.Contains(out, "ERR") || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if strings.Contains(out, "ERR") {
		t.Fatalf("direct publish with a subscriber open: %s", out)
	}
	rds.MustCLI("FCALL", "sse_publish_v1", "1", "sse:{user:GABC}", "balance", `{"b":1}`)
	if got := c.nextData(2); fmt.Sprint(got) != `[{"s":"paid"} {"b":1}]` {
		t.Fatalf("got %v", got)
	}
}

// redisBlockSite is redisSite with the redis block's settings given in
// full, for tests that need other Redis settings than redisSite's.
func redisBlockSite(settings string, extra ...string) string {
	return `
:{PORT} {
	sse /events {
		channel {query.channels}
		redis {
			` + settings + `
		}
		` + strings.Join(extra, "\n\t\t") + `
		publish {
			secret ` + testSecret + `
		}
	}
}
`
}

// publishWhileRefused publishes until Redis takes the event, within the
// test deadline, and returns the ids of the reply. Tests call it while
// Redis is down or refuses the call: a 503 then published nothing (one
// whose call reached Redis may have: TestRedisFailedPublishIsRetriedOnce-
// UnderItsOfferedKey).
func (s *testServer) publishWhileRefused(channel, data string) map[string]string {
	s.t.Helper()
	deadline := time.Now().Add(waitFor)
	for {
		status, body := s.post("/events", "application/json", mustJSON(s.t, map[string]any{"channel": channel, "data": data}), nil)
		if status == http.StatusOK {
			var out struct {
				IDs map[string]string `json:"ids"`
			}
			if err := json.Unmarshal(body, &out); err != nil {
				s.t.Fatalf("publish reply %q: %v", body, err)
			}
			return out.IDs
		}
		if status != http.StatusServiceUnavailable || time.Now().After(deadline) {
			s.t.Fatalf("publish %q: %d %s", data, status, body)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// go-redis sends a command again when its reply does not come within
// read_timeout (max_retries defaults to 3), and a frozen Redis runs every
// copy waiting in its sockets once it resumes. One POST is one event all
// the same, and when a later attempt gets the reply the POST answers with
// that event's id.
func TestRedisPublishRetriedAfterTimeoutIsPublishedOnce(t *testing.T) {
	rds := redistest.Start(t)
	// no max_retries: go-redis' default, as a user who does not set it gets
	srv := startCaddy(t, redisBlockSite("url "+rds.URL()+"\n\t\t\tdial_timeout 300ms\n\t\t\tread_timeout 300ms\n\t\t\twrite_timeout 300ms\n\t\t\tcheck_interval 300ms"))
	c := srv.subscribe("/events?channels=a", nil)
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	srv.publish("/events", map[string]any{"channel": "a", "data": "before"})
	c.next()

	rds.Pause()
	type answer struct {
		status int
		body   []byte
	}
	result := make(chan answer, 1)
	go func() {
		status, body := srv.post("/events", "application/json", mustJSON(t, map[string]any{"channel": "a", "data": "once"}), nil)
		result <- answer{status, body}
	}()
	time.Sleep(900 * time.Millisecond) // Redis frozen for three read timeouts
	rds.Resume()
	var got answer
	select {
	case got = <-result:
	case <-time.After(waitFor):
		t.Fatal("the publish did not return")
	}
	srv.publishWhileRefused("a", "after")
	var events []sseEvent
	for {
		ev := c.next()
		if ev.Data == "after" {
			break
		}
		events = append(events, ev)
	}
	xlen := rds.MustCLI("XLEN", "sse:{a}:s")
	if len(events) > 1 || (xlen != "2" && xlen != "3") {
		t.Fatalf("one POST (answered %d) became %d events on the stream %+v; the history has %s events (want at most 3)", got.status, len(events), events, xlen)
	}
	if got.status == http.StatusOK {
		var reply struct {
			IDs map[string]string `json:"ids"`
		}
		if err := json.Unmarshal(got.body, &reply); err != nil {
			t.Fatal(err)
		}
		if len(events) != 1 || reply.IDs["a"] != events[0].ID {
			t.Fatalf("the POST answered %s, the stream got %+v", got.body, events)
		}
	}
}

// Redis at maxmemory with noeviction refuses the publish with "OOM command
// not allowed when used memory > 'maxmemory'": that is not Redis forbidding
// functions, so the broker keeps them, and loads the library again when
// Redis lost it (a restart without persistence, FUNCTION FLUSH): backends
// that publish with FCALL sse_publish_v1 find it (SPEC S9).
func TestRedisOutOfMemoryIsNotFunctionsForbidden(t *testing.T) {
	rds := redistest.Start(t, "--maxmemory-policy", "noeviction")
	srv := startCaddy(t, redisSite(rds.URL()))
	srv.publish("/events", map[string]any{"channel": "a", "data": "loads the library"})

	rds.MustCLI("CONFIG", "SET", "maxmemory", "1")
	status, body := srv.post("/events", "application/json", mustJSON(t, map[string]any{"channel": "a", "data": "refused"}), nil)
	if status != http.StatusServiceUnavailable {
		t.Fatalf("publish with Redis out of memory: %d %s", status, body)
	}
	rds.MustCLI("CONFIG", "SET", "maxmemory", "0")

	// Redis loses its functions (a restart without persistence does too)
	rds.MustCLI("FUNCTION", "FLUSH")
	srv.publish("/events", map[string]any{"channel": "a", "data": "through caddy"})
	out, err := rds.CLI("FCALL", "sse_publish_v1", "1", "sse:{a}", "", "from a backend")
	if err != nil || strings.Contains(out, "ERR") {
		t.Fatalf("a backend's FCALL sse_publish_v1 after Caddy published: %v %s", err, out)
	}
}

// SPEC S1: one hub per Redis (address set + prefix), shared by every sse
// handler of the process, whatever their handler settings: two routes on
// the same Redis, one with `fallback local`, share one hub (one shard
// subscription). While Redis is down a publish on the fallback route is
// "delivered to this instance" (S9): to its subscribers of every route.
func TestRedisFallbackLocalReachesEveryRouteOfTheInstance(t *testing.T) {
	rds := redistest.Start(t)
	redisBlock := `redis {
			url ` + rds.URL() + `
			dial_timeout 300ms
			read_timeout 1s
			max_retries -1
			check_interval 300ms
		}`
	srv := startCaddy(t, `
:{PORT} {
	sse /events {
		channel {query.channels}
		`+redisBlock+`
		fallback local
		publish {
			secret `+testSecret+`
		}
	}
	sse /other {
		channel {query.channels}
		`+redisBlock+`
	}
}
`)
	fallback := srv.subscribe("/events?channels=a", nil)
	other := srv.subscribe("/other?channels=a", nil)
	fallback.comment("ok")
	other.comment("ok")
	srv.publish("/events", map[string]any{"channel": "a", "data": "via redis"})
	fallback.next()
	other.next()
	if n := rds.MustCLI("PUBSUB", "SHARDNUMSUB", "sse:{a}"); !strings.HasSuffix(n, "1") {
		t.Errorf("two routes on one Redis hold %s shard subscriptions (one hub per Redis: want 1)", strings.Fields(n)[1])
	}
	rds.Kill()
	srv.publish("/events", map[string]any{"channel": "a", "data": "local"})
	if ev := fallback.next(); ev.Data != "local" {
		t.Fatalf("fallback route got %+v", ev)
	}
	if ev := other.next(); ev.Data != "local" {
		t.Fatalf("the other route on the same instance got %+v", ev)
	}
}

// Seed 000: "Graceful fallback to local in-memory broadcast if Redis is
// offline" with a Redis that hangs (SIGSTOP: a partition or a stuck
// primary), publishing to two channels at once as seed 001 does. The
// first publish waits for one go-redis retry cycle (it may still get an
// answer), not one per channel; once Redis is known not to answer, a
// publish no longer waits for it at all, whether it started before or
// after; and once Redis runs again the next publish reaches it.
func TestRedisFallbackLocalWhileRedisHangs(t *testing.T) {
	rds := redistest.Start(t)
	// one retry: a cycle is at most 2 read timeouts (4 s)
	srv := startCaddy(t, redisBlockSite("url "+rds.URL()+"\n\t\t\tread_timeout 2s\n\t\t\tmax_retries 1", "fallback local"))
	c := srv.subscribe("/events?channels=stream:42,user:GABC", nil)
	rds.WaitShardSubscribers(t, "sse:{stream:42}", 1)
	rds.WaitShardSubscribers(t, "sse:{user:GABC}", 1)
	both := []string{"stream:42", "user:GABC"}
	srv.publish("/events", map[string]any{"channel": both, "data": "before"})
	c.nextData(2)
	rds.Pause()
	resumed := false
	defer func() {
		if !resumed {
			rds.Resume()
		}
	}()
	timed := func(data string) time.Duration {
		began := time.Now()
		srv.publish("/events", map[string]any{"channel": both, "data": data})
		return time.Since(began)
	}
	first := make(chan time.Duration, 1)
	go func() { first <- timed("during 0") }()
	time.Sleep(2500 * time.Millisecond) // the first publish's first attempt timed out
	if took := timed("during 1"); took > time.Second {
		t.Errorf("a publish while another one waits for a hung Redis took %v", took)
	}
	took := <-first
	t.Logf("the first publish into a hung Redis took %v", took)
	if took > 5*time.Second {
		t.Errorf("the first publish into a hung Redis took %v (one retry cycle is 4 s, for one of its channels)", took)
	}
	if took := timed("during 2"); took > time.Second {
		t.Errorf("a publish into a Redis known to hang took %v", took)
	}
	got := map[string]int{}
	for range 6 {
		got[c.next().Data]++
	}
	if got["during 0"] != 2 || got["during 1"] != 2 || got["during 2"] != 2 {
		t.Fatalf("the stream got %v, want each event of both channels", got)
	}

	rds.Resume()
	resumed = true
	deadline := time.Now().Add(2 * time.Second)
	for i := 0; ; i++ {
		data := "after " + strconv.Itoa(i)
		srv.publish("/events", map[string]any{"channel": both, "data": data})
		if newest := rds.MustCLI("XREVRANGE", "sse:{stream:42}:s", "+", "-", "COUNT", "1"); strings.Contains(newest, data) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("publishes did not reach Redis within 2 s of it running again")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// An open stream whose channel's history is lost in Redis (FLUSHALL, an
// eviction) while it is open is not fed the new epoch's events as if they
// followed the ones it wrote: that would be a silent hole (SPEC S7). It
// ends, and its reconnect is told it was truncated, then gets the new
// events.
func TestRedisOpenStreamEndsWhenItsHistoryIsLost(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, redisSite(rds.URL()))
	c := srv.subscribe("/events?channels=a", nil)
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	srv.publishN("a", "old", 1, 2)
	last := c.next()
	if last.Data != "old1" {
		t.Fatalf("got %+v", last)
	}
	if last = c.next(); last.Data != "old2" {
		t.Fatalf("got %+v", last)
	}
	rds.MustCLI("FLUSHALL")
	srv.publishN("a", "new", 1, 1)
	c.expectEnd()
	r := srv.subscribe("/events?channels=a", header("Last-Event-ID", last.ID))
	if r.resp.Header.Get("X-Replay-Truncated") != "true" {
		t.Fatal("missing X-Replay-Truncated")
	}
	assertTruncatedEvent(t, r.next(), "a")
	if ev := r.next(); ev.Data != "new1" {
		t.Fatalf("after the truncation: %+v", ev)
	}
}
