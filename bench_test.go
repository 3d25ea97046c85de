package caddysse

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/pubsub"
)

// BenchmarkFanoutToStreams publishes one event to 10,000 subscribed streams
// (the real per-connection queue, without the network write), to show the
// fan-out path allocates nothing per subscriber.
func BenchmarkFanoutToStreams(b *testing.B) {
	const subscribers = 10_000
	h, streams := subscribedStreams(b, subscribers)
	msg := pubsub.Message{Type: "tick", Data: []byte(`{"n":1}`)}
	ctx := context.Background()
	drain := func() {
		for _, s := range streams {
			s.take()
		}
	}
	// warm up: the queues grow to their working size once, then are reused
	for range 2 {
		for range DefaultQueue / 2 {
			if _, err := h.hub.Publish(ctx, "bench", msg, h.limits); err != nil {
				b.Fatal(err)
			}
		}
		drain()
	}
	b.ReportAllocs()
	n := 0
	for b.Loop() {
		if _, err := h.hub.Publish(ctx, "bench", msg, h.limits); err != nil {
			b.Fatal(err)
		}
		if n++; n%(DefaultQueue/2) == 0 { // drain, as the writers would
			b.StopTimer()
			drain()
			b.StartTimer()
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/subscribers, "ns/subscriber")
}

// BenchmarkDeliverToColdStreams publishes one event to 10,000 streams and
// has each take it from its queue and write it, as an event loop does, to
// a writer that sends nothing. Between two events it evicts the streams
// from the CPU's caches, as the kernel's work for 10k sockets does in a
// server: what it measures is the user-space work of a delivery with the
// cache misses of a stream's state, which is most of it. (Its allocations
// are each stream's id buffers growing as the ids lengthen: an event loop
// lends one set to all its streams.)
func BenchmarkDeliverToColdStreams(b *testing.B) {
	const subscribers = 10_000
	h, streams := subscribedStreams(b, subscribers)
	for _, s := range streams {
		s.out = new(roundWriter)
	}
	msg := pubsub.Message{Type: "tick", Data: []byte(`{"n":1}`)}
	ctx := context.Background()
	deliver := func() {
		if _, err := h.hub.Publish(ctx, "bench", msg, h.limits); err != nil {
			b.Fatal(err)
		}
		for _, s := range streams {
			batch, _ := s.take()
			if _, err := s.drainBatch(ctx, batch, false); err != nil {
				b.Fatal(err)
			}
		}
	}
	deliver() // each stream's queue and buffers are made at its first events
	deliver()
	evict := make([]byte, 64<<20)
	b.ReportAllocs()
	for b.Loop() {
		b.StopTimer()
		for i := 0; i < len(evict); i += 64 {
			evict[i]++
		}
		b.StartTimer()
		deliver()
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/subscribers, "ns/delivery")
}

// subscribedStreams makes a handler on an embedded hub and n streams
// subscribed to its channel "bench", all gone when b ends.
func subscribedStreams(b *testing.B, n int) (*Handler, []*stream) {
	h := validHandler()
	h.hub = pubsub.NewMemoryHub()
	b.Cleanup(func() { h.hub.Close() })
	h.limits = h.hubLimits()
	streams := make([]*stream, n)
	for i := range streams {
		streams[i] = newStream(h, []string{"bench"})
		sub := h.hub.Subscribe(streams[i], streams[i].keys)
		b.Cleanup(sub.Close)
	}
	return h, streams
}

// roundWriter takes what a stream writes and sends nothing, with a round
// clock as an event loop's writer has.
type roundWriter struct{}

func (*roundWriter) Write([]byte) error     { return nil }
func (*roundWriter) Flush() error           { return nil }
func (*roundWriter) WriteLast([]byte) error { return nil }
func (*roundWriter) MayBlock() bool         { return false }
func (*roundWriter) roundNow() int64        { return 1 }

// BenchmarkStreamOpen opens a stream through an in-process Caddy, reads
// its preamble and closes it: what a connection costs (accept, Caddy's
// request handling, the checks, subscribing, the headers, with the takeover
// writer the hand-off, and the close), server and client together. The
// allocations are the server's but for the dial's few. A connection ramp
// (ssebench) varies too much from run to run to show a few µs; this
// repeats:
//
//	go test -run x -bench StreamOpen -benchmem .
//	SSE_TEST_WRITER=takeover go test -run x -bench StreamOpen -benchmem .
func BenchmarkStreamOpen(b *testing.B) {
	srv := startCaddy(b, `
:{PORT} {
	sse /events {
		channel {query.channels}
	}
}
`)
	addr := fmt.Sprintf("127.0.0.1:%d", srv.port)
	request := []byte("GET /events?channels=bench HTTP/1.1\r\nHost: bench\r\nAccept: text/event-stream\r\n\r\n")
	b.ReportAllocs()
	// many clients at once keep both cores busy, as a ramp does: ns/op is
	// then the CPU of a connection divided among the cores, not the round
	// trips of one client
	b.SetParallelism(16)
	b.RunParallel(func(pb *testing.PB) {
		buf := make([]byte, 4096)
		for pb.Next() {
			openAndClose(b, addr, request, buf)
		}
	})
}

// openAndClose opens a stream with a raw request, waits for its ": ok"
// preamble and closes the connection.
func openAndClose(b *testing.B, addr string, request, buf []byte) {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write(request); err != nil {
		b.Fatal(err)
	}
	n := 0
	for !bytes.Contains(buf[:n], []byte(": ok\n")) {
		m, err := c.Read(buf[n:])
		if err != nil {
			b.Fatalf("after %q: %v", buf[:n], err)
		}
		n += m
	}
}

// BenchmarkNeighbourOfSlowClient measures what a stalled client costs the
// other subscribers of its channel (SPEC S7): publish→receive latency of a
// reading subscriber while another one on the same channel stops reading,
// fills its socket and queue, and is cut off as a slow client. Events of
// 4 KB at 400/s for 5 s; the figures are reported, not asserted:
//
//	go test -run x -bench NeighbourOfSlowClient -benchtime 1x .
//	SSE_TEST_WRITER=takeover go test -run x -bench NeighbourOfSlowClient -benchtime 1x .
func BenchmarkNeighbourOfSlowClient(b *testing.B) {
	for range b.N {
		runNeighbourOfSlowClient(b)
	}
}

func runNeighbourOfSlowClient(b *testing.B) {
	srv := startCaddy(b, `
:{PORT} {
	metrics /metrics
	sse /events {
		channel a
		principal {query.user}
		queue 64
		queue_bytes 512KiB
		slow_client_timeout 2s
		publish {
			secret `+testSecret+`
		}
	}
}
`)
	fast := srv.subscribe("/events?user=fast", nil)
	fast.comment("ok")
	_, tap := openValved(b, srv.base+"/events?user=slow", smallReceiveBuffer())
	tap.stall()

	const rate, seconds = 400, 5
	payload := strings.Repeat("x", 4000)
	sent := make(map[string]time.Time, rate*seconds)
	var mu sync.Mutex
	var latencies []time.Duration
	done := make(chan struct{})
	go func() {
		defer close(done)
		for len(latencies) < rate*seconds {
			ev, ok := <-fast.events
			if !ok {
				return
			}
			mu.Lock()
			if at, found := sent[ev.Data[:16]]; found {
				latencies = append(latencies, time.Since(at))
			}
			mu.Unlock()
		}
	}()
	b.ResetTimer()
	tick := time.NewTicker(time.Second / rate)
	for i := range rate * seconds {
		<-tick.C
		tag := fmt.Sprintf("%016d", i)
		mu.Lock()
		sent[tag] = time.Now()
		mu.Unlock()
		go srv.publish("/events", map[string]any{"channel": "a", "data": tag + payload})
	}
	tick.Stop()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		b.Fatalf("the reading subscriber got %d of %d events", len(latencies), rate*seconds)
	}
	b.StopTimer()
	slices.Sort(latencies)
	pct := func(p float64) float64 {
		return float64(latencies[int(p*float64(len(latencies)-1))].Microseconds()) / 1000
	}
	b.ReportMetric(pct(0.5), "p50_ms")
	b.ReportMetric(pct(0.99), "p99_ms")
	b.ReportMetric(pct(1), "max_ms")
	b.ReportMetric(metric(b, srv.scrape(), "caddy_sse_slow_client_disconnects_total"), "slow_disconnects")
}

// discardWriter takes every write at once.
type discardWriter struct{}

func (discardWriter) Write([]byte) error     { return nil }
func (discardWriter) Flush() error           { return nil }
func (discardWriter) WriteLast([]byte) error { return nil }
func (discardWriter) MayBlock() bool         { return true }

// BenchmarkStreamWakeUp is a net/http stream's work at a wake-up with
// nothing queued (run's, or the drainer's step): it must not allocate.
func BenchmarkStreamWakeUp(b *testing.B) {
	s := newStream(validHandler(), []string{"a"})
	s.out = discardWriter{}
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := s.writeStep(ctx); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkPublishRetryKey is what a publish without an Idempotency-Key
// through a Redis hub pays for the key its 503 may offer
// (publish_retry.go): a random key, the request's fingerprint and the
// token derived from them, for a 100-byte event.
func BenchmarkPublishRetryKey(b *testing.B) {
	req := &publishRequest{channels: []string{"orders"}, event: "invoice", data: make([]byte, 100)}
	b.ReportAllocs()
	for b.Loop() {
		_ = onceToken("ns", newRetryKey(), req.fingerprint())
	}
}

// BenchmarkReadPublish reads and validates a publish body as the load
// tool sends it (cmd/ssebench): one channel, data a small JSON object.
func BenchmarkReadPublish(b *testing.B) {
	body := []byte(`{"channel":"bench417","data":{"c":"bench417","s":123456,"t":1765000000000000000}}`)
	h := &Handler{MaxChannels: DefaultMaxChannels, MaxEventSize: DefaultMaxEventSize}
	w := httptest.NewRecorder()
	b.ReportAllocs()
	for b.Loop() {
		r := httptest.NewRequest(http.MethodPost, "/", bytes.NewReader(body))
		r.Header.Set("Content-Type", "application/json")
		if _, rej := h.readPublish(w, r); rej != nil {
			b.Fatal(rej)
		}
	}
}

// BenchmarkCatchUpWrite writes a catch-up of 1000 events of 1 KiB (a page
// of history) through a taken-over stream's blocking writer, to a sink that
// takes everything: the bytes it allocates are what a stream holds while it
// catches up.
func BenchmarkCatchUpWrite(b *testing.B) {
	event := []byte("id: x\ndata: " + strings.Repeat("a", 1000) + "\n\n")
	b.ReportAllocs()
	for b.Loop() {
		cw := &connWriter{to: discardSink{}, timeout: time.Second}
		for range 1000 {
			_ = cw.Write(event)
		}
		_ = cw.Flush()
	}
}

type discardSink struct{}

func (discardSink) writeBy([]byte, time.Time) error { return nil }
