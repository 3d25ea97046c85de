package caddysse

import (
	"context"
	"testing"

	"github.com/caddy-sse/caddy-sse/pubsub"
)

// BenchmarkFanoutToStreams publishes one event to 10,000 subscribed streams
// (the real per-connection queue, without the network write), to show the
// fan-out path allocates nothing per subscriber.
func BenchmarkFanoutToStreams(b *testing.B) {
	h := validHandler()
	h.hub = pubsub.NewMemoryHub()
	defer h.hub.Close()
	h.limits = h.hubLimits()
	const subscribers = 10_000
	streams := make([]*stream, subscribers)
	for i := range streams {
		streams[i] = newStream(h, []string{"bench"})
		defer h.hub.Subscribe(streams[i], streams[i].keys).Close()
	}
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
