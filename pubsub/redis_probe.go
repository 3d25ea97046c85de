package pubsub

import (
	"context"
	"errors"
	"sync"
	"time"
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

// probes runs one probe of Redis at a time.
type probes struct {
	mu      sync.Mutex
	running *probe
}

type probe struct {
	started time.Time
	done    chan struct{}
	ok      bool
}

// reachable reports whether a publish to key should be sent to Redis: at
// once while Redis is up; while it is down, if a probe gets an answer
// within probeWait (the probe under way, or a new one).
func (b *Redis) reachable(ctx context.Context, key string) bool {
	if b.up.Load() {
		return true
	}
	p := b.probes.start(func() bool { return b.ping(key) })
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

// start returns the probe under way, or starts one that runs ping.
func (ps *probes) start(ping func() bool) *probe {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if ps.running != nil {
		return ps.running
	}
	p := &probe{started: time.Now(), done: make(chan struct{})}
	ps.running = p
	go func() {
		p.ok = ping()
		ps.mu.Lock()
		ps.running = nil
		ps.mu.Unlock()
		close(p.done)
	}()
	return p
}

// ping asks the primary of key for a PONG, within one read timeout (no
// retry cycle), and records whether Redis answered.
func (b *Redis) ping(key string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), b.opts.attemptTimeout())
	defer cancel()
	node, err := b.nodeFor(ctx, key)
	if err == nil {
		err = node.Ping(ctx).Err()
	}
	return b.classify(err) == nil
}

// errStalled is why a publish call marked Redis down before go-redis gave up.
var errStalled = errors.New("a publish got no answer within read_timeout")

// watchStall marks Redis down if the call that it is called for takes
// longer than one attempt may: stop ends the watch.
func (b *Redis) watchStall() (stop func()) {
	limit := b.opts.readTimeout()
	if limit <= 0 {
		return func() {}
	}
	t := time.AfterFunc(limit, func() { b.setUp(false, errStalled) })
	return func() { t.Stop() }
}
