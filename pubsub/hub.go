package pubsub

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-sse/caddy-sse/replay"
)

// Subscriber receives the live events of the channels it subscribed to.
// Deliver is called from the publisher's or broker's goroutine, in each
// channel's order, and must not block: it queues the event and returns.
// slot is the index of the channel in the list given to Subscribe.
type Subscriber interface {
	Deliver(slot int, ev *replay.Event)
}

// Hub fans the events of a broker out to the subscribers of this process.
// Every handler that names the same backend shares one hub, so a publish on
// one route reaches the subscribers of all the others.
type Hub struct {
	broker    Broker
	once      IdempotencyStore
	name      string
	leases    Leases
	throttles Throttles
	census    *Census

	// watchMu orders the changes of channels with the broker's Watch and
	// Unwatch calls, which run under it but not under mu: the broker calls
	// deliver, which reads channels under mu, while it holds its own locks
	// (the embedded log's ring of the channel), and Unwatch takes those
	// locks. Called under mu, a stream leaving a channel, a publish and
	// the embedded log's sweep each waited on the next, for good.
	watchMu  sync.Mutex
	mu       sync.RWMutex
	channels map[string]*members
	closed   atomic.Bool
}

// members are a channel's local subscribers. Each membership knows its
// index so that leaving is a swap-remove, not a search.
type members struct {
	name string
	mu   sync.RWMutex
	list []*Membership
}

// Membership is one subscriber's subscription to one channel. Every idle
// stream keeps one per channel: it is kept small (32 bytes).
type Membership struct {
	sub   Subscriber
	of    *members
	slot  int32
	index int32
}

// Subscription is what Subscribe returns; Close ends it.
type Subscription struct {
	hub     *Hub
	members []Membership // one allocation for all the channels
	// one holds the membership of a one-channel subscription, the usual
	// kind: it then costs one allocation of 80 bytes, not two of 112.
	one  [1]Membership
	done bool
}

// NewHub returns a hub over the broker that newBroker builds; the broker
// delivers its events to the hub. Without options the hub's leases and
// throttles are those of this process (MemoryLeases, MemoryThrottles); a
// backend shared by several instances passes its own.
func NewHub(newBroker func(DeliverFunc) Broker, opts ...HubOption) *Hub {
	h := &Hub{
		channels:  make(map[string]*members),
		once:      NewIdempotency(),
		leases:    NewMemoryLeases(),
		throttles: NewMemoryThrottles(),
		census:    NewCensus(),
	}
	for _, opt := range opts {
		opt(h)
	}
	h.broker = newBroker(h.deliver)
	return h
}

// NewMemoryHub returns a hub over the embedded broker.
func NewMemoryHub() *Hub {
	return NewHub(func(d DeliverFunc) Broker { return NewMemory(d) }, WithName("embedded"))
}

// Available reports whether the hub's backend answers (always, for the
// embedded broker). Streams opened while it does not are degraded: live
// only until it answers again.
func (h *Hub) Available() bool {
	if a, ok := h.broker.(interface{ Available() bool }); ok {
		return a.Available()
	}
	return true
}

// Broker returns the hub's broker.
func (h *Hub) Broker() Broker { return h.broker }

// Idempotency returns the store of publish replies for Idempotency-Key.
func (h *Hub) Idempotency() IdempotencyStore { return h.once }

// Publish publishes msg to channel through the broker.
func (h *Hub) Publish(ctx context.Context, channel string, msg Message, lim replay.Limits) (replay.Position, error) {
	if h.closed.Load() {
		return replay.Position{}, ErrClosed
	}
	return h.broker.Publish(ctx, channel, msg, lim)
}

// PublishCounted is Publish that also reports whether the broker answered
// with the event of an earlier call (repeat: a keyed retry, for a channel
// its first attempt published), nothing being published now. Only a broker
// that keeps publish tokens (Redis) answers so.
func (h *Hub) PublishCounted(ctx context.Context, channel string, msg Message, lim replay.Limits) (pos replay.Position, repeat bool, err error) {
	if h.closed.Load() {
		return replay.Position{}, false, ErrClosed
	}
	if b, ok := h.broker.(interface {
		PublishCounted(context.Context, string, Message, replay.Limits) (replay.Position, bool, error)
	}); ok {
		return b.PublishCounted(ctx, channel, msg, lim)
	}
	pos, err = h.broker.Publish(ctx, channel, msg, lim)
	return pos, false, err
}

// Read reads channel's history through the broker.
func (h *Hub) Read(ctx context.Context, channel string, after *replay.Position, limit int) (replay.Page, error) {
	if h.closed.Load() {
		return replay.Page{}, ErrClosed
	}
	return h.broker.Read(ctx, channel, after, limit)
}

// Clock is a broker whose clock, which dates the events it publishes
// (replay.Position's Time), is not this process's.
type Clock interface {
	// Now reads the clock that dates channel's events.
	Now(ctx context.Context, channel string) (time.Time, error)
}

// Now reads the clock that dates channel's events: the broker's, if it
// has one of its own (Clock), else this process's.
func (h *Hub) Now(ctx context.Context, channel string) (time.Time, error) {
	if c, ok := h.broker.(Clock); ok {
		return c.Now(ctx, channel)
	}
	return time.Now(), nil
}

// Subscribe makes sub receive the live events of channels from now on;
// the event of channels[i] arrives with slot i. Subscribe before reading the
// history, so that no event falls between the two (events seen twice are
// told apart by their position).
func (h *Hub) Subscribe(sub Subscriber, channels []string) *Subscription {
	s := &Subscription{hub: h}
	if len(channels) == 1 {
		s.members = s.one[:]
	} else {
		s.members = make([]Membership, len(channels))
	}
	h.watchMu.Lock()
	defer h.watchMu.Unlock()
	var newNames [8]string // on the stack: most streams have few channels
	watch := newNames[:0]
	h.mu.Lock()
	for i, name := range channels {
		ms := h.channels[name]
		if ms == nil {
			ms = &members{name: name}
			h.channels[name] = ms
			watch = append(watch, name)
		}
		m := &s.members[i]
		*m = Membership{sub: sub, slot: int32(i), of: ms}
		ms.mu.Lock()
		m.index = int32(len(ms.list))
		ms.list = append(ms.list, m)
		ms.mu.Unlock()
	}
	h.mu.Unlock()
	for _, name := range watch {
		h.broker.Watch(name)
	}
	return s
}

// Close ends the subscription; it is safe to call more than once.
func (s *Subscription) Close() {
	if s == nil {
		return
	}
	h := s.hub
	h.watchMu.Lock()
	defer h.watchMu.Unlock()
	if s.done {
		return
	}
	s.done = true
	var emptied [8]string
	unwatch := emptied[:0]
	h.mu.Lock()
	for i := range s.members {
		m := &s.members[i]
		ms := m.of
		ms.mu.Lock()
		last := ms.list[len(ms.list)-1]
		ms.list[m.index] = last
		last.index = m.index
		ms.list[len(ms.list)-1] = nil
		ms.list = ms.list[:len(ms.list)-1]
		empty := len(ms.list) == 0
		ms.mu.Unlock()
		if empty && h.channels[ms.name] == ms {
			delete(h.channels, ms.name)
			unwatch = append(unwatch, ms.name)
		}
	}
	h.mu.Unlock()
	for _, name := range unwatch {
		h.broker.Unwatch(name)
	}
}

// deliver hands ev to every local subscriber of channel. It allocates
// nothing: the event is shared, and each subscriber queues a pointer.
func (h *Hub) deliver(channel string, ev *replay.Event) {
	h.mu.RLock()
	ms := h.channels[channel]
	h.mu.RUnlock()
	if ms == nil {
		return
	}
	ms.mu.RLock()
	for _, m := range ms.list {
		m.sub.Deliver(int(m.slot), ev)
	}
	ms.mu.RUnlock()
}

// LastKnown returns the position of the last event of channel this process
// delivered, if its broker follows the channel (Redis: the watch of a
// channel some stream reads); false otherwise. It needs no call to the
// backend: a stream that opens while Redis is down starts after it.
func (h *Hub) LastKnown(channel string) (replay.Position, bool) {
	if k, ok := h.broker.(interface {
		lastKnown(channel string) (replay.Position, bool)
	}); ok {
		return k.lastKnown(channel)
	}
	return replay.Position{}, false
}

// Subscribers returns how many local subscriptions channel has.
func (h *Hub) Subscribers(channel string) int {
	h.mu.RLock()
	ms := h.channels[channel]
	h.mu.RUnlock()
	if ms == nil {
		return 0
	}
	ms.mu.RLock()
	defer ms.mu.RUnlock()
	return len(ms.list)
}

// Close closes the broker; later publishes and reads fail with ErrClosed.
func (h *Hub) Close() error {
	if h.closed.Swap(true) {
		return nil
	}
	return h.broker.Close()
}
