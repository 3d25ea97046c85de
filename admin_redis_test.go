package caddysse

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// metricsRedisSite is redisSite with a /metrics on the same site.
func metricsRedisSite(url string, extra ...string) string {
	return strings.Replace(redisSite(url, extra...), ":{PORT} {", ":{PORT} {\n\tmetrics /metrics", 1)
}

// Without max_connections_per_principal a stream takes no lease, so Redis
// has no cross-instance count of its principal: /sse/stats leaves
// cluster_streams out rather than answer 0 beside a stream right here.
func TestClusterStreamsLeftOutWithoutACap(t *testing.T) {
	rds := redistest.Start(t)
	srv, admin := startCaddyWithAdmin(t, redisSite(rds.URL(), "principal {query.user}"))
	srv.subscribe("/events?channels=a&user=u1", nil).comment("ok")
	status, got := getStats(t, admin+"/sse/stats")
	if status != 200 || len(got.Hubs) != 1 || len(got.Hubs[0].TopPrincipals) != 1 {
		t.Fatalf("stats: %d %+v", status, got)
	}
	p := got.Hubs[0].TopPrincipals[0]
	if p.Streams != 1 {
		t.Fatalf("principal %+v", p)
	}
	if p.ClusterStreams != nil {
		t.Fatalf("cluster_streams = %d for a principal whose %d stream(s) here hold no lease", *p.ClusterStreams, p.Streams)
	}
}

// caddy_sse_rejections_total counts publish refusals too: a publish
// answered 503 publish_failed (Redis down) is counted under its code.
func TestAFailedPublishIsCountedAsARejection(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, metricsRedisSite(rds.URL()))
	srv.publish("/events", map[string]any{"channel": "a", "data": "x"})
	rds.Kill()
	status, body := srv.post("/events", "application/json", mustJSON(t, map[string]any{"channel": "a", "data": "y"}), nil)
	if status != http.StatusServiceUnavailable || !strings.Contains(string(body), "publish_failed") {
		t.Fatalf("publish with Redis down: %d %s", status, body)
	}
	scrape := srv.scrape()
	if !strings.Contains(scrape, `caddy_sse_rejections_total{reason="publish_failed"}`) {
		t.Fatalf("a 503 publish_failed is not in caddy_sse_rejections_total:\n%s", grepLines(scrape, "caddy_sse_rejections_total"))
	}
	if got := metric(t, scrape, `caddy_sse_rejections_total{reason="publish_failed"}`); got != 1 {
		t.Fatalf("publish_failed = %v, want 1", got)
	}
}

// One outage of one Redis is one reconnection; caddy_sse_redis_up follows
// the outage (0 while down, 1 once back).
func TestOneRedisOutageIsOneReconnection(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, metricsRedisSite(rds.URL()))
	c := srv.subscribe("/events?channels=a", nil)
	c.comment("ok")
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	if got := metric(t, srv.scrape(), "caddy_sse_redis_reconnects_total"); got != 0 {
		t.Fatalf("reconnects before any outage: %v", got)
	}
	rds.Kill()
	eventually(t, "redis_up to be 0 after the kill", func() bool {
		return metric(t, srv.scrape(), "caddy_sse_redis_up") == 0
	})
	time.Sleep(1500 * time.Millisecond) // an outage of several reconnection attempts (backoff from 50 ms)
	rds.Restart()
	eventually(t, "redis_up to be 1 after the restart", func() bool {
		return metric(t, srv.scrape(), "caddy_sse_redis_up") == 1
	})
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	if got := metric(t, srv.scrape(), "caddy_sse_redis_reconnects_total"); got != 1 {
		t.Fatalf("caddy_sse_redis_reconnects_total = %v after one outage, want 1 (not one per failed attempt)", got)
	}
}

// Two Redis databases on one server are two backends; /sse/stats must tell
// them apart.
func TestStatsNameTwoDatabasesApart(t *testing.T) {
	rds := redistest.Start(t)
	srv, admin := startCaddyWithAdmin(t, fmt.Sprintf(`
:{PORT} {
	sse /zero {
		channel {query.channels}
		redis %s/0
	}
	sse /one {
		channel {query.channels}
		redis %s/1
	}
}
`, rds.URL(), rds.URL()))
	srv.subscribe("/zero?channels=a", nil).comment("ok")
	srv.subscribe("/one?channels=b", nil).comment("ok")
	_, got := getStats(t, admin+"/sse/stats")
	if len(got.Hubs) != 2 {
		t.Fatalf("hubs: %+v", got.Hubs)
	}
	if got.Hubs[0].Backend == got.Hubs[1].Backend {
		t.Fatalf("two backends (db 0 and db 1) are both listed as %q", got.Hubs[0].Backend)
	}
}

// Two handlers on the same Redis and prefix that differ only in a
// connection setting get a hub each (README): /sse/stats tells them apart
// by a hash of their settings.
func TestStatsTellHubsOfOneRedisApart(t *testing.T) {
	rds := redistest.Start(t)
	srv, admin := startCaddyWithAdmin(t, fmt.Sprintf(`
:{PORT} {
	sse /a {
		channel {query.channels}
		redis %s
	}
	sse /b {
		channel {query.channels}
		redis {
			url %s
			pool_size 7
		}
	}
}
`, rds.URL(), rds.URL()))
	srv.subscribe("/a?channels=x", nil).comment("ok")
	srv.subscribe("/b?channels=x", nil).comment("ok")
	_, got := getStats(t, admin+"/sse/stats")
	var names []string
	for _, h := range got.Hubs {
		names = append(names, h.Backend)
	}
	if len(names) != 2 || names[0] == names[1] || !strings.Contains(names[0], " settings ") {
		t.Fatalf("hubs of one Redis with two pool sizes listed as %q", names)
	}
}

func grepLines(text, sub string) string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// On a Redis Cluster, the principals' leases live on several primaries:
// cluster_streams counts each principal where its lease lives, including
// another instance's lease.
func TestClusterStreamsOnARedisCluster(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	srv, admin := startCaddyWithAdmin(t, `
:{PORT} {
	sse /events {
		channel {query.channels}
		principal {query.user}
		max_connections_per_principal 5
		redis {
			addresses `+strings.Join(cluster.Addrs(), " ")+`
		}
	}
}
`)
	users := []string{"a", "b", "c"} // lease keys sse:lease:{a} ... on three primaries
	owners := map[string]bool{}
	for _, u := range users {
		srv.subscribe("/events?channels=x&user="+u, nil).comment("ok")
		owners[cluster.NodeOfSlot(t, redistest.SlotOf(u)).Addr()] = true
	}
	if len(owners) != 3 {
		t.Fatalf("leases on %d primaries, want 3", len(owners))
	}
	node := cluster.NodeOfSlot(t, redistest.SlotOf("b"))
	node.MustCLI("ZADD", "sse:lease:{b}", fmt.Sprint(time.Now().Add(time.Minute).UnixMilli()), "other-instance:1")
	status, got := getStats(t, admin+"/sse/stats")
	if status != 200 || len(got.Hubs) != 1 || got.Hubs[0].ClusterError != "" || len(got.Hubs[0].TopPrincipals) != 3 {
		t.Fatalf("stats: %d %+v", status, got)
	}
	for _, p := range got.Hubs[0].TopPrincipals {
		want := 1
		if p.Principal == "b" {
			want = 2
		}
		if p.ClusterStreams == nil || *p.ClusterStreams != want {
			t.Errorf("%s: cluster_streams %v, want %d", p.Principal, p.ClusterStreams, want)
		}
	}
}

// caddy_sse_redis_channels_subscribed goes back to 0 once the streams end,
// and after a reload closes them.
func TestRedisChannelsSubscribedReturnsToZero(t *testing.T) {
	rds := redistest.Start(t)
	site := metricsRedisSite(rds.URL(), "close_jitter off")
	srv := startCaddy(t, site)
	c := srv.subscribe("/events?channels=a,b", nil)
	rds.WaitShardSubscribers(t, "sse:{b}", 1)
	if got := metric(t, srv.scrape(), "caddy_sse_redis_channels_subscribed"); got != 2 {
		t.Fatalf("channels_subscribed %v, want 2", got)
	}
	c.close()
	eventually(t, "channels_subscribed back to 0", func() bool {
		return metric(t, srv.scrape(), "caddy_sse_redis_channels_subscribed") == 0
	})
	d := srv.subscribe("/events?channels=c", nil)
	rds.WaitShardSubscribers(t, "sse:{c}", 1)
	srv.reload(site)
	if ev := d.next(); ev.Type != "server_closing" {
		t.Fatalf("got %+v", ev)
	}
	eventually(t, "channels_subscribed back to 0 after the reload", func() bool {
		s := srv.scrape()
		return metric(t, s, "caddy_sse_redis_channels_subscribed") == 0 && metric(t, s, "caddy_sse_streams_open") == 0
	})
}

// caddy_sse_redis_reconnects_total is a counter: it runs on across a
// reload that replaces the Redis hub (any other Redis setting makes a new
// one) instead of falling back to the new hub's count (README: counters run
// on across reloads).
func TestRedisReconnectsRunOnAcrossAReloadThatReplacesTheHub(t *testing.T) {
	rds := redistest.Start(t)
	site := metricsRedisSite(rds.URL())
	srv := startCaddy(t, site)
	c := srv.subscribe("/events?channels=a", nil)
	c.comment("ok")
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	rds.Kill()
	eventually(t, "redis_up to be 0 after the kill", func() bool {
		return metric(t, srv.scrape(), "caddy_sse_redis_up") == 0
	})
	rds.Restart()
	eventually(t, "one reconnection", func() bool {
		return metric(t, srv.scrape(), "caddy_sse_redis_reconnects_total") == 1
	})
	srv.reload(strings.Replace(site, "check_interval 300ms", "check_interval 400ms", 1))
	if got := metric(t, srv.scrape(), "caddy_sse_redis_reconnects_total"); got != 1 {
		t.Fatalf("caddy_sse_redis_reconnects_total = %v after a reload that replaced the hub, want 1", got)
	}
}

// /sse/stats lists the channels of streams: not the hub's internal channel
// of throttle announcements, which every Redis hub follows once it checked
// a throttle (it was listed as a channel with one stream, and counted).
func TestStatsLeaveOutTheInternalThrottleChannel(t *testing.T) {
	rds := redistest.Start(t)
	srv, admin := startCaddyWithAdmin(t, redisSite(rds.URL()))
	c := srv.subscribe("/events?channels=a", nil)
	c.comment("ok")
	_, got := getStats(t, admin+"/sse/stats")
	if len(got.Hubs) != 1 {
		t.Fatalf("hubs: %+v", got.Hubs)
	}
	if hs := got.Hubs[0]; hs.Channels != 1 || len(hs.TopChannels) != 1 || hs.TopChannels[0].Channel != "a" {
		t.Fatalf("channels %d, top %+v; want only a", hs.Channels, hs.TopChannels)
	}
}

// /sse/stats answers within its bound on the cluster-wide counts (2 s)
// while Redis hangs, with this instance's counts and a cluster_error: it
// took go-redis' read timeout (5 s), past the timeouts of a monitor that
// polls it, just when Redis misbehaves.
func TestStatsAnswerInTimeWhileRedisHangs(t *testing.T) {
	rds := redistest.Start(t)
	srv, admin := startCaddyWithAdmin(t, cappedRetryNowSite("redis "+rds.URL()))
	c := srv.subscribe("/events?user=u", nil)
	c.comment("ok")
	rds.Pause()
	defer rds.Resume()
	start := time.Now()
	_, got := getStats(t, admin+"/sse/stats")
	if took := time.Since(start); took > clusterCountTimeout+time.Second {
		t.Errorf("the stats took %v", took)
	}
	if len(got.Hubs) != 1 || got.Hubs[0].OpenStreams != 1 || got.Hubs[0].ClusterError == "" {
		t.Fatalf("stats %+v, want the stream counted here and a cluster_error", got)
	}
}

// caddy_sse_redis_up tells an unreachable Redis before any stream or
// publish used it: a config loaded (or reloaded) onto a Redis that is down,
// or onto a wrong address, reported 1 for as long as no traffic came, and
// an alert on the metric never fired. A scrape is a use: it has the hub
// connect, in the background (Provision still touches no network).
func TestRedisUpTellsAnUnreachableRedisBeforeAnyTraffic(t *testing.T) {
	rds := redistest.Start(t)
	rds.Kill()
	srv := startCaddy(t, metricsRedisSite(rds.URL()))
	eventually(t, "redis_up to be 0 with Redis down and no traffic", func() bool {
		return metric(t, srv.scrape(), "caddy_sse_redis_up") == 0
	})
	rds.Restart()
	eventually(t, "redis_up to be 1 once Redis answers, still without traffic", func() bool {
		return metric(t, srv.scrape(), "caddy_sse_redis_up") == 1
	})
}

// caddy_sse_redis_history_reads_total counts the reads of histories that
// streams asked of Redis, and caddy_sse_redis_history_reads_sent_total
// those sent to it: a reconnect's replay is one of each when no other
// stream asks the same at once (pubsub's tests hold those that do). Both
// run on across a reload that replaces the hub.
func TestRedisHistoryReadsAreCounted(t *testing.T) {
	rds := redistest.Start(t)
	site := metricsRedisSite(rds.URL())
	srv := startCaddy(t, site)
	first := srv.publish("/events", map[string]any{"channel": "a", "data": "1"})
	srv.publish("/events", map[string]any{"channel": "a", "data": "2"})
	srv.subscribe("/events?channels=a", nil).comment("ok") // the instance follows a
	before := srv.scrape()
	reads0, sent0 := metric(t, before, "caddy_sse_redis_history_reads_total"), metric(t, before, "caddy_sse_redis_history_reads_sent_total")
	const reconnects = 3
	for range reconnects {
		c := srv.subscribe("/events?channels=a", header("Last-Event-ID", first["a"]))
		if ev := c.next(); ev.Data != "2" {
			t.Fatalf("the replay: %+v", ev)
		}
		c.close()
	}
	after := srv.scrape()
	reads, sent := metric(t, after, "caddy_sse_redis_history_reads_total"), metric(t, after, "caddy_sse_redis_history_reads_sent_total")
	// the hub's own reads (its throttles') may fall between the scrapes
	if reads-reads0 < reconnects || sent-sent0 != reads-reads0 {
		t.Fatalf("after %d reconnects one at a time: history reads %v → %v, sent %v → %v; want each %d more (or more, alike)",
			reconnects, reads0, reads, sent0, sent, reconnects)
	}
	srv.reload(strings.Replace(site, "check_interval 300ms", "check_interval 400ms", 1))
	s := srv.scrape()
	if got, gotSent := metric(t, s, "caddy_sse_redis_history_reads_total"), metric(t, s, "caddy_sse_redis_history_reads_sent_total"); got < reads || gotSent < sent {
		t.Fatalf("after a reload that replaced the hub: history reads %v, sent %v; they were %v, %v", got, gotSent, reads, sent)
	}
}
