package pubsub

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// Publishing fails fast while Redis is known not to answer. Without this,
// every publish into a hung Redis (a partition, a stopped primary) waited
// for go-redis' whole retry cycle, (max_retries + 1) read timeouts, for each
// of its channels, and with fallback local as without.
//
//   - A publish call that has not been answered within read_timeout (its
//     first attempt timed out: go-redis is retrying) marks Redis down at
//     once, so that the publishes that follow do not each wait for a cycle.
//     The call itself still waits for its retries, so that it answers with
//     the event's id when one succeeds.
//   - While Redis is down, a publish does not send its call: it waits at
//     most probeWait for a probe (a PING to the channel's primary, one at a
//     time, each bounded by read_timeout) and sends the call only if the
//     probe got an answer; else it fails at once with ErrUnavailable (or
//     falls back to this instance). Any answer from Redis, to the probe or
//     to another command, marks it up again.

// probeWait is the longest a publish waits for a probe while Redis is down.
const probeWait = 100 * time.Millisecond

// probes runs one probe of each Redis node at a time.
type probes struct {
	mu      sync.Mutex
	running map[string]*probe // by node address
}

type probe struct {
	started time.Time
	done    chan struct{}
	ok      bool
}

// reachable reports whether a publish to key should be sent to Redis: at
// once while Redis is up; while it is down, if a probe of the node that
// serves key gets an answer within probeWait (the probe of that node under
// way, or a new one). Probes are per node: in a cluster whose one primary
// hangs, a publish to another primary is not failed by that one's probe.
func (b *Redis) reachable(ctx context.Context, key string) bool {
	if b.up.Load() {
		return true
	}
	node, err := b.nodeFor(ctx, key)
	if err != nil {
		return false
	}
	p := b.probes.start(node.Options().Addr, func() bool { return b.ping(node) })
	wait := probeWait - time.Since(p.started)
	if wait <= 0 {
		return false
	}
	timer := time.NewTimer(wait)
	defer timer.Stop()
	select {
	case <-p.done:
		return p.ok
	case <-timer.C:
		return false
	case <-ctx.Done():
		return false
	}
}

// admissionCall prepares a call that opening a stream waits for (its
// lease, its throttle): none while Redis is known down and no probe answers
// (the caller fails open at once, as a publish fails fast), and otherwise
// at most one read timeout, not go-redis' whole retry cycle: a connect
// must not wait 20 s for a hung Redis to admit it anyway.
func (b *Redis) admissionCall(ctx context.Context, key string) (context.Context, context.CancelFunc, error) {
	if !b.reachable(ctx, key) {
		return ctx, func() {}, ErrUnavailable
	}
	limit := b.opts.readTimeout()
	if limit <= 0 {
		limit = admissionCallTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, limit)
	return ctx, cancel, nil
}

// admissionCallTimeout bounds an admission call when reads have no timeout.
const admissionCallTimeout = 3 * time.Second

// start returns the probe of addr under way, or starts one that runs ping.
func (ps *probes) start(addr string, ping func() bool) *probe {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if p := ps.running[addr]; p != nil {
		return p
	}
	if ps.running == nil {
		ps.running = make(map[string]*probe)
	}
	p := &probe{started: time.Now(), done: make(chan struct{})}
	ps.running[addr] = p
	go func() {
		p.ok = ping()
		ps.mu.Lock()
		delete(ps.running, addr)
		ps.mu.Unlock()
		close(p.done)
	}()
	return p
}

// ping asks node for a PONG, within one read timeout (no retry cycle), and
// records whether Redis answered: any reply but one that says it cannot
// serve (LOADING and the like) is an answer, a NOPERM to a user without
// +ping too.
func (b *Redis) ping(node *redis.Client) bool {
	ctx, cancel := context.WithTimeout(context.Background(), b.opts.attemptTimeout())
	defer cancel()
	err := b.classify(node.Ping(ctx).Err())
	var reply redis.Error
	return err == nil || errors.As(err, &reply) && !errors.Is(err, ErrUnavailable)
}

// errStalled is why a publish call marked Redis down before go-redis gave up.
var errStalled = errors.New("a publish got no answer within read_timeout")

// watchStall marks Redis down if the call that it is called for takes
// longer than one attempt may. stop ends the watch with the call's error:
// if the watch fired although the call was answered (it may fire between
// the answer, which marks Redis up, and stop), Redis is marked up again.
func (b *Redis) watchStall() (stop func(err error)) {
	limit := b.opts.readTimeout()
	if limit <= 0 {
		return func(error) {}
	}
	const waiting, done, stalled = 0, 1, 2
	var state atomic.Int32
	t := time.AfterFunc(limit, func() {
		if state.CompareAndSwap(waiting, stalled) {
			b.setUp(false, errStalled)
		}
	})
	return func(err error) {
		t.Stop()
		var reply redis.Error
		answered := err == nil || errors.As(err, &reply)
		if !state.CompareAndSwap(waiting, done) && answered {
			b.setUp(true, nil)
		}
	}
}
