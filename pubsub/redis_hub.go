package pubsub

import "strings"

// WithIdempotency makes the hub keep Idempotency-Key replies in s instead
// of this process's memory, e.g. in Redis for every instance.
func WithIdempotency(s IdempotencyStore) HubOption {
	return func(h *Hub) { h.once = s }
}

// NewRedisHub returns a hub over a Redis broker, with leases, throttles and
// idempotency keys shared by every instance on the same Redis. It does not
// connect.
func NewRedisHub(opts RedisOptions) (*Hub, error) {
	var broker *Redis
	var err error
	hub := NewHub(func(d DeliverFunc) Broker {
		broker, err = NewRedis(opts, d)
		return broker
	})
	if err != nil {
		return nil, err
	}
	leases := NewRedisLeases(broker)
	broker.onClose = append(broker.onClose, leases.Close)
	throttles := NewRedisThrottles(broker)
	throttles.follow(hub)
	for _, opt := range []HubOption{
		WithName("redis " + strings.Join(broker.opts.Addrs, ",") + " " + broker.opts.Prefix),
		WithLeases(leases),
		WithThrottles(throttles),
		WithIdempotency(NewRedisIdempotency(broker)),
	} {
		opt(hub)
	}
	return hub, nil
}
