package pubsub

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/replay"
)

// A client names the channels of its streams (channel public:{query.topics}):
// streams that come and go on channels nobody publishes to must leave
// nothing behind. The embedded broker notes when the last subscriber left a
// channel until the next sweep (a minute), to keep the channel's head; a
// channel with no history has none to keep, and noting it let one client
// fill that map with millions of names between two sweeps (about 285 bytes
// each, measured through Caddy). A channel with a history is still noted.
func TestMemoryBrokerForgetsUnpublishedChannelsAsSoonAsTheirStreamsLeave(t *testing.T) {
	h := newTestHub(t)
	mem := h.Broker().(*Memory)
	if _, err := h.Publish(context.Background(), "kept", Message{Data: []byte("x")}, replay.Limits{MaxAge: time.Hour}); err != nil {
		t.Fatal(err)
	}
	for i := range 1000 {
		h.Subscribe(newRecorder(), []string{fmt.Sprint("never-published-", i), "kept"}).Close()
	}
	mem.watchMu.Lock()
	left, watched := len(mem.left), len(mem.watched)
	_, keptNoted := mem.left["kept"]
	mem.watchMu.Unlock()
	if left != 1 || !keptNoted || watched != 0 {
		t.Fatalf("after 1000 streams on channels never published: left holds %d channels (the published one: %v), watched %d; want only the published one", left, keptNoted, watched)
	}
}
