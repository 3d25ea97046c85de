package e2e

import (
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// instance is one Caddy process of a multi-instance deployment.
type instance struct {
	proc      *caddyProc
	streamURL string // without query
	publish   string
}

// startInstance runs a Caddy with an sse route on the Redis at url; extra
// lines go into the sse block.
func startInstance(t *testing.T, url string, extra ...string) *instance {
	t.Helper()
	adminPort, port := freePort(t, false), freePort(t, false)
	// debug: a failing test prints Caddy's output, streams' openings and
	// ends with it
	caddyfile := fmt.Sprintf(`{
	admin 127.0.0.1:%d
	auto_https off
	debug
}

http://:%d {
	sse /events {
		channel {query.channels}
		redis {
			url %s
			check_interval 500ms
		}
		%s
		publish {
			secret %s
		}
	}
}
`, adminPort, port, url, strings.Join(extra, "\n\t\t"), testSecret)
	p := startCaddy(t, fmt.Sprintf("127.0.0.1:%d", adminPort), caddyfile)
	base := fmt.Sprintf("http://127.0.0.1:%d/events", port)
	return &instance{proc: p, streamURL: base, publish: base}
}

// Two instances share one Redis: an event published on A reaches B's
// subscriber; a client that read some events from A reconnects to B with
// its Last-Event-ID and gets exactly the rest, including those published
// while it was away.
func TestTwoInstancesFanOutAndResume(t *testing.T) {
	rds := redistest.Start(t)
	a, b := startInstance(t, rds.URL()), startInstance(t, rds.URL())
	client, pub := h1Client(t, true), h1Client(t, false)

	onB := openStream(t, client, b.streamURL+"?channels=invoices", "")
	onA := openStream(t, client, a.streamURL+"?channels=invoices", "")
	rds.WaitShardSubscribers(t, "sse:{invoices}", 2)
	for i := 1; i <= 3; i++ {
		publish(t, pub, a.publish, testSecret, "invoices", fmt.Sprint("paid-", i))
	}
	deadline := time.Now().Add(waitFor)
	if err := onB.expectData(deadline, "paid-1", "paid-2", "paid-3"); err != nil {
		t.Fatalf("subscriber on B: %v", err)
	}
	if err := onA.expectData(deadline, "paid-1", "paid-2"); err != nil {
		t.Fatalf("subscriber on A: %v", err)
	}
	last := onA.lastEventID() // A's client saw paid-1 and paid-2 only
	onA.close()
	publish(t, pub, b.publish, testSecret, "invoices", "paid-4")
	moved := openStream(t, client, b.streamURL+"?channels=invoices", last)
	if moved.resp.Header.Get("X-Replay-Truncated") != "" {
		t.Fatal("a resume inside the history is not truncated")
	}
	publish(t, pub, a.publish, testSecret, "invoices", "paid-5")
	if err := moved.expectData(time.Now().Add(waitFor), "paid-3", "paid-4", "paid-5"); err != nil {
		t.Fatalf("resumed on B: %v", err)
	}
}

// A backend publishes with redis-cli alone: both instances deliver the
// event, with an id a client can resume from on either.
func TestDirectRedisPublishReachesBothInstances(t *testing.T) {
	rds := redistest.Start(t)
	a, b := startInstance(t, rds.URL()), startInstance(t, rds.URL())
	client, pub := h1Client(t, true), h1Client(t, false)
	onA := openStream(t, client, a.streamURL+"?channels=wallet:9", "")
	onB := openStream(t, client, b.streamURL+"?channels=wallet:9", "")
	rds.WaitShardSubscribers(t, "sse:{wallet:9}", 2)
	// the library is loaded by the instances when they first need it: a
	// publish through Caddy makes sure it is there
	publish(t, pub, a.publish, testSecret, "wallet:9", "first")

	rds.MustCLI("FCALL", "sse_publish_v1", "1", "sse:{wallet:9}", "", `{"balance":42}`)
	deadline := time.Now().Add(waitFor)
	for _, c := range []*sseConn{onA, onB} {
		if err := c.expectData(deadline, "first", `{"balance":42}`); err != nil {
			t.Fatal(err)
		}
	}
	if out, _ := rds.CLI("FCALL", "sse_publish_v1", "1", "sse:{wallet:9}", "bad\ntype", "x"); !strings.Contains(out, "ERR") {
		t.Fatalf("an invalid type was accepted: %q", out)
	}
	if n := rds.MustCLI("XLEN", "sse:{wallet:9}:s"); n != "2" {
		t.Fatalf("stream has %s events, want 2 (the invalid one is not written)", n)
	}
	// the id of the direct publish resumes on the other instance
	replayFrom := openStream(t, client, b.streamURL+"?channels=wallet:9", onB.lastEventID())
	publish(t, pub, b.publish, testSecret, "wallet:9", "after")
	if err := replayFrom.expectData(time.Now().Add(waitFor), "after"); err != nil {
		t.Fatal(err)
	}
}

// The per-principal cap holds across instances: 20 connects racing on two
// instances for 2 slots admit exactly 2; when an instance holding leases is
// killed (kill -9), its principals are admitted again within lease_ttl.
func TestPrincipalCapAcrossInstances(t *testing.T) {
	rds := redistest.Start(t)
	extra := []string{"principal {http.request.header.X-User}", "max_connections_per_principal 2", "lease_ttl 2s"}
	a, b := startInstance(t, rds.URL(), extra...), startInstance(t, rds.URL(), extra...)

	var admitted, refused atomic.Int32
	var mu sync.Mutex
	var open []*http.Response
	var wg sync.WaitGroup
	for i := range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			target := a
			if i%2 == 1 {
				target = b
			}
			req, _ := http.NewRequest(http.MethodGet, target.streamURL+"?channels=c", nil)
			req.Header.Set("X-User", "alice")
			resp, err := http.DefaultTransport.RoundTrip(req)
			if err != nil {
				t.Errorf("connect: %v", err)
				return
			}
			switch resp.StatusCode {
			case http.StatusOK:
				admitted.Add(1)
				mu.Lock()
				open = append(open, resp)
				mu.Unlock()
			case http.StatusTooManyRequests:
				refused.Add(1)
				resp.Body.Close()
			default:
				t.Errorf("status %d", resp.StatusCode)
				resp.Body.Close()
			}
		}()
	}
	wg.Wait()
	if admitted.Load() != 2 || refused.Load() != 18 {
		t.Fatalf("admitted %d, refused %d: want 2 and 18", admitted.Load(), refused.Load())
	}
	// kill the instances holding the leases, without a chance to release
	killed := map[*instance]bool{}
	for _, resp := range open {
		for _, inst := range []*instance{a, b} {
			if strings.HasPrefix(resp.Request.URL.String(), inst.streamURL) {
				killed[inst] = true
			}
		}
	}
	survivor := startInstance(t, rds.URL(), extra...)
	for inst := range killed {
		_ = inst.proc.cmd.Process.Kill()
	}
	began := time.Now()
	for {
		req, _ := http.NewRequest(http.MethodGet, survivor.streamURL+"?channels=c", nil)
		req.Header.Set("X-User", "alice")
		resp, err := http.DefaultTransport.RoundTrip(req)
		if err == nil && resp.StatusCode == http.StatusOK {
			resp.Body.Close()
			break
		}
		if resp != nil {
			resp.Body.Close()
		}
		if time.Since(began) > 2*time.Second+waitFor {
			t.Fatal("the dead instance's leases did not lapse")
		}
		time.Sleep(100 * time.Millisecond)
	}
	if took := time.Since(began); took > 2*time.Second+time.Second {
		t.Fatalf("admitted after %v, want within lease_ttl (2s) and a tick", took)
	}
	for _, resp := range open {
		resp.Body.Close()
	}
}
