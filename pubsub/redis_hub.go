package pubsub

import (
	"strconv"
	"strings"
)

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
	// following the announcements keeps a connection to Redis, whose state
	// the broker then reports (caddy_sse_redis_up)
	broker.onFirstStatus = throttles.following
	for _, opt := range []HubOption{
		WithName(redisHubName(broker.opts)),
		WithLeases(leases),
		WithThrottles(throttles),
		WithIdempotency(NewRedisIdempotency(broker)),
	} {
		opt(hub)
	}
	return hub, nil
}

// redisHubName names a Redis hub for people (the admin stats): its
// addresses, the Sentinel master and the database where they are set, and
// the key prefix — what tells two Redis backends apart.
func redisHubName(o RedisOptions) string {
	name := "redis " + strings.Join(o.Addrs, ",")
	if o.MasterName != "" {
		name += " master " + o.MasterName
	}
	if o.DB != 0 {
		name += " db " + strconv.Itoa(o.DB)
	}
	return name + " " + o.Prefix
}
