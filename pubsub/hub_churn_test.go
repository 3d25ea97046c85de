package pubsub

import (
	"context"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/replay"
)

type seqRecorder struct {
	mu   sync.Mutex
	seqs []uint64
}

func (r *seqRecorder) Deliver(_ int, ev *replay.Event) {
	r.mu.Lock()
	r.seqs = append(r.seqs, ev.Pos.Seq)
	r.mu.Unlock()
}

// Subscribers join and leave while two publishers run: each sees, after
// the head it read once subscribed, every event in order, none missing.
func TestHubJoinAndLeaveWhilePublishing(t *testing.T) {
	h := NewMemoryHub()
	defer h.Close()
	ctx := context.Background()
	lim := replay.Limits{Count: 100000, MaxBytes: 1 << 30}
	var stop atomic.Bool
	var pubs sync.WaitGroup
	for range 2 {
		pubs.Add(1)
		go func() {
			defer pubs.Done()
			for !stop.Load() {
				if _, err := h.Publish(ctx, "x", Message{Data: []byte("d")}, lim); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	var subs sync.WaitGroup
	for range 4 {
		subs.Add(1)
		go func() {
			defer subs.Done()
			for range 50 {
				r := &seqRecorder{}
				sub := h.Subscribe(r, []string{"x"})
				page, _ := h.Read(ctx, "x", nil, 0)
				deadline := time.Now().Add(10 * time.Second)
				for {
					r.mu.Lock()
					n := len(r.seqs)
					r.mu.Unlock()
					if n >= 3 {
						break
					}
					if time.Now().After(deadline) {
						t.Error("no events within 10 s")
						break
					}
					runtime.Gosched()
				}
				sub.Close()
				r.mu.Lock()
				next := page.Head.Seq + 1
				for _, s := range r.seqs {
					if s < next {
						continue
					}
					if s != next {
						t.Errorf("after head %d: got %d, want %d (%v)", page.Head.Seq, s, next, r.seqs)
						break
					}
					next++
				}
				r.mu.Unlock()
			}
		}()
	}
	subs.Wait()
	stop.Store(true)
	pubs.Wait()
	if n := h.Subscribers("x"); n != 0 {
		t.Fatalf("%d subscribers left", n)
	}
}
