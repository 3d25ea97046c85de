package caddysse

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/caddy-sse/caddy-sse/pubsub"
	"github.com/caddy-sse/caddy-sse/replay"
)

// idRecorder records the id lines a stream writes.
type idRecorder struct {
	mu  sync.Mutex
	ids []string
}

func (w *idRecorder) Write(p []byte) error {
	if id, ok := strings.CutPrefix(string(p), "id: "); ok {
		w.mu.Lock()
		w.ids = append(w.ids, strings.TrimSpace(id))
		w.mu.Unlock()
	}
	if rand.IntN(64) == 0 {
		time.Sleep(50 * time.Microsecond)
	}
	return nil
}
func (w *idRecorder) Flush() error           { return nil }
func (w *idRecorder) WriteLast([]byte) error { return nil }
func (w *idRecorder) MayBlock() bool         { return true }

// Concurrent publishers on three channels, a queue that overflows over and
// over (by count and by bytes): each id the stream writes moves exactly one
// channel on by exactly one, and at the end every channel is at its last
// event — no gap, no duplicate, in order.
func TestOverflowingStreamKeepsEachChannelsOrder(t *testing.T) {
	h := validHandler()
	h.Queue = 3
	h.QueueBytes = 200
	h.hub = pubsub.NewMemoryHub()
	defer h.hub.Close()
	h.limits = h.hubLimits()
	h.metrics = newMetrics()
	h.logger = zap.NewNop()
	names := []string{"a", "b", "c"}
	s := newStream(h, names)
	s.sub = h.hub.Subscribe(s, s.keys)
	defer s.sub.Close()
	w := &idRecorder{}
	s.out = w
	ctx := context.Background()
	if _, err := s.startingPoint(ctx, ""); err != nil {
		t.Fatal(err)
	}
	const perPublisher, publishers = 300, 2
	var wg sync.WaitGroup
	for _, ch := range names {
		for p := range publishers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range perPublisher {
					data := fmt.Sprintf("%s-%d-%d", ch, p, i)
					if i%7 == 0 {
						data += strings.Repeat("x", 120)
					}
					if _, err := h.hub.Publish(ctx, ch, pubsub.Message{Data: []byte(data)}, h.limits); err != nil {
						t.Error(err)
						return
					}
				}
			}()
		}
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	for stop := false; !stop; {
		select {
		case <-done:
			stop = true
		default:
		}
		if err := s.drain(ctx); err != nil {
			t.Fatalf("drain: %v", err)
		}
	}
	if err := s.drain(ctx); err != nil {
		t.Fatal(err)
	}
	prev := make([]replay.Position, len(names))
	for n, id := range w.ids {
		cur, ok := replay.ParseCursor(id)
		if !ok {
			t.Fatalf("id %d does not parse", n)
		}
		moved := 0
		for slot := range names {
			pos, _ := replay.Lookup(cur, s.cursor[slot].Hash)
			if pos == prev[slot] || pos.IsZero() && prev[slot].IsZero() {
				continue // (an empty channel's position names the log's epoch)
			}
			moved++
			if !prev[slot].Follows(pos) {
				t.Fatalf("id %d: channel %s went from %d to %d", n, names[slot], prev[slot].Seq, pos.Seq)
			}
			prev[slot] = pos
		}
		if moved != 1 {
			t.Fatalf("id %d moved %d channels", n, moved)
		}
	}
	for slot, name := range names {
		if prev[slot].Seq != perPublisher*publishers {
			t.Errorf("channel %s ends at %d, want %d", name, prev[slot].Seq, perPublisher*publishers)
		}
	}
}
