// Package pubsub carries events from publishers to the streams that
// subscribe to them. A Broker moves events between instances and keeps
// their history (in memory for one instance; Redis for many); the Hub sits
// on top of a broker in each process, keeps the local subscribers of every
// channel and fans each event out to them. It does not import Caddy.
package pubsub

import (
	"context"
	"errors"

	"github.com/caddy-sse/caddy-sse/replay"
)

// Message is what a publisher sends to a channel.
type Message struct {
	// Type is the event type ("" for EventSource's default "message").
	Type string
	// Data is the payload, UTF-8 text.
	Data []byte
	// Once, if set, makes the publishes of this message to a channel one:
	// a publish with the same Once (a request retried under its
	// Idempotency-Key after it failed on another channel) returns the
	// first one's position instead of publishing again, while the broker
	// keeps it (Redis: as long as an Idempotency-Key, IdempotencyTTL). The
	// embedded broker, whose publishes cannot fail halfway, ignores it.
	Once string
	// Token, for a message without Once, is the token its calls carry
	// (random if empty): a publish with Once equal to it, while the broker
	// keeps it (Redis: publishOnceTTL, at least 30 s), returns its position
	// instead of publishing again. A caller that offers the retry of a
	// failed request under a key it made up derives it from that key, so
	// the retry publishes nothing twice, even where the failed call reached
	// Redis and its answer was lost.
	Token string
	// TokenRequired makes a publish with Token keep it while the channel's
	// slot migrates (a Redis Cluster reshard), as a publish with Once
	// does: it waits for the slot's keys to move, or fails, rather than
	// go without it. A request to several channels needs it: if it fails
	// on one, its retry publishes again on every other one that went
	// without its token. Others may go without: their token only serves
	// the retry of a call whose answer was lost.
	TokenRequired bool
}

// DeliverFunc receives every event of a channel that this instance watches,
// in the channel's order. The event must not be modified.
type DeliverFunc func(channel string, ev *replay.Event)

// Broker moves events between instances and keeps each channel's history.
type Broker interface {
	// Publish appends msg to channel's history and delivers it to the
	// watchers of the channel on every instance. It never waits for
	// subscribers.
	Publish(ctx context.Context, channel string, msg Message, lim replay.Limits) (replay.Position, error)
	// Read returns the events of channel after position after (at most
	// limit, by the rules of replay.Select), or only the channel's head if
	// after is nil.
	Read(ctx context.Context, channel string, after *replay.Position, limit int) (replay.Page, error)
	// Watch tells the broker that this instance has local subscribers of
	// channel, Unwatch that it has none left. Calls for one channel are
	// serialized by the hub and alternate: Watch, Unwatch, Watch, ...
	// Neither may block on the network.
	Watch(channel string)
	Unwatch(channel string)
	// Close releases the broker's resources.
	Close() error
}

// ErrClosed is returned by a hub or broker that has been closed.
var ErrClosed = errors.New("pubsub: closed")
