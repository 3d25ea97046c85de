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
// release it with. Creating it is cheap: no goroutine, no network.
func acquireHub() (*pubsub.Hub, string, error) {
	val, _, err := hubs.LoadOrNew(embeddedHubKey, func() (caddy.Destructor, error) {
		return pooledHub{pubsub.NewMemoryHub()}, nil
	})
	if err != nil {
		return nil, "", err
	}
	return val.(pooledHub).Hub, embeddedHubKey, nil
}

func releaseHub(key string) error {
	_, err := hubs.Delete(key)
	return err
}

// Interface guards
var _ caddy.Destructor = pooledHub{}
