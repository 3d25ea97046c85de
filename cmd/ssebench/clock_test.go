//go:build linux

package main

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// monoNs reads CLOCK_MONOTONIC: a clock no step of the wall clock (NTP,
// date -s) moves, shared by every process of the box.
func monoNs(t *testing.T) int64 {
	t.Helper()
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		t.Fatal(err)
	}
	return ts.Nano()
}

type capturingPublisher struct {
	mu   sync.Mutex
	data [][]byte
}

func (p *capturingPublisher) publish(_ context.Context, _, _ string, data []byte, _ string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.data = append(p.data, append([]byte(nil), data...))
	return nil
}
func (*capturingPublisher) close() {}

// The publish time in an event's data and the receive time it is
// compared with are read from CLOCK_MONOTONIC, which the publisher, the
// streams and the -procs workers (other processes) share and a step of
// the wall clock does not move. Both were the wall clock: a step during a
// run (NTP) shifted every latency measured across it by the step.
func TestLatencyClockIsMonotonic(t *testing.T) {
	p := &capturingPublisher{}
	runPublish(context.Background(), p, pubPlan{
		channels: []string{"bench0"}, count: 1, chanOf: func(int) int { return 0 }, workers: 1, ordered: true, event: "tick",
	})
	after := monoNs(t)
	if len(p.data) != 1 {
		t.Fatalf("%d publishes", len(p.data))
	}
	ev, ok := parseBenchData(p.data[0])
	if d := time.Duration(after - ev.t); !ok || d < 0 || d > 10*time.Second {
		t.Errorf("published at t=%d, CLOCK_MONOTONIC %d after it: the stamp is not the monotonic clock's", ev.t, after)
	}

	const age = 50 * time.Millisecond
	base := serve(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		ev := benchEvent{ch: 0, seq: 1, t: monoNs(t) - int64(age)}
		fmt.Fprintf(w, ": ok\n\nevent: tick\ndata: %s\nid: 1\n\n", appendBenchData(nil, ev, 0))
		_ = http.NewResponseController(w).Flush()
		<-r.Context().Done()
	}))
	for _, engName := range []string{"std", "epoll"} {
		t.Run(engName, func(t *testing.T) {
			eng, c := startOneStream(t, engName, base)
			deadline := time.Now().Add(5 * time.Second)
			for c.uniq[0].Load() < 1 && time.Now().Before(deadline) {
				time.Sleep(5 * time.Millisecond)
			}
			if err := eng.closeAll(5 * time.Second); err != nil {
				t.Fatal(err)
			}
			tot := eng.core().totals()
			if lat := time.Duration(tot.lat.Max()); tot.received != 1 || lat < age || lat > 10*time.Second {
				t.Fatalf("received %d, latency %s; the event was stamped %s before it was sent (CLOCK_MONOTONIC)", tot.received, lat, age)
			}
		})
	}
}
