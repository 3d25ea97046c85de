package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// The seeds' production shape: several instances behind a load balancer on
// one Redis, a client moved from one to another when its instance stops or
// cuts it, a Redis that restarts. Each test runs real caddy binaries.

// get sends a GET to url and returns the response with its body read,
// unless it is a stream (which is closed unread).
func get(t *testing.T, url string) (*http.Response, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		return resp, ""
	}
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	return resp, string(body)
}

// errorCode returns the "error" of a refusal's JSON body.
func errorCode(body string) string {
	var reply struct {
		Error string `json:"error"`
	}
	_ = json.Unmarshal([]byte(body), &reply)
	return reply.Error
}

// principalStats returns what the admin stats of p say of principal: its
// streams on this instance and, with Redis, on every instance (-1 if not
// listed).
func principalStats(t *testing.T, p *caddyProc, principal string) (here, everywhere int) {
	t.Helper()
	resp, body := get(t, "http://"+p.adminAddr+"/sse/stats")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/sse/stats: %d %s", resp.StatusCode, body)
	}
	var stats struct {
		Hubs []struct {
			TopPrincipals []struct {
				Principal      string `json:"principal"`
				Streams        int    `json:"streams"`
				ClusterStreams *int   `json:"cluster_streams"`
			} `json:"top_principals"`
		} `json:"hubs"`
	}
	if err := json.Unmarshal([]byte(body), &stats); err != nil {
		t.Fatalf("/sse/stats %q: %v", body, err)
	}
	for _, hub := range stats.Hubs {
		for _, tp := range hub.TopPrincipals {
			if tp.Principal == principal {
				everywhere = -1
				if tp.ClusterStreams != nil {
					everywhere = *tp.ClusterStreams
				}
				return tp.Streams, everywhere
			}
		}
	}
	return -1, -1
}

// Seeds 002 and 003 in a rolling deploy: a merchant capped at 2 streams
// holds one on each instance, a third is refused on either, and the counts
// are observable on each instance. Instance A is stopped (SIGTERM): its
// stream is told server_closing and its client, told to come back at once
// (close_jitter off), reconnects to B with its Last-Event-ID. B admits it
// (A gave its share of the cap back when the stream ended, not lease_ttl
// later: a 429 would make a browser's EventSource give up for good) and
// replays what was published while it moved, then goes on live.
func TestStoppedInstancesStreamsMoveToAnotherWithinTheCap(t *testing.T) {
	rds := redistest.Start(t)
	extra := []string{"principal {query.merchant}", "max_connections_per_principal 2", "close_jitter off"}
	a, b := startInstance(t, rds.URL(), extra...), startInstance(t, rds.URL(), extra...)
	client, pub := h1Client(t, true), h1Client(t, false)
	const query = "?channels=invoices:m7&merchant=m7"

	onA := openStream(t, client, a.streamURL+query, "")
	onB := openStream(t, client, b.streamURL+query, "")
	for _, inst := range []*instance{a, b} {
		resp, body := get(t, inst.streamURL+query)
		if resp.StatusCode != http.StatusTooManyRequests || errorCode(body) != "too_many_connections" {
			t.Fatalf("a third stream of the merchant: %d %s, want 429 too_many_connections", resp.StatusCode, body)
		}
	}
	for name, inst := range map[string]*instance{"A": a, "B": b} {
		if here, everywhere := principalStats(t, inst.proc, "m7"); here != 1 || everywhere != 2 {
			t.Fatalf("instance %s's stats count the merchant's streams %d here and %d on every instance, want 1 and 2", name, here, everywhere)
		}
	}
	rds.WaitShardSubscribers(t, "sse:{invoices:m7}", 2)
	publish(t, pub, b.publish, testSecret, "invoices:m7", "paid-1")
	deadline := time.Now().Add(waitFor)
	for _, c := range []*sseConn{onA, onB} {
		if err := c.expectData(deadline, "paid-1"); err != nil {
			t.Fatal(err)
		}
	}

	began := time.Now()
	a.proc.signal(syscall.SIGTERM)
	if retry, err := onA.expectClosing(deadline, "shutdown", 0); err != nil || retry != 0 {
		t.Fatalf("the stream on the stopping instance: retry %d, %v", retry, err)
	}
	if err := onA.expectEnd(deadline); err != nil {
		t.Fatal(err)
	}
	moved := openStream(t, client, b.streamURL+query, onA.lastEventID())
	publish(t, pub, b.publish, testSecret, "invoices:m7", "paid-2")
	for name, c := range map[string]*sseConn{"moved": moved, "on B": onB} {
		if err := c.expectData(time.Now().Add(waitFor), "paid-2"); err != nil {
			t.Fatalf("stream %s: %v", name, err)
		}
	}
	a.proc.waitExit(began.Add(exitWithin), began)
	if here, everywhere := principalStats(t, b.proc, "m7"); here != 2 || everywhere != 2 {
		t.Fatalf("after the move B's stats count %d here and %d on every instance, want 2 and 2", here, everywhere)
	}
}

// The same move when the client left A with events still to come: a
// client whose stream on A ended (A stopping) reconnects to B only after
// events were published meanwhile, and gets exactly those, then live ones.
func TestStoppedInstancesClientResumesOnAnotherWithoutAGap(t *testing.T) {
	rds := redistest.Start(t)
	a, b := startInstance(t, rds.URL(), "close_jitter 1s"), startInstance(t, rds.URL(), "close_jitter 1s")
	client, pub := h1Client(t, true), h1Client(t, false)
	onA := openStreams(t, client, a.streamURL+"?channels=stream:42,user:GABC", 5)
	rds.WaitShardSubscribers(t, "sse:{stream:42}", 1)
	rds.WaitShardSubscribers(t, "sse:{user:GABC}", 1)
	for i := 1; i <= 3; i++ {
		publish(t, pub, b.publish, testSecret, "stream:42", fmt.Sprint("s", i))
		publish(t, pub, b.publish, testSecret, "user:GABC", fmt.Sprint("u", i))
	}
	deadline := time.Now().Add(waitFor)
	forAll(t, onA, func(_ int, c *sseConn) error { return expectPerChannel(c, deadline, "s1 s2 s3", "u1 u2 u3") })

	began := time.Now()
	a.proc.signal(syscall.SIGTERM)
	forAll(t, onA, func(_ int, c *sseConn) error {
		if _, err := c.expectClosing(deadline, "shutdown", time.Second); err != nil {
			return err
		}
		return c.expectEnd(deadline)
	})
	publish(t, pub, b.publish, testSecret, "user:GABC", "u4")
	publish(t, pub, b.publish, testSecret, "stream:42", "s4")
	moved := make([]*sseConn, len(onA))
	for i, c := range onA {
		moved[i] = openStream(t, client, b.streamURL+"?channels=stream:42,user:GABC", c.lastEventID())
		if h := moved[i].resp.Header.Get("X-Replay-Truncated"); h != "" {
			t.Fatalf("resumed stream %d: X-Replay-Truncated %s", i, h)
		}
	}
	publish(t, pub, b.publish, testSecret, "stream:42", "s5")
	deadline = time.Now().Add(waitFor)
	// per channel in order; across the two, replay is merged by publish
	// time, which two publishes may share (ms)
	forAll(t, moved, func(_ int, c *sseConn) error { return expectPerChannel(c, deadline, "s4 s5", "u4") })
	a.proc.waitExit(began.Add(exitWithin), began)
}

// expectPerChannel reads the events of the two channels of the seed 001
// streams (data s<n> on stream:42, u<n> on user:GABC) and checks that each
// channel got exactly its wanted data, in order.
func expectPerChannel(c *sseConn, deadline time.Time, wantS, wantU string) error {
	var gotS, gotU []string
	for range len(strings.Fields(wantS)) + len(strings.Fields(wantU)) {
		ev, err := c.next(deadline)
		if err != nil {
			return fmt.Errorf("after %q and %q: %v", gotS, gotU, err)
		}
		if ev.Type != "message" || !ev.HasID {
			return fmt.Errorf("after %q and %q: got %v", gotS, gotU, ev)
		}
		if strings.HasPrefix(ev.Data, "s") {
			gotS = append(gotS, ev.Data)
		} else {
			gotU = append(gotU, ev.Data)
		}
	}
	if strings.Join(gotS, " ") != wantS || strings.Join(gotU, " ") != wantU {
		return fmt.Errorf("got %q and %q, want %q and %q", gotS, gotU, wantS, wantU)
	}
	return nil
}

// openStalledStream opens a stream on addr with a 4 KiB receive buffer,
// reads its response head and then nothing more: a client that stopped
// reading.
func openStalledStream(t *testing.T, addr, path string) net.Conn {
	t.Helper()
	dialer := net.Dialer{Control: func(_, _ string, c syscall.RawConn) error {
		return c.Control(func(fd uintptr) {
			_ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096)
		})
	}}
	conn, err := dialer.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	_ = conn.SetDeadline(time.Now().Add(waitFor))
	fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: %s\r\nAccept: text/event-stream\r\n\r\n", path, addr)
	head, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil || !strings.Contains(head, " 200 ") {
		t.Fatalf("stalled stream: %q, %v", head, err)
	}
	return conn
}

// Seed 003: a slow client is closed and "marked THROTTLED in Redis": the
// wallet that stopped reading on instance A is refused 429 throttled, with
// Retry-After, when the load balancer sends its reconnect to instance B;
// another wallet from the same address is not.
func TestSlowClientIsThrottledOnEveryInstance(t *testing.T) {
	rds := redistest.Start(t)
	extra := []string{"principal {query.wallet}", "slow_client_timeout 1s", "throttle 30s",
		"history 100000", "history_bytes 512MiB"}
	a, b := startInstance(t, rds.URL(), extra...), startInstance(t, rds.URL(), extra...)
	pub := h1Client(t, false)
	u, err := url.Parse(a.streamURL)
	if err != nil {
		t.Fatal(err)
	}
	stalled := openStalledStream(t, u.Host, "/events?channels=news&wallet=w1")
	waitOpenStreams(t, a.proc, 1)
	payload := strings.Repeat("x", 32<<10)
	deadline := time.Now().Add(3 * waitFor)
	for i := 0; ; i++ {
		if n, _ := openStreamCount(a.proc.adminAddr); n == 0 {
			t.Logf("cut after %d events", i)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the stalled client was not cut after %d events", i)
		}
		publish(t, pub, b.publish, testSecret, "news", fmt.Sprintf("%d-%s", i, payload))
	}
	_ = stalled.Close()

	// B learns of the throttle through Redis within milliseconds; a browser
	// comes back after its retry (3 s)
	var resp *http.Response
	var body string
	for end := time.Now().Add(3 * time.Second); ; {
		resp, body = get(t, b.streamURL+"?channels=news&wallet=w1")
		if resp.StatusCode != http.StatusOK || time.Now().After(end) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if resp.StatusCode != http.StatusTooManyRequests || errorCode(body) != "throttled" {
		t.Fatalf("the slow wallet's reconnect to the other instance: %d %s, want 429 throttled", resp.StatusCode, body)
	}
	if ra := resp.Header.Get("Retry-After"); ra == "" || ra == "0" {
		t.Fatalf("Retry-After %q, want the throttle's time left", ra)
	}
	other := openStream(t, h1Client(t, true), b.streamURL+"?channels=news&wallet=w2", "")
	other.close()
	// an instance started after the throttle (a rolling deploy) refuses the
	// wallet too, at its first request
	c := startInstance(t, rds.URL(), extra...)
	if resp, body := get(t, c.streamURL+"?channels=news&wallet=w1"); resp.StatusCode != http.StatusTooManyRequests || errorCode(body) != "throttled" {
		t.Fatalf("the slow wallet on an instance started since: %d %s, want 429 throttled", resp.StatusCode, body)
	}
}

// publishUntilAccepted publishes data to channel until an instance answers
// 200 (Redis may be restarting): what a backend that retries does.
func publishUntilAccepted(t *testing.T, client *http.Client, url, channel, data string) {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"channel": channel, "data": data})
	deadline := time.Now().Add(2 * waitFor)
	last := ""
	for {
		req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(string(body)))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer "+testSecret)
		req.Header.Set("Idempotency-Key", "publish-"+data)
		resp, err := client.Do(req)
		var failure string
		if err == nil {
			reply, _ := io.ReadAll(resp.Body)
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
			failure = fmt.Sprintf("%d %s", resp.StatusCode, reply)
		} else {
			failure = err.Error()
		}
		if failure != last {
			t.Logf("publishing %q: %s (trying again)", data, failure)
			last = failure
		}
		if time.Now().After(deadline) {
			t.Fatalf("publishing %q: %s", data, failure)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Seed 000's resilience with a Redis that restarts without persistence (the
// history is gone, a new epoch starts): the streams open on both instances
// across the restart are not left silent. Each either gets the events
// published once Redis is back, or ends, and its reconnect with its
// Last-Event-ID is told it was truncated and gets them.
func TestStreamsOnEveryInstanceLiveThroughARedisRestart(t *testing.T) {
	rds := redistest.Start(t)
	a, b := startInstance(t, rds.URL(), "heartbeat 500ms"), startInstance(t, rds.URL(), "heartbeat 500ms")
	client, pub := h1Client(t, true), h1Client(t, false)
	streams := map[string]*instance{}
	conns := map[string]*sseConn{}
	for name, inst := range map[string]*instance{"A": a, "B": b} {
		streams[name] = inst
		conns[name] = openStream(t, client, inst.streamURL+"?channels=orders", "")
	}
	rds.WaitShardSubscribers(t, "sse:{orders}", 2)
	publish(t, pub, a.publish, testSecret, "orders", "before")
	deadline := time.Now().Add(waitFor)
	for _, c := range conns {
		if err := c.expectData(deadline, "before"); err != nil {
			t.Fatal(err)
		}
	}

	rds.Kill()
	rds.Restart() // empty: no persistence
	publishUntilAccepted(t, pub, a.publish, "orders", "after-1")
	publish(t, pub, b.publish, testSecret, "orders", "after-2")
	for name, c := range conns {
		got, err := c.next(time.Now().Add(2 * waitFor))
		t.Logf("stream on %s after the restart: %v %v", name, got, err)
		if err == nil {
			if got.Type != "message" || got.Data != "after-1" {
				t.Fatalf("stream on %s got %v after the restart, want after-1", name, got)
			}
			if err := c.expectData(time.Now().Add(waitFor), "after-2"); err != nil {
				t.Fatalf("stream on %s: %v", name, err)
			}
			continue
		}
		// it ended: its client reconnects with what it saw
		r := openStream(t, client, streams[name].streamURL+"?channels=orders", c.lastEventID())
		if r.resp.Header.Get("X-Replay-Truncated") != "true" {
			t.Fatalf("stream on %s ended (%v); its reconnect is not told it was truncated", name, err)
		}
		ev, err := r.next(time.Now().Add(waitFor))
		if err != nil || ev.Type != "sse_truncated" {
			t.Fatalf("reconnect on %s: first event %v %v, want sse_truncated", name, ev, err)
		}
		if err := r.expectData(time.Now().Add(waitFor), "after-1", "after-2"); err != nil {
			t.Fatalf("reconnect on %s: %v", name, err)
		}
	}
}

// A rolling deploy while Redis hangs (a stuck primary, a partition): the
// instance that is stopped still tells its streams server_closing and exits
// promptly, though its leases cannot be given back (they lapse within
// lease_ttl) and its Redis calls get no answer.
func TestStopWhileRedisHangsExitsPromptly(t *testing.T) {
	rds := redistest.Start(t)
	a := startInstance(t, rds.URL(), "principal {query.merchant}", "max_connections_per_principal 2", "close_jitter 1s")
	client, pub := h1Client(t, true), h1Client(t, false)
	streams := openStreams(t, client, a.streamURL+"?channels=invoices:m7&merchant=m7", 2)
	rds.WaitShardSubscribers(t, "sse:{invoices:m7}", 1)
	publish(t, pub, a.publish, testSecret, "invoices:m7", "paid-1")
	deadline := time.Now().Add(waitFor)
	forAll(t, streams, func(_ int, c *sseConn) error { return c.expectData(deadline, "paid-1") })

	rds.Pause()
	defer rds.Resume()
	began := time.Now()
	a.proc.signal(syscall.SIGTERM)
	expectShutdown(t, a.proc, streams, began)
}

// postKeyed publishes data to channel on url with an Idempotency-Key and
// returns the status, the reply and whether it was marked replayed.
func postKeyed(t *testing.T, client *http.Client, url, key, channel, data string) (int, string, bool) {
	t.Helper()
	status, reply, replayed := tryKeyed(client, url, key, channel, data)
	if status == 0 {
		t.Fatalf("publishing %q: %s", data, reply)
	}
	return status, reply, replayed
}

// tryKeyed is postKeyed without the test: a connection error is status 0,
// the error as the reply.
func tryKeyed(client *http.Client, url, key, channel, data string) (int, string, bool) {
	body, _ := json.Marshal(map[string]any{"channel": channel, "data": data})
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(string(body)))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+testSecret)
	req.Header.Set("Idempotency-Key", key)
	resp, err := client.Do(req)
	if err != nil {
		return 0, err.Error(), false
	}
	defer resp.Body.Close()
	reply, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(reply), resp.Header.Get("Idempotent-Replayed") == "true"
}

// A backend publishes with an Idempotency-Key and retries (README: "Backends
// should publish with a key and retry on a connection error"); behind a
// load balancer the retry reaches another instance, or both copies run at
// once on two. Either way the event is published once, and every answer
// carries its id.
func TestAKeyedRetryOnAnotherInstancePublishesOnce(t *testing.T) {
	rds := redistest.Start(t)
	a, b := startInstance(t, rds.URL()), startInstance(t, rds.URL())
	client, pub := h1Client(t, true), h1Client(t, false)
	c := openStream(t, client, b.streamURL+"?channels=invoices", "")
	rds.WaitShardSubscribers(t, "sse:{invoices}", 1)

	status, first, _ := postKeyed(t, pub, a.publish, "invoice-7-paid", "invoices", "paid-7")
	if status != http.StatusOK {
		t.Fatalf("first publish: %d %s", status, first)
	}
	status, again, replayed := postKeyed(t, pub, b.publish, "invoice-7-paid", "invoices", "paid-7")
	if status != http.StatusOK || again != first || !replayed {
		t.Fatalf("the retry on the other instance: %d %s (replayed %v), want the first reply %s, replayed", status, again, replayed, first)
	}

	// both copies at once, one on each instance
	type answer struct {
		status int
		reply  string
	}
	answers := make(chan answer, 2)
	for _, inst := range []*instance{a, b} {
		go func() {
			status, reply, _ := postKeyed(t, pub, inst.publish, "invoice-8-paid", "invoices", "paid-8")
			answers <- answer{status, reply}
		}()
	}
	one, two := <-answers, <-answers
	if one.status != http.StatusOK || two.status != http.StatusOK || one.reply != two.reply {
		t.Fatalf("concurrent copies answered %d %s and %d %s, want one reply", one.status, one.reply, two.status, two.reply)
	}
	publish(t, pub, a.publish, testSecret, "invoices", "after")
	if err := c.expectData(time.Now().Add(waitFor), "paid-7", "paid-8", "after"); err != nil {
		t.Fatal(err)
	}
}

// Seeds 002 and 003 through a reload under load: a backend publishes
// without pause (retrying with its Idempotency-Key when a reload resets its
// connection) while the instance reloads to a config whose Redis settings
// differ (a new hub). Every client follows server_closing with its
// Last-Event-ID and, at the end, has seen every event once, in order.
func TestReloadToNewRedisSettingsUnderLoadLosesNothing(t *testing.T) {
	rds := redistest.Start(t)
	inst := startInstance(t, rds.URL(), "close_jitter 300ms")
	client, pub := h1Client(t, true), h1Client(t, false)
	const clients = 10
	var seen [clients][]string
	done := make(chan struct{})
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	conns := make([]*sseConn, clients)
	for i := range conns {
		conns[i] = openStream(t, client, inst.streamURL+"?channels=invoices", "")
	}
	rds.WaitShardSubscribers(t, "sse:{invoices}", 1)
	for i := range conns {
		wg.Go(func() {
			c := conns[i]
			for {
				ev, err := c.next(time.Now().Add(2 * waitFor))
				switch {
				case err == nil && ev.Type == "message":
					seen[i] = append(seen[i], ev.Data)
					if ev.Data == "last" {
						return
					}
					continue
				case err == nil && ev.Type == "server_closing":
					continue
				case err == nil:
					errs <- fmt.Errorf("client %d: unexpected %v", i, ev)
					return
				}
				select {
				case <-c.done:
				default:
					errs <- fmt.Errorf("client %d after %d events: %v", i, len(seen[i]), err)
					return
				}
				// the stream ended: reconnect with the last id, as EventSource
				id := c.lastEventID()
				for {
					var rerr error
					c, rerr = tryOpenStream(client, inst.streamURL+"?channels=invoices", id, time.Now().Add(waitFor))
					if rerr == nil {
						break
					}
					select {
					case <-done:
						errs <- fmt.Errorf("client %d could not reconnect: %v", i, rerr)
						return
					case <-time.After(100 * time.Millisecond):
					}
				}
				if h := c.resp.Header.Get("X-Replay-Truncated"); h != "" {
					errs <- fmt.Errorf("client %d: reconnect truncated", i)
				}
				t.Cleanup(c.close)
			}
		})
	}
	const events = 300
	published := make(chan struct{})
	stop := make(chan struct{})
	var count atomic.Int32
	var publishErr error
	go func() {
		defer close(published)
		for n := 1; n <= events+1; n++ {
			data := fmt.Sprint(n)
			if n > events {
				data = "last"
			}
			// a backend's retries with the event's key, for up to 5 s
			for began := time.Now(); ; {
				status, reply, _ := tryKeyed(pub, inst.publish, "event-"+data, "invoices", data)
				if status == http.StatusOK {
					break
				}
				if time.Since(began) > 5*time.Second {
					publishErr = fmt.Errorf("publishing %s: still %d %s after 5 s", data, status, reply)
					return
				}
				select {
				case <-stop:
					return
				case <-time.After(50 * time.Millisecond):
				}
			}
			count.Store(int32(n))
		}
	}()
	t.Cleanup(func() {
		close(stop)
		<-published
	})
	config, err := os.ReadFile(inst.proc.config)
	if err != nil {
		t.Fatal(err)
	}
	for i, setting := range []string{"pool_size 3", "pool_size 4", "read_timeout 4s"} {
		for deadline := time.Now().Add(waitFor); count.Load() < int32(50*(i+1)); { // under way
			if time.Now().After(deadline) {
				<-published
				t.Fatalf("%d events published before reload %d: %v", count.Load(), i+1, publishErr)
			}
			time.Sleep(10 * time.Millisecond)
		}
		changed := strings.Replace(string(config), "check_interval 500ms", "check_interval 500ms\n\t\t\t"+setting, 1)
		inst.proc.writeConfig(changed)
		inst.proc.reload()
		t.Logf("reload %d (%s) done", i+1, setting)
	}
	<-published
	if publishErr != nil {
		t.Fatal(publishErr)
	}
	wg.Wait()
	close(done)
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	for i, got := range seen {
		want := make([]string, 0, events+1)
		for n := 1; n <= events; n++ {
			want = append(want, fmt.Sprint(n))
		}
		want = append(want, "last")
		if strings.Join(got, " ") != strings.Join(want, " ") {
			t.Fatalf("client %d saw %d events, want %d in order once: %.300q", i, len(got), len(want), got)
		}
	}
}
