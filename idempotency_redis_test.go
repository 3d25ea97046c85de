package caddysse

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/clusterslot"
	"github.com/caddy-sse/caddy-sse/internal/redistest"
	"github.com/caddy-sse/caddy-sse/pubsub"
)

// With fallback local, a keyed publish made while Redis is down is known to
// this instance only; once Redis is back, its retry with the same
// Idempotency-Key gets the first reply, not a second publish through Redis.
func TestAKeyedPublishOnTheFallbackIsNotPublishedAgain(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, redisSite(rds.URL(), "fallback local"))
	c := srv.subscribe("/events?channels=a", nil)
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	rds.Kill()
	body := mustJSON(t, map[string]any{"channel": "a", "data": "once"})
	key := header("Idempotency-Key", "k-fallback")
	s1, r1 := srv.post("/events", "application/json", body, key)
	if s1 != 200 {
		t.Fatalf("keyed publish on the local fallback: %d %s", s1, r1)
	}
	if ev := c.next(); ev.Data != "once" {
		t.Fatalf("got %+v", ev)
	}
	rds.Restart()
	// the stream that got the local event ends once Redis is back (its
	// cursor is answered as truncated): watch with a new one
	after := srv.subscribe("/events?channels=a", nil)
	rds.WaitShardSubscribers(t, "sse:{a}", 1) // this instance talks to Redis again
	s2, r2, replayed := postWithHeaders(t, srv, body, key)
	srv.publishWhileRefused("a", "sentinel")
	var again []sseEvent
	for {
		ev := after.next()
		if ev.Data == "sentinel" {
			break
		}
		if ev.Data == "once" {
			again = append(again, ev)
		}
	}
	if s2 != 200 || string(r2) != string(r1) || replayed != "true" || len(again) != 0 {
		t.Fatalf("retry with the same Idempotency-Key: %d %s (Idempotent-Replayed %q), first reply %s; the event was published %d more times",
			s2, r2, replayed, r1, len(again))
	}
}

// postWithHeaders publishes body with the secret and hdr, and returns the
// status, the body and the Idempotent-Replayed header.
func postWithHeaders(t *testing.T, srv *testServer, body []byte, hdr http.Header) (int, []byte, string) {
	t.Helper()
	h := header("Content-Type", "application/json", "Authorization", "Bearer "+testSecret)
	for k, v := range hdr {
		h[k] = v
	}
	resp := do(t, http.MethodPost, srv.base+"/events", h, string(body))
	defer resp.Body.Close()
	var b strings.Builder
	buf := make([]byte, 4096)
	for {
		n, err := resp.Body.Read(buf)
		b.Write(buf[:n])
		if err != nil {
			break
		}
	}
	return resp.StatusCode, []byte(b.String()), resp.Header.Get("Idempotent-Replayed")
}

// Cluster, a publish to channels on two primaries, one of which hangs past
// read_timeout: the reply is 503 naming the hung channel. The publisher
// retries with the same Idempotency-Key once the primary answers again
// (what the 503 + Retry-After asks for): the retry must not publish the
// event a second time, neither to the channel that was published (its id
// was even in the failure) nor to the one whose call ran once the primary
// resumed: its publishes carry a token of the key, with which Redis
// answers a channel's second publish with the first one's position.
func TestAKeyedRetryAfterAPartialFailurePublishesOnce(t *testing.T) {
	cluster := redistest.StartCluster(t, 3)
	srv := startCaddy(t, redisBlockSite("addresses "+strings.Join(cluster.Addrs(), " ")+
		"\n\t\t\tdial_timeout 300ms\n\t\t\tread_timeout 300ms\n\t\t\twrite_timeout 300ms\n\t\t\tmax_retries -1\n\t\t\tcheck_interval 300ms"))
	hung := cluster.NodeOfSlot(t, redistest.SlotOf("b"))
	if cluster.NodeOfSlot(t, redistest.SlotOf("a")) == hung {
		t.Fatal("a and b are on one primary; the test proves nothing")
	}
	// an Idempotency-Key whose Redis key is not on the hung primary
	key := ""
	for i := 0; key == ""; i++ {
		k := fmt.Sprintf("k%d", i)
		if cluster.NodeOfSlot(t, int(clusterslot.Of("sse:idem:{\x00"+k+"}"))) != hung {
			key = k
		}
	}
	ca := srv.subscribe("/events?channels=a", nil)
	cb := srv.subscribe("/events?channels=b", nil)
	cluster.NodeOfSlot(t, redistest.SlotOf("a")).WaitShardSubscribers(t, "sse:{a}", 1)
	hung.WaitShardSubscribers(t, "sse:{b}", 1)

	body := mustJSON(t, map[string]any{"channel": []string{"a", "b"}, "data": "once"})
	hung.Pause()
	s1, r1 := srv.post("/events", "application/json", body, header("Idempotency-Key", key))
	hung.Resume()
	var failure errorBody
	_ = json.Unmarshal(r1, &failure)
	if s1 != http.StatusServiceUnavailable || fmt.Sprint(failure.Channels) != "[b]" || failure.IDs["a"] == "" {
		t.Fatalf("first attempt: %d %s, want 503 naming b, with a's id", s1, r1)
	}
	deadline := time.Now().Add(waitFor)
	for {
		s, r := srv.post("/events", "application/json", body, header("Idempotency-Key", key))
		if s == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("retry: %d %s", s, r)
		}
		time.Sleep(100 * time.Millisecond)
	}
	srv.publishWhileRefused("a", "sentinel")
	srv.publishWhileRefused("b", "sentinel")
	count := func(c *sseClient) int {
		n := 0
		for {
			ev := c.next()
			if ev.Data == "sentinel" {
				return n
			}
			if ev.Data == "once" {
				n++
			}
		}
	}
	na, nb := count(ca), count(cb)
	if na != 1 || nb != 1 {
		t.Fatalf("one publish retried with its Idempotency-Key reached a %d times and b %d times, want once each", na, nb)
	}
}

// A keyed publish fails on one of its channels (here a key of the wrong
// type stands where b's history goes): its publish to a is kept under a
// token of the Idempotency-Key for as long as the key is (10 minutes,
// SPEC S6), not only go-redis' retry window (30 s): a retry that a
// publisher with backoff sends a minute later must not publish a again.
// Nor count it again: caddy_sse_events_published_total counted a's first
// event twice, Redis' answer to the retry being a publish for all it said.
func TestAKeyedPartialFailureIsRememberedAsLongAsItsKey(t *testing.T) {
	rds := redistest.Start(t)
	srv := startCaddy(t, metricsRedisSite(rds.URL()))
	rds.MustCLI("SET", "sse:{b}:m", "not a hash")
	body := mustJSON(t, map[string]any{"channel": []string{"a", "b"}, "data": "once"})
	key := header("Idempotency-Key", "k-partial")
	s1, r1 := srv.post("/events", "application/json", body, key)
	var failure errorBody
	_ = json.Unmarshal(r1, &failure)
	if s1 != http.StatusServiceUnavailable || fmt.Sprint(failure.Channels) != "[b]" || failure.IDs["a"] == "" {
		t.Fatalf("first attempt: %d %s, want 503 naming b, with a's id", s1, r1)
	}
	tokens := strings.Fields(rds.MustCLI("--scan", "--pattern", "sse:{a}:p:*"))
	if len(tokens) != 1 {
		t.Fatalf("publish tokens of a: %q, want one", tokens)
	}
	ttl, _ := strconv.Atoi(rds.MustCLI("PTTL", tokens[0]))
	if time.Duration(ttl)*time.Millisecond < pubsub.IdempotencyTTL-time.Minute {
		t.Fatalf("a's publish is remembered for %d ms, the Idempotency-Key for %v", ttl, pubsub.IdempotencyTTL)
	}
	rds.MustCLI("DEL", "sse:{b}:m")
	s2, r2 := srv.post("/events", "application/json", body, key)
	var reply publishReply
	_ = json.Unmarshal(r2, &reply)
	if s2 != http.StatusOK || reply.IDs["a"] != failure.IDs["a"] || reply.IDs["b"] == "" {
		t.Fatalf("retry: %d %s, want 200 with a's first id %s", s2, r2, failure.IDs["a"])
	}
	if n := metric(t, srv.scrape(), "caddy_sse_events_published_total"); n != 2 {
		t.Errorf("caddy_sse_events_published_total = %v, want 2 (a and b, once each)", n)
	}
}

// A keyed publish in flight while a reload replaces the Redis hub (a
// setting of the redis block changed, e.g. a timeout or a rotated
// password). Caddy does not wait for the old config's requests before
// cleaning it up, and the old hub was closed under the publish: it failed
// 503, and its claim of the key, which the closed client could no longer
// give back, made every retry with the key wait ~30 s for it to lapse. The
// publish is answered as if no reload came, and its retry replays it.
func TestAPublishInFlightDuringAReloadThatReplacesTheHubIsAnswered(t *testing.T) {
	rds := redistest.Start(t)
	proxy := startStallingProxy(t, rds.Addr(), "held-publish")
	site := func(pool int) string {
		return redisBlockSite("url redis://" + proxy.addr() + "\n\t\t\tread_timeout 2s\n\t\t\tmax_retries 1\n\t\t\tpool_size " + itoa(pool))
	}
	srv := startCaddy(t, site(3))
	srv.publish("/events", map[string]any{"channel": "a", "data": "warm"})
	body := mustJSON(t, map[string]any{"channel": "a", "data": "held-publish"})
	key := header("Idempotency-Key", "invoice-7-paid")
	proxy.arm()
	answered := make(chan int, 1)
	go func() {
		status, _ := srv.post("/events", "application/json", body, key)
		answered <- status
	}()
	select {
	case <-proxy.stalled:
	case <-time.After(waitFor):
		t.Fatal("the publish never reached Redis")
	}
	proxy.armed.Store(false) // go-redis' retry, after read_timeout, gets through
	srv.reload(site(4))      // a hub of its own; the old one is let go
	select {
	case status := <-answered:
		if status != http.StatusOK {
			t.Errorf("the publish in flight during the reload answered %d", status)
		}
	case <-time.After(waitFor):
		t.Fatal("the publish in flight during the reload was not answered")
	}
	began := time.Now()
	status, reply := srv.post("/events", "application/json", body, key)
	if status != http.StatusOK || time.Since(began) > 2*time.Second {
		t.Fatalf("its retry answered %d %s after %v", status, reply, time.Since(began).Round(time.Millisecond))
	}
	if n := rds.MustCLI("XLEN", "sse:{a}:s"); n != "2" {
		t.Fatalf("the history holds %s events, want 2 (warm, and the keyed one once)", n)
	}
}

// The same for a stream that opens (reads its replay from Redis) while a
// reload replaces the hub: it must not be refused for the hub closed under
// it (a 503 makes a browser's EventSource give up for good). It opens, and
// is told server_closing at once, as every stream of the old config is.
func TestAStreamOpeningDuringAReloadThatReplacesTheHubIsNotRefused(t *testing.T) {
	rds := redistest.Start(t)
	proxy := startStallingProxy(t, rds.Addr(), pubsub.FunctionRead, "$3\r\n777\r\n") // the replay's read alone
	site := func(pool int) string {
		return redisBlockSite("url redis://"+proxy.addr()+"\n\t\t\tread_timeout 2s\n\t\t\tmax_retries 1\n\t\t\tpool_size "+itoa(pool), "replay_limit 777")
	}
	srv := startCaddy(t, site(3))
	ids := srv.publishN("a", "e", 1, 2)
	proxy.arm()
	opened := make(chan *sseClient, 1)
	go func() { opened <- openStream(t, srv.base+"/events?channels=a", header("Last-Event-ID", ids[1]), nil) }()
	select {
	case <-proxy.stalled:
	case <-time.After(waitFor):
		t.Fatal("the replay's read never reached Redis")
	}
	proxy.armed.Store(false) // go-redis' retry, after read_timeout, gets through
	srv.reload(site(4))
	c := <-opened
	if c.resp.StatusCode != http.StatusOK {
		t.Fatalf("a stream opening during the reload: status %d", c.resp.StatusCode)
	}
	for {
		ev := c.next()
		if ev.Type == "server_closing" {
			break
		}
		if ev.Data != "e2" {
			t.Fatalf("got %+v before server_closing", ev)
		}
	}
}
