package pubsub

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// IdempotencyStore runs a publish once per Idempotency-Key (SPEC S6).
type IdempotencyStore interface {
	Do(ctx context.Context, key, fingerprint string, publish func() ([]byte, error)) (reply []byte, replayed bool, err error)
}

// RedisIdempotency keeps Idempotency-Key replies in Redis, so that a retry
// that a load balancer sends to another instance still gets the first
// reply. The key "<prefix>idem:{<key>}" holds "p:<fingerprint>:<claim>"
// while the first request publishes (renewed while it does, so that it
// lapses within idemPendingTTL only if its instance dies), then
// "d:<fingerprint>:<reply>" for IdempotencyTTL. While Redis is
// unreachable it falls back to this instance's memory (logged): publishing
// then fails anyway unless fallback local is on.
type RedisIdempotency struct {
	b          *Redis
	local      *Idempotency
	pendingTTL time.Duration // idemPendingTTL; shorter in tests
}

const (
	idemPendingTTL = 30 * time.Second
	idemPoll       = 20 * time.Millisecond
)

// releaseIfPending deletes a pending claim that is still ours.
var releaseIfPending = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0`)

// renewIfPending extends a pending claim that is still ours.
var renewIfPending = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0`)

// settleIfPending replaces a pending claim that is still ours (or that
// lapsed, with nobody else's in its place) with the reply: a claim that
// lapsed and was taken by a retry is that retry's to settle.
var settleIfPending = redis.NewScript(`
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] or not v then redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) return 1 end
return 0`)

// NewRedisIdempotency returns a store in b's Redis.
func NewRedisIdempotency(b *Redis) *RedisIdempotency {
	return &RedisIdempotency{b: b, local: NewIdempotency(), pendingTTL: idemPendingTTL}
}

// Do publishes once per key across every instance sharing the Redis.
func (r *RedisIdempotency) Do(ctx context.Context, key, fingerprint string, publish func() ([]byte, error)) ([]byte, bool, error) {
	// a reply this instance holds: kept when it was settled in Redis, or
	// of a publish made while Redis was unreachable (fallback local), which
	// Redis never heard of and would let a retry publish again
	if reply, found, err := r.local.settledReply(ctx, key, fingerprint); found || err != nil {
		return reply, found, err
	}
	rkey := r.b.opts.Prefix + "idem:{" + key + "}"
	// the claim's own token tells this request's claim from a retry's
	pending := "p:" + fingerprint + ":" + strconv.FormatUint(rand.Uint64(), 36)
	for {
		var claimed bool
		sent := false
		err := ErrUnavailable // known not to answer: do not wait for it (redis_probe.go)
		if r.b.reachable(ctx, rkey) {
			sent = true
			claimed, err = r.b.client.SetNX(ctx, rkey, pending, r.pendingTTL).Result()
		}
		if err != nil && sent && !isAnswer(err) {
			// the claim was sent and got no answer: Redis may have run it,
			// or run it yet (a copy in a socket it has not read, go-redis'
			// retries), and nobody would own it: every retry with the key
			// would wait for it to lapse. Give it up once Redis answers.
			r.disown(rkey, pending)
		}
		if err != nil {
			if isUnavailable(err) {
				// per keyed publish while Redis is down: warned of rarely
				r.b.idemFallback.Log(r.b.log(), rareWarningEvery, "idempotency keys fall back to this instance: redis is unreachable", zap.Error(err))
				return r.local.Do(ctx, key, fingerprint, publish)
			}
			return nil, false, err
		}
		if claimed {
			return r.publishClaimed(ctx, key, rkey, pending, fingerprint, publish)
		}
		reply, done, ours, err := r.lookup(ctx, rkey, fingerprint, pending)
		switch {
		case ours:
			return r.publishClaimed(ctx, key, rkey, pending, fingerprint, publish)
		case err != nil || done:
			return reply, done, err
		}
		select { // another request is publishing with this key: wait for it
		case <-time.After(idemPoll):
		case <-ctx.Done():
			return nil, false, ctx.Err()
		}
	}
}

func (r *RedisIdempotency) publishClaimed(ctx context.Context, key, rkey, pending, fingerprint string, publish func() ([]byte, error)) (reply []byte, replayed bool, err error) {
	settled := false
	defer func() {
		if !settled { // failed or panicked: let a retry publish
			if err := releaseIfPending.Run(context.WithoutCancel(ctx), r.b.client, []string{rkey}, pending).Err(); err != nil {
				// Redis went away with the publish: a claim left in place
				// would hold every retry until it lapsed
				r.disown(rkey, pending)
			}
		}
	}()
	reply, err = r.publishKeepingClaim(ctx, rkey, pending, publish)
	if err != nil {
		return nil, false, err
	}
	err = settleIfPending.Run(context.WithoutCancel(ctx), r.b.client, []string{rkey}, pending,
		"d:"+fingerprint+":"+string(reply), IdempotencyTTL.Milliseconds()).Err()
	if err != nil && !isAnswer(err) {
		// the claim, no longer renewed, would hold retries on other
		// instances until it lapsed: they publish with the same token, and
		// get this publish's ids
		r.disown(rkey, pending)
	}
	if err != nil {
		r.b.log().Warn("could not keep an idempotency reply", zap.Error(err))
	}
	// and in memory: a retry that comes while Redis is unreachable (the
	// reply was lost, then Redis went away) replays it instead of
	// publishing again on the local fallback
	_, _, _ = r.local.Do(context.WithoutCancel(ctx), key, fingerprint, func() ([]byte, error) { return reply, nil })
	settled = true
	return reply, false, nil
}

// isAnswer reports whether err is Redis' answer to a command (which then
// ran or was refused), not a failure to hear one.
func isAnswer(err error) bool {
	var rerr redis.Error
	return errors.As(err, &rerr)
}

// disown removes this request's claim of rkey (pending), in the
// background, if it is in Redis or shows up there: a claim whose SET got no
// answer, or whose publish failed while Redis was away, has nobody to
// renew, settle or release it, and would hold every retry with the key
// until it lapsed (pendingTTL). It tries until Redis answers and then for
// a pendingTTL more, as copies of the SET that Redis has not read yet may
// still run; it stops when the broker closes.
func (r *RedisIdempotency) disown(rkey, pending string) {
	go func() {
		wait := idemPoll
		var until time.Time
		for until.IsZero() || time.Now().Before(until) {
			select {
			case <-time.After(wait):
			case <-r.b.quit:
				return
			}
			wait = min(2*wait, time.Second)
			err := releaseIfPending.Run(context.Background(), r.b.client, []string{rkey}, pending).Err()
			if until.IsZero() && (err == nil || isAnswer(err)) {
				until = time.Now().Add(r.pendingTTL)
			}
		}
	}()
}

// publishKeepingClaim runs publish while renewing the claim, and stops the
// renewals when it returns or panics (Caddy recovers a handler's panic:
// they went on for the life of the process).
func (r *RedisIdempotency) publishKeepingClaim(ctx context.Context, rkey, pending string, publish func() ([]byte, error)) ([]byte, error) {
	defer r.keepClaim(ctx, rkey, pending)()
	return publish()
}

// keepClaim renews the pending claim while the publish runs, which may take
// longer than the claim's ttl (wait_replicas, retries): a claim that lapsed
// meanwhile would let a retry publish a second time. The returned stop ends
// the renewals.
func (r *RedisIdempotency) keepClaim(ctx context.Context, rkey, pending string) (stop func()) {
	done := make(chan struct{})
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		tick := time.NewTicker(r.pendingTTL / 3)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
				_ = renewIfPending.Run(context.WithoutCancel(ctx), r.b.client, []string{rkey}, pending, r.pendingTTL.Milliseconds()).Err()
			}
		}
	}()
	return func() {
		close(done)
		<-finished
	}
}

// lookup reads a key's state: the reply if it is done, ErrKeyReused if it
// belongs to another request, ours if it holds this request's own claim
// (go-redis sends the SET NX again when the reply of its first run is
// lost, and the second run finds the key taken by the first).
func (r *RedisIdempotency) lookup(ctx context.Context, rkey, fingerprint, pending string) (reply []byte, done, ours bool, err error) {
	val, err := r.b.client.Get(ctx, rkey).Result()
	switch {
	case errors.Is(err, redis.Nil):
		return nil, false, false, nil // gone meanwhile: claim again
	case err != nil:
		return nil, false, false, err
	case val == pending:
		return nil, false, true, nil
	}
	state, rest, _ := strings.Cut(val, ":")
	fp, kept, _ := strings.Cut(rest, ":")
	if fp != fingerprint {
		return nil, false, false, ErrKeyReused
	}
	if state == "d" {
		return []byte(kept), true, false, nil
	}
	return nil, false, false, nil
}

// Interface guards
var (
	_ IdempotencyStore = (*RedisIdempotency)(nil)
	_ IdempotencyStore = (*Idempotency)(nil)
)
