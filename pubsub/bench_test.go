package pubsub

import (
	"context"
	"runtime"
	"testing"

	"github.com/caddy-sse/caddy-sse/replay"
)

// ringSubscriber queues events in a preallocated ring, as a stream's queue
// does, and never allocates. It is only given one channel's events, which
// are delivered one at a time, so it needs no lock.
type ringSubscriber struct {
	ring [64]*replay.Event
	n    uint64
}

func (s *ringSubscriber) Deliver(_ int, ev *replay.Event) {
	s.ring[s.n%uint64(len(s.ring))] = ev
	s.n++
}

// BenchmarkFanout10k publishes one event to 10,000 in-process subscribers
// of its channel. allocs/op are the publish's own (frame, event); the
// allocs/subscriber metric must stay 0 (SPEC S3).
func BenchmarkFanout10k(b *testing.B) {
	const subscribers = 10_000
	h := NewMemoryHub()
	defer h.Close()
	subs := make([]ringSubscriber, subscribers)
	for i := range subs {
		defer h.Subscribe(&subs[i], []string{"a"}).Close()
	}
	msg := Message{Type: "update", Data: []byte(`{"price": 42}`)}
	lim := replay.Limits{Count: 1000}
	ctx := context.Background()
	if _, err := h.Publish(ctx, "a", msg, lim); err != nil { // create the ring
		b.Fatal(err)
	}

	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := h.Publish(ctx, "a", msg, lim); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	runtime.ReadMemStats(&after)

	perOp := float64(after.Mallocs-before.Mallocs) / float64(b.N)
	b.ReportMetric(perOp/subscribers, "allocs/subscriber")
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/subscribers, "ns/subscriber")
	if subs[0].n != uint64(b.N)+1 || subs[subscribers-1].n != subs[0].n {
		b.Fatalf("deliveries: first %d, last %d, want %d", subs[0].n, subs[subscribers-1].n, b.N+1)
	}
}

// BenchmarkPublishNoSubscribers is a publish to a channel nobody listens
// to on this instance: encode, append to history, look up no one.
func BenchmarkPublishNoSubscribers(b *testing.B) {
	h := NewMemoryHub()
	defer h.Close()
	msg := Message{Type: "update", Data: []byte(`{"price": 42}`)}
	lim := replay.Limits{Count: 1000}
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if _, err := h.Publish(ctx, "a", msg, lim); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkRead1000 is a reconnect replaying 1000 events through the hub.
func BenchmarkRead1000(b *testing.B) {
	h := NewMemoryHub()
	defer h.Close()
	ctx := context.Background()
	msg := Message{Type: "update", Data: []byte(`{"price": 42}`)}
	lim := replay.Limits{Count: 1000}
	for range 1000 {
		if _, err := h.Publish(ctx, "a", msg, lim); err != nil {
			b.Fatal(err)
		}
	}
	after := replay.Position{} // full history: seq 1 is retained
	b.ReportAllocs()
	for b.Loop() {
		page, err := h.Read(ctx, "a", &after, 1000)
		if err != nil || len(page.Events) != 1000 || page.Truncated {
			b.Fatalf("read %d events, truncated %v, err %v", len(page.Events), page.Truncated, err)
		}
	}
}

// BenchmarkIdempotencyReplay is a retried publish answered from the store.
func BenchmarkIdempotencyReplay(b *testing.B) {
	o := NewIdempotency()
	ctx := context.Background()
	reply := []byte(`{"ids":{"a":"AQID"}}`)
	publish := func() ([]byte, error) { return reply, nil }
	o.Do(ctx, "key", "fp", publish)
	b.ReportAllocs()
	for b.Loop() {
		if _, replayed, err := o.Do(ctx, "key", "fp", publish); !replayed || err != nil {
			b.Fatal("not replayed")
		}
	}
}
