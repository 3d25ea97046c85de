package pubsub

import (
	"context"
	"errors"
	"sync"
	"time"
)

// ErrLimitReached is returned by Leases.Acquire when the principal already
// holds as many leases as the limit allows.
var ErrLimitReached = errors.New("pubsub: connection limit reached")

// Leases cap the open streams of each principal (SPEC S10). A lease is one
// stream's share of its principal's cap.
//
// Acquire is one atomic check-and-take: concurrent calls for a principal
// never hold more than limit leases between them. A limit of zero or less
// means no limit. ttl is how long a lease outlives an instance that dies
// without releasing it; an implementation shared by several instances keeps
// its leases alive from the instance (one batched renewal, never from
// stream traffic) and lets them lapse within ttl after the instance is
// gone. An implementation local to one process ignores it.
//
// Held counts principal's leases without taking one (across every instance
// for a shared implementation; a lease released here and not yet removed
// is not counted): an instance that is full refuses a stream with the
// right code without a lease that, taken only to be given back, would
// count against the principal on every instance for that round trip.
type Leases interface {
	Acquire(ctx context.Context, principal string, limit int, ttl time.Duration) (Lease, error)
	Held(ctx context.Context, principal string) (int, error)
}

// Lease is one stream's share of its principal's cap. Release gives it
// back; it is safe to call more than once, and must not block for long (an
// implementation that talks to a network releases in the background).
type Lease interface {
	Release()
}

// ReleaseNotifier is implemented by leases whose Release reaches a store
// shared by several instances in the background (Redis): ReleaseThen
// releases the lease as Release does, and calls then once, on a goroutine
// of its own, when the shared store no longer counts it or its removal
// failed (it lapses within its ttl then). then must not block. A stream
// told to reconnect at once (server_closing at a stop or reload) says so
// only then: its client may come back through another instance at once,
// whose check of the cap would otherwise still count the old stream.
type ReleaseNotifier interface {
	ReleaseThen(then func())
}

// LeaseCounter is implemented by leases shared by several instances (the
// Redis backend): Counts returns how many leases each principal holds across
// all of them, and Holders which of principals hold a lease here (streams on
// routes without a cap take none, so their principals have no count). The
// admin stats endpoint uses them for the cluster-wide count per principal;
// the in-process MemoryLeases do not implement it, since their count is this
// instance's own (see Census).
type LeaseCounter interface {
	Counts(ctx context.Context, principals []string) (map[string]int, error)
	Holders(principals []string) []string
}

// MemoryLeases are the leases of one process: the cap holds per instance.
type MemoryLeases struct {
	mu   sync.Mutex
	held map[string]int
}

// NewMemoryLeases returns leases of which none is held.
func NewMemoryLeases() *MemoryLeases {
	return &MemoryLeases{held: make(map[string]int)}
}

// Acquire takes a lease for principal unless it holds limit already.
func (m *MemoryLeases) Acquire(_ context.Context, principal string, limit int, _ time.Duration) (Lease, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if limit > 0 && m.held[principal] >= limit {
		return nil, ErrLimitReached
	}
	m.held[principal]++
	return &memoryLease{of: m, principal: principal}, nil
}

// Held returns how many leases principal holds.
func (m *MemoryLeases) Held(_ context.Context, principal string) (int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.held[principal], nil
}

func (m *MemoryLeases) release(principal string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.held[principal]--; m.held[principal] <= 0 {
		delete(m.held, principal)
	}
}

type memoryLease struct {
	of        *MemoryLeases
	principal string
	once      sync.Once
}

// Release gives the lease back, once.
func (l *memoryLease) Release() {
	l.once.Do(func() { l.of.release(l.principal) })
}

// Interface guards
var _ Leases = (*MemoryLeases)(nil)
