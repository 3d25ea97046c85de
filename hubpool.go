package caddysse

import (
	"sync"

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

// inFlight counts a handler's publishes in flight, so that its Cleanup lets
// go of the hub only once they have ended: Caddy cleans an old config up
// without waiting for its requests (its servers shut down in the
// background), and a reload that replaces the hub (a setting of the redis
// block changed) closed it under them.
type inFlight struct {
	mu      sync.Mutex
	n       int
	release func() // Cleanup's release of the hub, put off until n is 0
}

func (f *inFlight) begin() {
	f.mu.Lock()
	f.n++
	f.mu.Unlock()
}

func (f *inFlight) end() {
	f.mu.Lock()
	f.n--
	var release func()
	if f.n == 0 {
		release, f.release = f.release, nil
	}
	f.mu.Unlock()
	if release != nil {
		go release() // closing a hub may wait (for Redis): not on a request
	}
}

// putOff keeps release for the end of the last request in flight and
// reports true, or reports false if none is: the caller releases now.
func (f *inFlight) putOff(release func()) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.n == 0 {
		return false
	}
	f.release = release
	return true
}

// Interface guards
var _ caddy.Destructor = pooledHub{}
