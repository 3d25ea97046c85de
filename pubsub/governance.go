package pubsub

// HubOption configures a hub at NewHub.
type HubOption func(*Hub)

// WithName names the hub's backend for statistics (e.g. "embedded", or a
// Redis address and prefix). It must not contain secrets.
func WithName(name string) HubOption {
	return func(h *Hub) { h.name = name }
}

// WithLeases makes the hub cap principals with l instead of in-process
// leases, e.g. leases shared by every instance on one Redis.
func WithLeases(l Leases) HubOption {
	return func(h *Hub) { h.leases = l }
}

// WithThrottles makes the hub throttle clients with t instead of in-process
// throttles, e.g. throttles shared by every instance on one Redis.
func WithThrottles(t Throttles) HubOption {
	return func(h *Hub) { h.throttles = t }
}

// Name returns the name of the hub's backend.
func (h *Hub) Name() string { return h.name }

// Leases returns the leases that cap the streams of each principal.
func (h *Hub) Leases() Leases { return h.leases }

// Throttles returns the clients refused for having been too slow.
func (h *Hub) Throttles() Throttles { return h.throttles }

// Census returns the count of the streams open on this instance.
func (h *Hub) Census() *Census { return h.census }

// TopChannels returns the n channels with the most local subscriptions,
// most first, and how many channels have any; the hub's internal channel
// is not one of them.
func (h *Hub) TopChannels(n int) ([]Count, int) {
	h.mu.RLock()
	all := make([]Count, 0, len(h.channels))
	for name, ms := range h.channels {
		if name == throttleChannel {
			continue // the hub's own (RedisThrottles.following), not a stream's
		}
		ms.mu.RLock()
		all = append(all, Count{Name: name, Streams: len(ms.list)})
		ms.mu.RUnlock()
	}
	h.mu.RUnlock()
	return top(all, n), len(all)
}
