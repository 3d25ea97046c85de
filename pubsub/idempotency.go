package pubsub

import (
	"context"
	"errors"
	"sync"
	"time"
)

// Idempotency-Key replies are kept this long (SPEC S6) and at most this many
// at once, so that a flood of keys cannot exhaust memory.
const (
	IdempotencyTTL        = 10 * time.Minute
	maxIdempotencyEntries = 100_000
)

// ErrKeyReused is returned when an Idempotency-Key comes back with another
// request than the one it was first used with.
var ErrKeyReused = errors.New("idempotency key reused with a different request")

// Idempotency remembers the reply of each publish made with an
// Idempotency-Key, so that a retry returns the first reply instead of
// publishing again. A retry that arrives while the first request is still
// publishing waits for its reply.
type Idempotency struct {
	mu      sync.Mutex
	entries map[string]*onceEntry
	order   []*onceEntry // insertion order, for expiry
	now     func() time.Time
}

type onceEntry struct {
	key         string
	fingerprint string
	done        chan struct{}
	reply       []byte
	failed      bool
	expires     time.Time
}

// NewIdempotency returns an empty store.
func NewIdempotency() *Idempotency {
	return &Idempotency{entries: make(map[string]*onceEntry), now: time.Now}
}

// Do runs publish once per key: the first call runs it and remembers its
// reply; later calls with the same key and fingerprint return that reply
// with replayed set. A publish that fails is forgotten, so a retry runs
// again. A call with the same key but another fingerprint gets ErrKeyReused.
func (o *Idempotency) Do(ctx context.Context, key, fingerprint string, publish func() ([]byte, error)) (reply []byte, replayed bool, err error) {
	for {
		e, first := o.claim(key, fingerprint)
		if e.fingerprint != fingerprint {
			return nil, false, ErrKeyReused
		}
		if first {
			return o.run(e, publish)
		}
		select {
		case <-e.done:
		case <-ctx.Done():
			select {
			case <-e.done: // settled as well: the reply beats the cancellation
			default:
				return nil, false, ctx.Err()
			}
		}
		if !e.failed {
			return e.reply, true, nil
		}
		// the first attempt failed and was forgotten: try again
	}
}

// settledReply returns key's reply if a publish with it succeeded here,
// waiting for one under way; found is false if there is none (never used
// here, or its publish failed). Another request under the key gets
// ErrKeyReused.
func (o *Idempotency) settledReply(ctx context.Context, key, fingerprint string) (reply []byte, found bool, err error) {
	o.mu.Lock()
	o.expire(o.now())
	e := o.entries[key]
	o.mu.Unlock()
	if e == nil {
		return nil, false, nil
	}
	if e.fingerprint != fingerprint {
		return nil, false, ErrKeyReused
	}
	select {
	case <-e.done:
	case <-ctx.Done():
		return nil, false, ctx.Err()
	}
	if e.failed {
		return nil, false, nil
	}
	return e.reply, true, nil
}

// run publishes for the entry it claimed and settles it even if publish
// panics (Caddy recovers handler panics), so that retries are not left
// waiting on an entry that never settles.
func (o *Idempotency) run(e *onceEntry, publish func() ([]byte, error)) (reply []byte, replayed bool, err error) {
	settled := false
	defer func() {
		if !settled {
			o.settle(e, nil, errors.New("publish panicked"))
		}
	}()
	reply, err = publish()
	o.settle(e, reply, err)
	settled = true
	return reply, false, err
}

func (o *Idempotency) claim(key, fingerprint string) (*onceEntry, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	now := o.now()
	o.expire(now)
	if e := o.entries[key]; e != nil {
		return e, false
	}
	e := &onceEntry{key: key, fingerprint: fingerprint, done: make(chan struct{}), expires: now.Add(IdempotencyTTL)}
	o.entries[key] = e
	o.order = append(o.order, e)
	return e, true
}

func (o *Idempotency) settle(e *onceEntry, reply []byte, err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	e.reply, e.failed = reply, err != nil
	if e.failed && o.entries[e.key] == e {
		delete(o.entries, e.key)
	}
	close(e.done)
}

// expire drops expired entries, and the oldest ones beyond the size bound.
func (o *Idempotency) expire(now time.Time) {
	n := 0
	for ; n < len(o.order); n++ {
		e := o.order[n]
		if now.Before(e.expires) && len(o.order)-n <= maxIdempotencyEntries {
			break
		}
		if o.entries[e.key] == e {
			delete(o.entries, e.key)
		}
		o.order[n] = nil
	}
	o.order = o.order[n:]
}
