//go:build linux

package caddysse

import (
	"context"
	"strings"
	"testing"

	"github.com/caddy-sse/caddy-sse/pubsub"
	"github.com/caddy-sse/caddy-sse/replay"
)

func histogramCount(h *shardedHistogram) uint64 {
	var n uint64
	for s := range h.shards {
		for i := range h.shards[s].counts {
			n += h.shards[s].counts[i].Load()
		}
	}
	return n
}

// A stream on an event loop whose batch has a gap (an event the history
// must fill) hands the rest of the batch to a goroutine: the queue was
// taken once, and caddy_sse_queue_depth observes that take once, not again
// for the rest on the goroutine (which would also restart the latency
// clock of the rest's events).
func TestLoopGapObservesQueueDepthOnce(t *testing.T) {
	l, h := testLoop(t, false), loopTestHandler()
	h.hub = pubsub.NewMemoryHub()
	h.ReplayLimit = 100
	for _, d := range []string{"one", "two", "three"} {
		if _, err := h.hub.Publish(context.Background(), "a", pubsub.Message{Data: []byte(d)}, replay.Limits{Count: 100}); err != nil {
			t.Fatal(err)
		}
	}
	head, _ := h.hub.Read(context.Background(), "a", nil, 10)
	page, err := h.hub.Read(context.Background(), "a", &replay.Position{Epoch: head.Head.Epoch}, 10)
	if err != nil || len(page.Events) != 3 {
		t.Fatalf("history %+v %v", page, err)
	}
	fd, peer := socketPair(t)
	s := newStream(h, []string{"a"})
	s.cursor[0].Pos = page.Events[0].Pos
	l.adopt(s, &tconn{loop: l, fd: int32(fd)})
	s.Deliver(0, page.Events[2]) // "two" was missed: a gap the history fills
	l.serviceReady()
	waitReturned(t, l)
	l.takeReturned()
	got := readUntil(t, peer, "three")
	if !strings.Contains(got, "two") {
		t.Fatalf("the gap was not filled: %q", got)
	}
	if n := histogramCount(h.metrics.queueDepths); n != 1 {
		t.Fatalf("one take of the queue observed %d times in caddy_sse_queue_depth", n)
	}
}
