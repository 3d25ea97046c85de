package pubsub

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/replay"
)

// The embedded hub must never deadlock between its minute's sweep, a
// publish and a stream leaving the last channel it held. A publish holds
// its channel's ring while it delivers (which reads the hub's channels);
// the sweep holds the log while it locks each ring in turn; a subscription
// that closes held the hub's channels while it asked the log whether the
// channel it left has a history (Memory.Unwatch). Each waited on the next:
// the hub stopped for good, every stream silent, every publish and every
// new stream hanging. Clients make streams come and go at will, so on a
// busy hub it was a matter of time.
func TestMemoryHubSweepPublishAndLeaveDoNotDeadlock(t *testing.T) {
	h := NewMemoryHub() // not closed if it deadlocks: Close would hang too
	mem := h.Broker().(*Memory)
	lim := replay.Limits{Count: 10, MaxAge: time.Hour}
	const channels = 5000
	for i := range channels {
		if _, err := h.Publish(context.Background(), fmt.Sprint("c-", i), Message{Data: []byte("x")}, lim); err != nil {
			t.Fatal(err)
		}
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var sweeps, publishes, leaves atomic.Int64
	loop := func(n *atomic.Int64, step func()) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				step()
				n.Add(1)
			}
		}()
	}
	loop(&sweeps, mem.Sweep)
	for range 2 {
		loop(&publishes, func() {
			_, _ = h.Publish(context.Background(), fmt.Sprint("c-", rand.IntN(channels)), Message{Data: []byte("y")}, lim)
		})
		loop(&leaves, func() {
			h.Subscribe(newRecorder(), []string{fmt.Sprint("c-", rand.IntN(channels))}).Close()
		})
	}
	time.Sleep(2 * time.Second) // bounded load: the loops run this long
	close(stop)
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
		h.Close()
	case <-time.After(5 * time.Second):
		t.Fatalf("the hub deadlocked: after %d sweeps, %d publishes and %d leaves nothing moves", sweeps.Load(), publishes.Load(), leaves.Load())
	}
	if sweeps.Load() == 0 || publishes.Load() == 0 || leaves.Load() == 0 {
		t.Fatalf("the loops did not all run: %d sweeps, %d publishes, %d leaves", sweeps.Load(), publishes.Load(), leaves.Load())
	}
}
