package caddysse

import (
	"context"
	"math/rand/v2"
	"sync"
	"time"

	"go.uber.org/zap"
)

// registry keeps a handler's open streams: to send them heartbeats and to
// end those whose queue stayed full too long, from one shared ticker (no
// timer or goroutine per stream), and to close them all when the config
// stops.
type registry struct {
	logger    *zap.Logger
	heartbeat time.Duration
	jitter    time.Duration
	slow      time.Duration

	mu      sync.Mutex
	streams map[*stream]int64 // Unix nanoseconds each was added
	closed  string            // the reason, once closing has begun
	closing chan struct{}     // closed when closing begins
	// reads is canceled once closing has begun (after every stream was
	// told): history reads of its streams stop then (see stream.readHistory)
	reads     context.Context
	stopReads context.CancelFunc
	ticking   bool
	done      chan struct{}
	stopped   bool
}

func newRegistry(logger *zap.Logger, heartbeat, jitter, slow time.Duration) *registry {
	reads, stopReads := context.WithCancel(context.Background())
	return &registry{
		reads:     reads,
		stopReads: stopReads,
		logger:    logger,
		heartbeat: heartbeat,
		jitter:    jitter,
		slow:      slow,
		streams:   make(map[*stream]int64),
		closing:   make(chan struct{}),
		done:      make(chan struct{}),
	}
}

// add registers a stream. A stream that opens after closing has begun is
// told to close at once. The ticker starts with the first stream, so that
// loading (or validating) a config starts no goroutine.
func (r *registry) add(s *stream) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.streams[s] = time.Now().UnixNano()
	if r.closed != "" {
		s.close(r.notice(r.closed, r.jitter))
		return
	}
	if !r.ticking && (r.heartbeat > 0 || r.slow > 0) && !r.stopped {
		r.ticking = true
		go r.tick()
	}
}

func (r *registry) remove(s *stream) {
	r.mu.Lock()
	delete(r.streams, s)
	r.mu.Unlock()
}

// count returns how many streams are open.
func (r *registry) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.streams)
}

// closeAll tells every stream to send server_closing and end, each with a
// reconnection delay drawn at random within the jitter so that clients do
// not all come back at once. Streams opened later are told at once.
func (r *registry) closeAll(reason string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed != "" {
		return
	}
	r.closed = reason
	close(r.closing)
	for s := range r.streams {
		s.close(r.notice(reason, r.jitter))
	}
	r.stopReads()
	if n := len(r.streams); n > 0 {
		r.logger.Info("closing streams", zap.String("reason", reason), zap.Int("streams", n), zap.Duration("close_jitter", r.jitter))
	}
}

// awaitClosing waits, for at most timeout, until closeAll has been called
// (by the server's shutdown hook) if any stream is open.
func (r *registry) awaitClosing(timeout time.Duration) {
	if r.count() == 0 {
		return
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-r.closing:
	case <-t.C:
	}
}

// closingNotice is the notice a stream opening now would be told, or nil
// if closing has not begun. Such a request reached the config on its way
// out (the old listening socket is closed a moment after the reload's
// new config serves): one of a few, not the wave of streams the jitter
// spreads. On a reload it is told to come back within lateArrivalJitter,
// as the new config already serves (a page opened during a reload waited
// up to close_jitter, 5 s by default, for its stream); on a shutdown
// within the jitter, as the streams were: nothing serves until the next
// process does.
func (r *registry) closingNotice() *closeNotice {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed == "" {
		return nil
	}
	within := r.jitter
	if r.closed == reasonReload {
		within = min(within, lateArrivalJitter)
	}
	return r.notice(r.closed, within)
}

// lateArrivalJitter bounds the retry of a request that reaches a config a
// reload replaced (closingNotice).
const lateArrivalJitter = time.Second

// notice is a server_closing for reason whose retry is drawn within
// the bound within (none if 0).
func (r *registry) notice(reason string, within time.Duration) *closeNotice {
	n := &closeNotice{reason: reason}
	if within > 0 {
		n.retry = rand.N(within + 1)
	}
	return n
}

// stop ends the heartbeat ticker.
func (r *registry) stop() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.stopped {
		r.stopped = true
		close(r.done)
	}
}

// tick visits the streams periodically: see sweep. It runs at a quarter of
// the shorter of the heartbeat interval and the slow-client timeout, so
// a slow client is acted on at most a quarter late, and a heartbeat at
// most a quarter early (never late: see sweep).
func (r *registry) tick() {
	t := time.NewTicker(r.tickInterval())
	defer t.Stop()
	for {
		select {
		case now := <-t.C:
			r.sweep(now)
		case <-r.done:
			return
		}
	}
}

func (r *registry) tickInterval() time.Duration {
	every := r.slow
	if r.heartbeat > 0 && (every <= 0 || r.heartbeat < every) {
		every = r.heartbeat
	}
	return max(every/4, 10*time.Millisecond)
}

// sweep ends slow clients' streams (SPEC S7): it tells those whose queue
// has stayed full for the slow-client timeout, or whose socket took nothing
// for that long (taken over), to close, and cuts a net/http write or flush
// in flight for that long (it fails as a slow client's). It marks the
// streams that would be silent for a heartbeat interval before the next
// sweep and wakes them; each writes its heartbeat itself. (Marking only
// those silent for the interval already would have every idle stream
// silent for the interval plus a tick: a heartbeat written just after one
// sweep is not quite an interval old four sweeps later.) A queue that
// overflowed before its stream could write (while its history was read)
// counts from when the stream was added.
func (r *registry) sweep(now time.Time) {
	due := now.Add(r.tickInterval() - r.heartbeat).UnixNano()
	stuck := now.Add(-r.slow).UnixNano()
	stuckCall := monoNanos() - int64(r.slow)
	r.mu.Lock()
	defer r.mu.Unlock()
	for s, added := range r.streams {
		if since := s.overflowSince.Load(); r.slow > 0 && since != 0 && max(since, added) <= stuck {
			s.close(slowClient)
			continue
		}
		if sw := s.net.Load(); sw != nil && r.slow > 0 && sw.cutIfBlocked(stuckCall) {
			continue // its write fails as a slow client's: the stream ends
		}
		if tk := s.tk.Load(); tk != nil && r.slow > 0 {
			if since := tk.blockedSince(); since != 0 && since <= stuck {
				s.close(slowClient) // its socket took nothing for the timeout
				continue
			}
		}
		if s.degraded.Load() && s.h.hub.Available() {
			s.poke() // its backend answers again: it can replay now
		}
		if r.heartbeat > 0 && s.lastWrite.Load() <= due {
			s.beatDue.Store(true)
			s.poke()
		}
	}
}

// takenOverGrace bounds how long stopping waits for taken-over streams to
// be told server_closing.
const takenOverGrace = 3 * time.Second

// shutdownHookWait bounds how long Cleanup waits for the server's shutdown
// hook to tell the streams (registry.awaitClosing): it runs microseconds
// after Caddy starts the shutdown, so this is only a bound.
const shutdownHookWait = time.Second

// waitTakenOver waits, at most timeout, until no stream of the registry is
// written by an event loop (takeover) any more.
func (r *registry) waitTakenOver(timeout time.Duration) {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if r.takenOver() == 0 {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (r *registry) takenOver() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for s := range r.streams {
		if s.tk.Load() != nil {
			n++
		}
	}
	return n
}
