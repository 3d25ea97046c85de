package caddysse

import (
	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-sse/caddy-sse/pubsub"
)

// hubs holds the hubs shared by handlers, keyed by backend. It is a
// UsagePool so that a hub and its history outlive a config reload: the new
// config's handlers take their reference before the old ones let go.
var hubs = caddy.NewUsagePool()

// embeddedHubKey names the in-process hub: one per process (SPEC S1).
const embeddedHubKey = "embedded"

// pooledHub lets the pool close a hub when its last user lets go.
type pooledHub struct{ *pubsub.Hub }

// Destruct closes the hub.
func (p pooledHub) Destruct() error { return p.Close() }

// acquireHub returns the hub for the handler's backend and the key to
// release it with: the embedded hub, or the one for these Redis settings.
// Creating a hub is cheap: no goroutine, no network.
func acquireHub(redisOpts *pubsub.RedisOptions, key string) (*pubsub.Hub, string, error) {
	if redisOpts == nil {
		key = embeddedHubKey
	}
	val, _, err := hubs.LoadOrNew(key, func() (caddy.Destructor, error) {
		if redisOpts == nil {
			return pooledHub{pubsub.NewMemoryHub()}, nil
		}
		hub, err := pubsub.NewRedisHub(*redisOpts)
		if err != nil {
			return nil, err
		}
		return pooledHub{hub}, nil
	})
	if err != nil {
		return nil, "", err
	}
	return val.(pooledHub).Hub, key, nil
}

func releaseHub(key string) error {
	_, err := hubs.Delete(key)
	return err
}

// Interface guards
var _ caddy.Destructor = pooledHub{}
