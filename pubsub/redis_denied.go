package pubsub

import (
	"errors"
	"fmt"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// A Redis ACL user may be refused the subscriptions to the shard channels
// (no SSUBSCRIBE command, or no channel permission: a Redis 7 user has no
// channel unless granted). Redis answers, so this is not an outage: the
// shard's connection is fine, and Redis would refuse the same subscriptions
// on a new one. But its channels get no live events, so streams behave as
// SPEC S9 has them behave while Redis cannot deliver: open ones stay open
// with heartbeats (and catch up once the subscriptions are accepted), new
// ones open degraded (sse_degraded) and replay once they are (Read answers
// ErrUnavailable for a channel whose subscription is refused). The refusal
// is logged at error level, once and then at most every deniedLogEvery
// while it lasts, and reported in BackendStatus. The shard tries again with
// its reconnection backoff, to notice an ACL that grants them.

// ErrSubscribeDenied is why a channel's history is not read while Redis
// refuses this instance its subscription (wrapped with ErrUnavailable).
var ErrSubscribeDenied = errors.New("redis refuses this user the subscription to the channel's shard channel (ACL)")

// errDenied ends a shard's connection whose subscriptions Redis refused.
var errDenied = errors.New("subscriptions refused")

// deniedLogEvery is how often a refusal that lasts is logged again.
const deniedLogEvery = 5 * time.Minute

// denials are the shards whose subscriptions Redis refuses now.
type denials struct {
	mu     sync.Mutex
	shards map[string]error // by shard id
	logged time.Time
	// signal is closed at each refusal, and replaced (under mu); read
	// without the lock, by every new stream
	signal atomic.Pointer[chan struct{}]
}

// isNoPerm reports whether Redis refused a command for the user's ACL.
func isNoPerm(err error) bool {
	return err != nil && strings.HasPrefix(err.Error(), "NOPERM")
}

// isPingRefused reports whether Redis refused a PING for the user's ACL
// (NOPERM ... to run the 'ping' command).
func isPingRefused(err error) bool {
	return isNoPerm(err) && refusedPing.MatchString(strings.ToLower(err.Error()))
}

var refusedPing = regexp.MustCompile(`run the ['"` + "`" + `]ping['"` + "`" + `]`)

// warnPingRefused logs, once for the broker's life, that Redis refuses
// this user PING. The pub/sub connections go on (the refusal answers their
// PING, as it answers a probe of a Redis marked down: redis_probe.go), but
// Redis' ACL LOG notes every one.
func (b *Redis) warnPingRefused(err error) {
	if !b.pingRefused.Swap(true) {
		b.log().Warn("redis refuses this instance's user the PING command (ACL); the Redis user needs it",
			zap.String("acl_needed", "+ping"), zap.Error(err))
	}
}

// deniedSignal returns a channel closed at the next refusal of a shard's
// subscriptions: a new stream waiting for its channel's first sync stops
// waiting then if its channel is the one refused (an ACL may refuse some
// channels only), and waits on otherwise.
func (b *Redis) deniedSignal() <-chan struct{} {
	if p := b.denials.signal.Load(); p != nil {
		return *p
	}
	d := &b.denials
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.signal.Load() == nil {
		ch := make(chan struct{})
		d.signal.Store(&ch)
	}
	return *d.signal.Load()
}

// shardDenied records that Redis refused the subscriptions of shard id.
func (b *Redis) shardDenied(id string, err error) {
	d := &b.denials
	d.mu.Lock()
	if d.shards == nil {
		d.shards = make(map[string]error)
	}
	d.shards[id] = err
	logNow := time.Since(d.logged) >= deniedLogEvery
	if logNow {
		d.logged = time.Now()
	}
	ch := make(chan struct{})
	if old := d.signal.Swap(&ch); old != nil {
		close(*old)
	}
	d.mu.Unlock()
	if logNow {
		b.log().Error("redis refuses this instance's subscriptions to its shard channels (ACL): their streams get no live events, "+
			"and new streams open degraded (sse_degraded), until Redis accepts them; the Redis user needs the SSUBSCRIBE command "+
			"and the channels of the key prefix",
			zap.String("node", id), zap.String("acl_needed", "+ssubscribe &"+b.opts.Prefix+"*"), zap.Error(err))
	}
}

// shardAllowed records that shard id's subscriptions are accepted, or
// that it carries none any more.
func (b *Redis) shardAllowed(id string, confirmed bool) {
	d := &b.denials
	d.mu.Lock()
	_, was := d.shards[id]
	delete(d.shards, id)
	d.mu.Unlock()
	if was && confirmed {
		b.log().Info("redis accepts this instance's subscriptions to its shard channels again", zap.String("node", id))
	}
}

// deniedError is the error of the refusal in force, nil if there is none.
func (b *Redis) deniedError() error {
	d := &b.denials
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, err := range d.shards {
		return err
	}
	return nil
}

// readDenied is what Read answers for a channel whose subscription Redis
// refuses.
func readDenied(cause error) error {
	if cause == nil {
		return fmt.Errorf("%w: %w", ErrUnavailable, ErrSubscribeDenied)
	}
	return fmt.Errorf("%w: %w: %v", ErrUnavailable, ErrSubscribeDenied, cause)
}
