package pubsub

import (
	"context"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisThrottles keep throttled clients in Redis, so that a slow client is
// refused by every instance: the key "<prefix>throttle:{<key>}" exists
// while it is refused.
type RedisThrottles struct {
	b *Redis
}

// NewRedisThrottles returns throttles in b's Redis.
func NewRedisThrottles(b *Redis) *RedisThrottles { return &RedisThrottles{b: b} }

// throttleAtLeast sets the key's expiry to d unless it already lasts longer.
var throttleAtLeast = redis.NewScript(`
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], '1', 'PX', ARGV[1])
end
return 1`)

func (r *RedisThrottles) key(k string) string { return r.b.opts.Prefix + "throttle:{" + k + "}" }

// Throttle refuses key for d from now on every instance.
func (r *RedisThrottles) Throttle(ctx context.Context, key string, d time.Duration) error {
	ms := max(d.Milliseconds(), 1)
	return r.b.classify(throttleAtLeast.Run(ctx, r.b.client, []string{r.key(key)}, ms).Err())
}

// Remaining returns how long key is still refused.
func (r *RedisThrottles) Remaining(ctx context.Context, key string) (time.Duration, error) {
	left, err := r.b.client.PTTL(ctx, r.key(key)).Result()
	if err != nil {
		return 0, r.b.classify(err)
	}
	if left < 0 { // -2: no key; -1: no expiry (not ours)
		return 0, nil
	}
	return left, nil
}

// Interface guards
var _ Throttles = (*RedisThrottles)(nil)
