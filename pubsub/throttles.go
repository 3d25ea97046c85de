package pubsub

import (
	"context"
	"sync"
	"time"
)

// maxThrottles bounds how many throttled clients the in-process store keeps
// at once, so that a flood of slow clients cannot exhaust memory; beyond it
// the oldest throttles are forgotten early.
const maxThrottles = 100_000

// Throttles remember clients that were disconnected for being slow, so that
// their next connections are refused for a while (SPEC S7). A key names a
// client: its principal and remote address, or the address alone.
type Throttles interface {
	// Throttle refuses key for d from now. An existing longer throttle
	// of key is kept.
	Throttle(ctx context.Context, key string, d time.Duration) error
	// Remaining returns how long key is still refused; zero if it is not.
	Remaining(ctx context.Context, key string) (time.Duration, error)
}

// MemoryThrottles are the throttles of one process.
type MemoryThrottles struct {
	mu    sync.Mutex
	until map[string]time.Time
	order []throttleEntry // insertion order, for expiry
	now   func() time.Time
}

type throttleEntry struct {
	key   string
	until time.Time
}

// NewMemoryThrottles returns a store in which nobody is throttled.
func NewMemoryThrottles() *MemoryThrottles {
	return &MemoryThrottles{until: make(map[string]time.Time), now: time.Now}
}

// Throttle refuses key for d from now.
func (m *MemoryThrottles) Throttle(_ context.Context, key string, d time.Duration) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.now()
	m.expire(now)
	until := now.Add(d)
	if until.After(m.until[key]) {
		m.until[key] = until
		m.order = append(m.order, throttleEntry{key: key, until: until})
	}
	return nil
}

// Remaining returns how long key is still refused.
func (m *MemoryThrottles) Remaining(_ context.Context, key string) (time.Duration, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	until, ok := m.until[key]
	if !ok {
		return 0, nil
	}
	left := until.Sub(m.now())
	if left <= 0 {
		return 0, nil
	}
	return left, nil
}

// expire forgets the throttles at the head of the insertion order that
// have ended, and the oldest beyond the size bound (keeping room for one
// more). An entry superseded by a longer throttle of the same key is
// dropped without touching the map.
func (m *MemoryThrottles) expire(now time.Time) {
	n := 0
	for ; n < len(m.order); n++ {
		e := m.order[n]
		if now.Before(e.until) && len(m.order)-n < maxThrottles {
			break
		}
		if m.until[e.key].Equal(e.until) {
			delete(m.until, e.key)
		}
	}
	clear(m.order[:n])
	m.order = m.order[n:]
}

// Interface guards
var _ Throttles = (*MemoryThrottles)(nil)
