package caddysse

import (
	"context"
	"strconv"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/caddy-sse/caddy-sse/pubsub"
	"github.com/caddy-sse/caddy-sse/replay"
)

// A degraded stream that recovers gets, on the channels its cursor does not
// name, the events published since it opened (addSinceOpened); when there
// were more than a replay holds, it gets the newest and is told the channel
// was truncated, rather than silently missing the others.
func TestADegradedStreamIsToldWhenItsCatchUpIsCutShort(t *testing.T) {
	for _, tc := range []struct {
		published int
		truncated bool
	}{{3, false}, {5, false}, {8, true}} {
		h := validHandler()
		h.ReplayLimit = 5
		h.logger = zap.NewNop()
		h.metrics = newMetrics()
		h.hub = pubsub.NewMemoryHub()
		h.limits = h.hubLimits()
		s := newStream(h, []string{"a"})
		s.began = time.Now().UnixNano()
		sp, err := s.startingPoint(context.Background(), "")
		if err != nil {
			t.Fatal(err)
		}
		var last replay.Position
		for i := range tc.published {
			if last, err = h.hub.Publish(context.Background(), "a", pubsub.Message{Data: []byte(strconv.Itoa(i))}, h.limits); err != nil {
				t.Fatal(err)
			}
		}
		sp.pages[0].Head = last // what the recovering stream's starting point reads now
		if err := s.addSinceOpened(context.Background(), &sp); err != nil {
			t.Fatal(err)
		}
		if got, want := len(sp.pages[0].Events), min(tc.published, 5); got != want || (len(sp.truncated) > 0) != tc.truncated {
			t.Errorf("%d published since it opened: %d events, truncated %v; want %d, truncated %v",
				tc.published, got, sp.truncated, want, tc.truncated)
		}
		h.hub.Close()
	}
}
