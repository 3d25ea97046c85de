package pubsub

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// RedisLeases cap a principal's streams across every instance sharing the
// Redis (SPEC S10). A principal's leases are the members of the sorted set
// "<prefix>lease:{<principal>}", scored by when they lapse. Acquire is one
// script: drop the lapsed members, count, add if under the limit. Each
// instance renews all of its leases in one batch every third of their ttl
// (never from stream traffic), so the leases of an instance that dies lapse
// within ttl. Releases are batched in the background, so Release never
// blocks a stream.
type RedisLeases struct {
	b        *Redis
	instance string
	seq      atomic.Uint64

	mu       sync.Mutex
	held     map[*redisLease]struct{}
	heldBy   map[string][]*redisLease // held, by key: Acquire puts them back if Redis lost them
	released leaseSet
	removing leaseSet // released ones that flushReleases is removing now
	// removingSince is when the removal under way began (zero if none):
	// one under way for longer than lateRemoval is taken for stuck
	removingSince time.Time
	ttl           time.Duration // the shortest ttl held (asked for, until a renewal): a third of it is the renewal period
	running       bool
	wake          chan struct{}
	stop          chan struct{}
	done          chan struct{}
	closed        bool
	// calls counts the Acquires under way (added to under mu while not
	// closed): Close waits for them, since each may have taken a lease in
	// Redis that only this instance knows to remove
	calls sync.WaitGroup
}

type redisLease struct {
	of        *RedisLeases
	key       string
	member    string
	ttl       time.Duration
	principal string
	at        int // its index in heldBy[key], while held; under of.mu
	// listed counts the Acquires under way that sent it to be put back if
	// Redis lost it (leasesOf); under of.mu. Released meanwhile, it may be
	// put back after its removal: it is not taken for removed until they
	// are done and it was removed once more (releaseAgain).
	listed int
	queued bool // in of.released, to be removed by the next flush; under of.mu
	once   sync.Once
	// then is called once its release has been flushed (ReleaseThen), and
	// flushed is set then; both under of.mu
	then    func()
	flushed bool
}

// acquireLease takes a lease (ARGV[3]) unless limit (ARGV[1]) are held. Leases of
// the key this instance holds that Redis lost (a restart without
// persistence, a failover that lost writes) are put back before counting,
// or this instance would let the principal past its cap until its next
// renewal put them back beside the new ones. Sending every lease held
// with every Acquire cost O(held) per stream (O(n²) for a principal with
// thousands of streams: Redis and the instance's lock saturated at a few
// thousand), so a call sends only the newest few as a sample (a failover
// loses the latest writes): ARGV[6] of them follow, as member and ttl
// pairs. When the set is gone (a restart, an eviction), or the sample had
// to be put back (Redis lost leases, maybe more than the sample), while
// this instance holds more than the sample (ARGV[4]), the script answers
// -1 and the call is made again with all of them (ARGV[5] = 1). Only the
// first Acquire after a loss pays for that: it puts the sample back, so
// the next ones find it. The rest of ARGV are leases of the key this instance
// released and has not removed yet. A call that finds its own lease in the
// set ran before: go-redis sent it again after its reply was lost (a
// dropped connection); it is granted again, not counted against itself.
// The key's expiry is never brought closer (NX sets it on a new key, GT
// only lengthens it): a principal's set holds the leases of every instance
// and route, whose lease_ttl may be longer than this one's (a rolling
// change of the setting). Redis 7.0 has both options.
//
// Leases are scored, and found lapsed, by Redis' clock (leaseNow), never
// an instance's: instances do not share a clock, and one whose clock was
// ahead of another's by two thirds of a ttl (10 s by default) found that
// one's live leases lapsed and dropped them, letting a principal past its
// cap; a lease of one whose clock was ahead outlived its instance by as
// much.
var acquireLease = redis.NewScript(leaseNow + `
local listed = tonumber(ARGV[6])
if ARGV[5] ~= '1' and listed < tonumber(ARGV[4]) and redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local last = 6 + 2 * listed
local lost = 0
for i = 7, last, 2 do lost = lost + redis.call('ZADD', KEYS[1], 'NX', now + tonumber(ARGV[i + 1]), ARGV[i]) end
if ARGV[5] ~= '1' and lost > 0 and listed < tonumber(ARGV[4]) then return -1 end
for i = last + 1, #ARGV do redis.call('ZREM', KEYS[1], ARGV[i]) end
local limit = tonumber(ARGV[1])
if limit > 0 and redis.call('ZCARD', KEYS[1]) >= limit and not redis.call('ZSCORE', KEYS[1], ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * 2, 'NX')
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]) * 2, 'GT')
return 1`)

// leaseNow starts the lease scripts: now is Redis' clock, in ms.
const leaseNow = `
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
`

// renewLeases scores the leases of a key (ARGV: member and ttl pairs) to
// lapse a ttl from now, putting back those Redis lost (a restart without
// persistence, a failover that lost writes, an outage longer than the
// ttl: their streams would go uncounted for good), and sets the key's
// expiry to twice the longest ttl unless it lasts longer (as acquireLease).
var renewLeases = redis.NewScript(leaseNow + `
local longest = 0
for i = 1, #ARGV, 2 do
  local ttl = tonumber(ARGV[i + 1])
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[i])
  if ttl > longest then longest = ttl end
end
redis.call('PEXPIRE', KEYS[1], 2 * longest, 'NX')
redis.call('PEXPIRE', KEYS[1], 2 * longest, 'GT')
return 1`)

// countLeases counts the live leases of a key, less those of its members
// in ARGV (released by the caller, not yet removed).
var countLeases = redis.NewScript(leaseNow + `
local n = redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
for i = 1, #ARGV do
  local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if score and tonumber(score) > now then n = n - 1 end
end
if n < 0 then n = 0 end
return n`)

// maxAcquireTries bounds how often an Acquire refused while leases it put
// back were released is made again.
const maxAcquireTries = 3

// leaseSample is how many of the newest leases of a key held here an
// Acquire puts back if Redis lost them.
const leaseSample = 16

// leaseSet holds leases by key.
type leaseSet map[string][]*redisLease

// add adds l to the set (r.released, under r.mu).
func (ls leaseSet) add(l *redisLease) {
	ls[l.key] = append(ls[l.key], l)
	l.queued = true
}

// NewRedisLeases returns leases in b's Redis.
func NewRedisLeases(b *Redis) *RedisLeases {
	return &RedisLeases{
		b:        b,
		instance: strconv.FormatUint(rand.Uint64(), 36),
		held:     make(map[*redisLease]struct{}),
		heldBy:   make(map[string][]*redisLease),
		released: leaseSet{},
		wake:     make(chan struct{}, 1),
		stop:     make(chan struct{}),
		done:     make(chan struct{}),
	}
}

func (r *RedisLeases) key(principal string) string {
	return r.b.opts.Prefix + "lease:{" + principal + "}"
}

// Acquire takes a lease for principal unless its streams across every
// instance already hold limit. An unreachable Redis returns ErrUnavailable:
// the caller decides to fail open.
func (r *RedisLeases) Acquire(ctx context.Context, principal string, limit int, ttl time.Duration) (Lease, error) {
	if ttl <= 0 {
		ttl = 15 * time.Second
	}
	l := &redisLease{of: r, key: r.key(principal), principal: principal, ttl: ttl,
		member: r.instance + ":" + strconv.FormatUint(r.seq.Add(1), 36)}
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil, ErrClosed // a lease taken now would have nobody to remove it
	}
	r.calls.Add(1)
	r.mu.Unlock()
	defer r.calls.Done()
	ctx, cancel, err := r.b.admissionCall(ctx, l.key)
	defer cancel()
	if err != nil {
		return nil, err
	}
	var ok int
	all := false
	for tries := 0; ; tries++ {
		var putBackReleased bool
		ok, putBackReleased, err = r.runAcquire(ctx, l, limit, all)
		switch {
		case err != nil:
		case ok < 0 && !all: // Redis lost some of the leases held here
			all = true
			continue
		case ok == 0 && putBackReleased && tries < maxAcquireTries:
			// a lease it sent to be put back was released meanwhile, maybe
			// removed before the call ran: it was put back and counted. Once
			// more: it is among the released ones now, which a call removes
			all = false
			continue
		}
		break
	}
	if err != nil {
		// Redis may have run the call whose reply never came (a timeout, a
		// dropped connection, the client gone): its lease, which no stream
		// holds, would count against the principal for its ttl
		// (once the leases are closed, Close removes it: it waits for this
		// call)
		r.mu.Lock()
		r.released.add(l)
		if !r.closed {
			r.maintainLocked(ttl)
		}
		r.mu.Unlock()
		r.poke()
		return nil, r.b.classify(err)
	}
	if ok <= 0 {
		return nil, ErrLimitReached
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		// the leases closed while the call ran (a reload replaced the hub
		// while a stream opened): the lease is in Redis, and no stream will
		// hold it. Close, which waits for this call, removes it; dropped, it
		// would count against the principal on every instance until it
		// lapsed
		r.released.add(l)
		return nil, ErrClosed
	}
	r.held[l] = struct{}{}
	l.at = len(r.heldBy[l.key])
	r.heldBy[l.key] = append(r.heldBy[l.key], l)
	r.maintainLocked(ttl)
	return l, nil
}

// maintainLocked has maintain run, at the pace of leases of ttl; r.mu is
// held.
func (r *RedisLeases) maintainLocked(ttl time.Duration) {
	if r.ttl == 0 || ttl < r.ttl {
		r.ttl = ttl
		r.poke() // its renewal may be due sooner than the loop waits
	}
	if !r.running {
		r.running = true
		go r.maintain(r.b.returns.Load())
	}
}

// runAcquire runs acquireLease for l: with the newest leases of its key
// held here, or, all, with all of them. It reports whether some of those
// it put back were released meanwhile (see releaseAgain).
func (r *RedisLeases) runAcquire(ctx context.Context, l *redisLease, limit int, all bool) (int, bool, error) {
	n, listed, released := r.leasesOf(l.key, all)
	flag := 0
	if all {
		flag = 1
	}
	args := make([]any, 0, 7+2*len(listed)+len(released))
	args = append(args, limit, l.ttl.Milliseconds(), l.member, n, flag, len(listed))
	for _, h := range listed {
		args = append(args, h.member, h.ttl.Milliseconds())
	}
	args = append(args, released...)
	ok, err := acquireLease.Run(ctx, r.b.client, []string{l.key}, args...).Int()
	again := r.releaseAgain(listed)
	return ok, again, err
}

// leasesOf returns, at one moment, how many leases of key are held here,
// the newest leaseSample of them (all of them if all), and the members of
// those released here and not yet removed from Redis (maintain removes
// them soon, in the background). An Acquire removes the released ones
// first, so that a stream that reconnects at once (a reload's
// server_closing with retry 0) is not refused by the lease of the stream
// it replaces. They stay in released: a renewal under way may put one back,
// and maintain removes it again then.
func (r *RedisLeases) leasesOf(key string, all bool) (n int, listed []*redisLease, released []any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	held := r.heldBy[key]
	if !all && len(held) > leaseSample {
		held = held[len(held)-leaseSample:]
	}
	listed = slices.Clone(held)
	for _, h := range listed {
		h.listed++
	}
	// the newest released only, as of the held: a stream that reconnects
	// at once follows the newest release, and the others are removed by
	// maintain anyway (all of them made each Acquire O(releases pending),
	// which, under a burst, grew faster than maintain could remove them)
	for _, ls := range []leaseSet{r.released, r.removing} {
		of := ls[key]
		for i := len(of) - 1; i >= 0 && len(released) < leaseSample; i-- {
			released = append(released, of[i].member)
		}
	}
	return len(r.heldBy[key]), listed, released
}

// releaseAgain has maintain remove, once more, those of the leases an
// Acquire put back that were released meanwhile: their removal may have
// run before the Acquire did. It reports whether there were any.
func (r *RedisLeases) releaseAgain(putBack []*redisLease) bool {
	r.mu.Lock()
	again := false
	for _, l := range putBack {
		l.listed--
		if _, still := r.held[l]; !still {
			r.released.add(l)
			again = true
		}
	}
	r.mu.Unlock()
	if again {
		r.poke()
	}
	return again
}

// Release gives the lease back (in the background).
func (l *redisLease) Release() {
	l.once.Do(func() {
		r := l.of
		r.mu.Lock()
		_, held := r.held[l]
		if !held { // Close released it already
			r.mu.Unlock()
			return
		}
		delete(r.held, l)
		r.forgetHeld(l)
		r.released.add(l)
		r.mu.Unlock()
		r.poke()
	})
}

// lateRemoval is how long a removal of released leases may be under way
// before ReleaseThen stops making its callers wait for the next one: Redis
// hangs or is far away, and a stop must stay prompt (the leases lapse
// within their ttl then).
const lateRemoval = 500 * time.Millisecond

// ReleaseThen releases the lease and calls then once its removal from
// Redis has been tried (see ReleaseNotifier), or at once if a removal
// under way is late.
func (l *redisLease) ReleaseThen(then func()) {
	r := l.of
	r.mu.Lock()
	done := l.flushed || (!r.removingSince.IsZero() && time.Since(r.removingSince) > lateRemoval)
	if !done {
		l.then = then
	}
	r.mu.Unlock()
	l.Release()
	if done {
		go then()
	}
}

// forgetHeld removes l from heldBy, in constant time (a principal may hold
// thousands); r.mu is held.
func (r *RedisLeases) forgetHeld(l *redisLease) {
	ls := r.heldBy[l.key]
	if l.at >= len(ls) || ls[l.at] != l {
		return // not held (Close emptied heldBy)
	}
	last := ls[len(ls)-1]
	ls[l.at], last.at = last, l.at
	ls[len(ls)-1] = nil
	ls = ls[:len(ls)-1]
	if len(ls) == 0 {
		delete(r.heldBy, l.key)
	} else {
		r.heldBy[l.key] = ls
	}
}

// poke wakes maintain.
func (r *RedisLeases) poke() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// maintain renews the held leases every third of their ttl and removes the
// released ones as they come. The renewals keep their own clock: releases
// wake the loop far more often than a period when streams come and go, and
// must not put the renewal off (the held leases would lapse). returns is
// how often Redis had come back when it started (Redis.returns): a return
// since has it renew at once.
func (r *RedisLeases) maintain(returns uint64) {
	defer close(r.done)
	renewed := time.Now()
	timer := time.NewTimer(r.period())
	defer timer.Stop()
	for {
		// counted, not only watched: Redis may go and come back while a
		// renewal or a removal runs
		if r.b.returns.Load() == returns {
			turn := r.b.downSignal() // Redis going away, or coming back
			if !r.b.Available() {
				turn = r.b.backSignal()
			}
			select {
			case <-timer.C:
			case <-r.wake:
			case <-turn:
			case <-r.stop:
				r.flushReleases()
				return
			}
		}
		if n := r.b.returns.Load(); n != returns {
			returns = n
			// the leases Redis lost while it was away (a restart without
			// persistence, an outage past their ttl) count again now, not
			// up to a period later, while other instances admit past them
			renewed = time.Time{}
		}
		if time.Since(renewed) >= r.period() {
			// the period counts from when a renewal began: one that took
			// long (a primary hangs) does not put the next one off
			renewed = time.Now()
			r.renew()
		}
		r.flushReleases() // after renew: it may have put back a lease released meanwhile
		timer.Reset(time.Until(renewed.Add(r.period())))
	}
}

// callTimeout bounds a renewal, and a removal of released leases: about a
// period (go-redis ends a call at the first retry past it, after one
// read_timeout), so that a primary of a cluster that hangs holds maintain
// up briefly, and the leases of those that answer (renewed by the same
// pipeline) are renewed again within their ttl. A renewal waited for the
// hung primary through go-redis' retries, up to 10 s, and the next one
// came a period after that: the other primaries' leases lapsed, and their
// principals were let past their caps while Redis answered for them.
func (r *RedisLeases) callTimeout() time.Duration {
	return max(r.period(), 100*time.Millisecond)
}

// period is how often the leases are renewed.
func (r *RedisLeases) period() time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	return max(r.ttl/3, 10*time.Millisecond)
}

func (r *RedisLeases) renew() {
	r.mu.Lock()
	leases := make([]*redisLease, 0, len(r.held))
	shortest := time.Duration(0)
	for l := range r.held {
		leases = append(leases, l)
		if shortest == 0 || l.ttl < shortest {
			shortest = l.ttl
		}
	}
	if shortest > 0 {
		// the period follows the leases held now: after a reload from a
		// short lease_ttl to a longer one, the old config's leases gone,
		// renewals no longer run at the short one's pace for good (an
		// Acquire of a shorter one, later, lowers it again under this lock)
		r.ttl = shortest
	}
	r.mu.Unlock()
	if len(leases) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), r.callTimeout())
	defer cancel()
	byKey := map[string][]any{}
	for _, l := range leases {
		byKey[l.key] = append(byKey[l.key], l.member, l.ttl.Milliseconds())
	}
	keys := make([]string, 0, len(byKey))
	for key := range byKey {
		keys = append(keys, key)
	}
	_, err := r.runPipelined(ctx, renewLeases, keys, func(i int) []any { return byKey[keys[i]] })
	if err != nil {
		r.b.log().Debug("renewing connection leases failed", zap.Int("leases", len(leases)), zap.Error(err))
		r.b.classify(err)
	}
}

// runPipelined runs script on each of keys, with args(i), in one
// pipeline, by digest; those that Redis answers it does not have the
// script (a restart, SCRIPT FLUSH, a new primary) are sent again with its
// source, within a callTimeout of their own: on a cluster, the first
// pipeline ends only when every primary answered, or at ctx's end if one
// hangs, and the leases on the others are still to be renewed (loading
// the script on every primary would wait for the hung one too). It
// returns each call and the first error of those that failed.
func (r *RedisLeases) runPipelined(ctx context.Context, script *redis.Script, keys []string, args func(i int) []any) ([]*redis.Cmd, error) {
	pipe := r.b.client.Pipeline()
	cmds := make([]*redis.Cmd, len(keys))
	for i, key := range keys {
		cmds[i] = script.EvalSha(ctx, pipe, []string{key}, args(i)...)
	}
	_, _ = pipe.Exec(ctx)
	if slices.ContainsFunc(cmds, isNoScript) {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.callTimeout())
		defer cancel()
		pipe := r.b.client.Pipeline()
		for i, key := range keys {
			if isNoScript(cmds[i]) {
				cmds[i] = script.Eval(ctx, pipe, []string{key}, args(i)...)
			}
		}
		_, _ = pipe.Exec(ctx)
	}
	for _, cmd := range cmds {
		if err := cmd.Err(); err != nil {
			return cmds, err
		}
	}
	return cmds, nil
}

func (r *RedisLeases) flushReleases() {
	released := r.takeReleased()
	defer r.removed()
	if len(released) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), r.callTimeout())
	defer cancel()
	pipe := r.b.client.Pipeline()
	for key, ls := range released {
		members := make([]any, len(ls))
		for i, l := range ls {
			members[i] = l.member
		}
		pipe.ZRem(ctx, key, members...)
	}
	if _, err := pipe.Exec(ctx); err != nil {
		// they lapse within their ttl anyway
		r.b.log().Debug("releasing connection leases failed", zap.Int("leases", len(released)), zap.Error(err))
	}
}

// takeReleased takes the released leases for flushReleases to remove; until
// it is done (removed), releasedOf still returns them.
func (r *RedisLeases) takeReleased() leaseSet {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.removing, r.released = r.released, leaseSet{}
	for _, ls := range r.removing {
		for _, l := range ls {
			l.queued = false
		}
	}
	if len(r.removing) > 0 {
		r.removingSince = time.Now()
	}
	return r.removing
}

// removed marks the end of flushReleases' removal, and tells those
// waiting for it (ReleaseThen).
func (r *RedisLeases) removed() {
	var thens []func()
	r.mu.Lock()
	for _, ls := range r.removing {
		for _, l := range ls {
			if l.listed > 0 || l.queued {
				// an Acquire under way may put it back, or has put it back
				// since this removal: releaseAgain has it removed again
				continue
			}
			l.flushed = true
			if l.then != nil {
				thens = append(thens, l.then)
				l.then = nil
			}
		}
	}
	r.removing, r.removingSince = nil, time.Time{}
	r.mu.Unlock()
	if len(thens) > 0 {
		go func() {
			for _, then := range thens {
				then()
			}
		}()
	}
}

// Held returns how many live leases principal holds across every instance,
// less those this instance released and has not removed yet (an Acquire
// would remove them first). It only reads, in one script (countLeases) by
// Redis' clock. An unreachable Redis returns
// ErrUnavailable at once, as Acquire does.
func (r *RedisLeases) Held(ctx context.Context, principal string) (int, error) {
	key := r.key(principal)
	ctx, cancel, err := r.b.admissionCall(ctx, key)
	defer cancel()
	if err != nil {
		return 0, err
	}
	_, _, released := r.leasesOf(key, false)
	cmds, err := r.runPipelined(ctx, countLeases, []string{key}, func(int) []any { return released })
	if err != nil {
		return 0, fmt.Errorf("counting leases: %w", r.b.classify(err))
	}
	n, _ := cmds[0].Int()
	return n, nil
}

// Counts returns how many live leases each principal holds across every
// instance.
func (r *RedisLeases) Counts(ctx context.Context, principals []string) (map[string]int, error) {
	keys := make([]string, len(principals))
	for i, p := range principals {
		keys[i] = r.key(p)
	}
	cmds, err := r.runPipelined(ctx, countLeases, keys, func(int) []any { return nil })
	if err != nil {
		return nil, fmt.Errorf("counting leases: %w", r.b.classify(err))
	}
	out := make(map[string]int, len(principals))
	for i, p := range principals {
		out[p], _ = cmds[i].Int()
	}
	return out, nil
}

// Holders returns those of principals of which this instance holds a
// lease.
func (r *RedisLeases) Holders(principals []string) []string {
	wanted := make(map[string]bool, len(principals))
	for _, p := range principals {
		wanted[p] = false
	}
	r.mu.Lock()
	for l := range r.held {
		if _, ok := wanted[l.principal]; ok {
			wanted[l.principal] = true
		}
	}
	r.mu.Unlock()
	return slices.DeleteFunc(slices.Clone(principals), func(p string) bool { return !wanted[p] })
}

// closeFlushWait bounds how long Close waits for the leases to be given
// back: a Redis that answers does it in milliseconds, and one that hangs
// must not hold a reload or the process exit (the leases lapse within
// their ttl anyway). The broker's client closes next, which ends a flush
// still waiting on it.
const closeFlushWait = time.Second

// Close releases every lease (best effort, see closeFlushWait) and stops
// the renewals. It waits, within the same bound, for the Acquires under
// way: a lease one of them took in Redis is removed with the others.
func (r *RedisLeases) Close() {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return
	}
	r.closed = true
	for l := range r.held {
		r.released.add(l)
	}
	r.held = map[*redisLease]struct{}{}
	r.heldBy = map[string][]*redisLease{}
	running := r.running // maintain cannot start once closed
	r.mu.Unlock()
	bound, cancel := context.WithTimeout(context.Background(), closeFlushWait)
	defer cancel()
	calls := make(chan struct{})
	go func() {
		r.calls.Wait()
		close(calls)
	}()
	select {
	case <-calls:
	case <-bound.Done():
		// a Redis that hangs: what those calls took lapses within its ttl
	}
	close(r.stop)
	if !running {
		go func() {
			r.flushReleases()
			close(r.done)
		}()
	}
	select {
	case <-r.done:
	case <-bound.Done():
		r.b.log().Warn("giving connection leases back takes too long; they lapse within their ttl")
	}
}

// Interface guards
var (
	_ Leases          = (*RedisLeases)(nil)
	_ LeaseCounter    = (*RedisLeases)(nil)
	_ ReleaseNotifier = (*redisLease)(nil)
)
