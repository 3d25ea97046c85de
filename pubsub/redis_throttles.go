package pubsub

import (
	"bytes"
	"context"
	"encoding/json"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-sse/caddy-sse/replay"
)

// RedisThrottles keep throttled clients in Redis, so that a slow client is
// refused by every instance: the key "<prefix>throttle:{<key>}" exists
// while it is refused.
//
// Looking the key up would cost every new stream a Redis round trip for a
// refusal that almost never applies. A hub's throttles therefore also
// announce each throttle on an internal channel that every instance
// watches (follow); once an instance has read that channel's history, it
// answers from what it was told, in memory. The channel has the guarantees
// of any other: in order, gaps repaired from its stream after a lost
// notification or a reconnect. Streams also notice a gap the watcher could
// not repair (its read failed, or a gap longer than its repair limit) and
// read the history themselves; so do the throttles: an announcement that
// does not follow the last one known makes them read the whole history
// again (applying a throttle twice changes nothing).
type RedisThrottles struct {
	b *Redis

	hub       *Hub // set by follow
	start     sync.Once
	mu        sync.Mutex
	known     *MemoryThrottles // what this instance was told
	loaded    bool             // known holds the history: Remaining needs no Redis
	last      replay.Position  // of the newest announcement known
	reloading bool             // a read of the history is under way
	ready     chan struct{}    // closed once loaded
	// offset is how far Redis' clock, which dates the announcements, is
	// ahead of this instance's (ms), as last measured (clocked) by load:
	// instances do not share a clock, and one ahead of Redis' by more than
	// a throttle took every announcement of it for over, one behind held
	// the client off for that much longer
	offset  int64
	clocked bool
	// clockEvery is how often the offset is measured again while the
	// throttles follow: a failover to a primary of another clock, or an
	// NTP step of this instance's, changes it between loads
	clockEvery time.Duration
	readyOnce  sync.Once
	stop       chan struct{}
}

// throttleChannel is the internal channel of throttle announcements. A
// comma cannot be part of a stream's channel name, so no stream can read it
// and no publish request can write it.
const throttleChannel = "sse,throttles"

// MaxRedisThrottle is the longest throttle the Redis throttles keep: their
// announcements are kept that long, and an instance that reads them later
// (it starts, or its hub is replaced) would never learn of a longer one.
const MaxRedisThrottle = 24 * time.Hour

// throttleHistory bounds the announcements kept: as many as an instance
// keeps throttles, for as long as any lasts at most (a longer throttle is
// cut to that age: Throttle).
var throttleHistory = replay.Limits{Count: maxThrottles, MaxAge: MaxRedisThrottle, MaxBytes: 32 << 20}

// NewRedisThrottles returns throttles in b's Redis.
func NewRedisThrottles(b *Redis) *RedisThrottles {
	known := NewMemoryThrottles()
	known.now = func() time.Time { return b.now() }
	return &RedisThrottles{b: b, known: known, clockEvery: time.Minute, ready: make(chan struct{}), stop: make(chan struct{})}
}

// follow makes the throttles answer from memory once they have read the
// announcements of hub's internal channel. Nothing starts before the first
// use: a configuration that is only validated does not connect.
func (r *RedisThrottles) follow(hub *Hub) {
	r.hub = hub
	r.b.onClose = append(r.b.onClose, func() { close(r.stop) })
}

// throttleAtLeast sets the key's expiry to d unless it already lasts longer.
var throttleAtLeast = redis.NewScript(`
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], '1', 'PX', ARGV[1])
end
return 1`)

func (r *RedisThrottles) key(k string) string { return r.b.opts.Prefix + "throttle:{" + k + "}" }

// announcement is the data of a throttle's event on the internal channel:
// the key is refused for ms from the event's time (Redis' clock).
type announcement struct {
	Key string `json:"k"`
	MS  int64  `json:"ms"`
}

// Throttle refuses key for d from now on every instance, at most for the
// announcements' max age: the history's reads leave older announcements
// out, so an instance that loads it after that (a start, a new hub) would
// admit the client while Redis' key still refused it.
func (r *RedisThrottles) Throttle(ctx context.Context, key string, d time.Duration) error {
	d = min(d, throttleHistory.MaxAge)
	ms := max(d.Milliseconds(), 1)
	_ = r.known.Throttle(ctx, key, d) // this instance refuses it at once
	if err := r.b.classify(throttleAtLeast.Run(ctx, r.b.client, []string{r.key(key)}, ms).Err()); err != nil {
		return err
	}
	if r.hub == nil {
		return nil
	}
	r.following()
	data, _ := json.Marshal(announcement{Key: key, MS: ms})
	_, err := r.hub.Publish(ctx, throttleChannel, Message{Type: "throttle", Data: data}, throttleHistory)
	return err
}

// Remaining returns how long key is still refused: from memory once the
// announcements are loaded; until then from what is known in memory
// already, else from Redis.
func (r *RedisThrottles) Remaining(ctx context.Context, key string) (time.Duration, error) {
	if r.hub != nil {
		r.following()
		if r.waitLoaded(ctx) {
			return r.known.Remaining(ctx, key)
		}
	}
	// not loaded yet (or the announcements do not arrive): what this
	// instance knows applies still — its own throttles, and those announced
	// so far — so that a slow client it cut while Redis is down, since the
	// start, is refused as it is once loaded; Redis is asked for the others
	if left, _ := r.known.Remaining(ctx, key); left > 0 {
		return left, nil
	}
	ctx, cancel, err := r.b.admissionCall(ctx, r.key(key))
	defer cancel()
	if err != nil {
		return 0, err
	}
	left, err := r.b.client.PTTL(ctx, r.key(key)).Result()
	if err != nil {
		return 0, r.b.classify(err)
	}
	if left < 0 { // -2: no key; -1: no expiry (not ours)
		return 0, nil
	}
	return left, nil
}

// following starts watching the internal channel, once: subscribe first,
// then read its history (what arrives twice is applied twice, harmlessly).
func (r *RedisThrottles) following() {
	r.start.Do(func() {
		r.hub.Subscribe(r, []string{throttleChannel}) // for the hub's life
		r.mu.Lock()
		r.reloading = true
		r.mu.Unlock()
		go r.load()
		go r.keepClock()
	})
}

// keepClock measures Redis' clock again every clockEvery until the broker
// closes. An announcement is dated by the primary that took it; measured
// only at loads (a start, a gap), the offset stayed what it was before a
// failover or an NTP step for as long as no gap came: a throttle shorter
// than that change was taken for over, or held its client off for that
// much longer. A failed measurement keeps the last one.
func (r *RedisThrottles) keepClock() {
	tick := time.NewTicker(r.clockEvery)
	defer tick.Stop()
	for {
		select {
		case <-r.stop:
			return
		case <-tick.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), clockWait)
		r.measureClock(ctx)
		cancel()
	}
}

// clockWait bounds one measurement of Redis' clock: a hung primary must not
// hold the next one off.
const clockWait = 2 * time.Second

// waitLoaded waits, at most loadWait, for the announcements to be loaded;
// false if they are not (Redis is then asked). The streams of a burst at
// start — Caddy's first config, a reconnect storm — wait for the one read
// of the history instead of each asking Redis: 145 of a 10k ramp did, at
// once, and go-redis opened its whole pool for them (20 connections, 1.6 MB
// of buffers kept for half an hour).
func (r *RedisThrottles) waitLoaded(ctx context.Context) bool {
	// while Redis refuses the subscription of the announcements, those of
	// other instances do not arrive: Redis is asked instead
	refused := func() bool { return r.b.watch.denied(r.b.Key(throttleChannel)) }
	if refused() {
		return false
	}
	select {
	case <-r.ready:
		return true
	default:
	}
	ctx, cancel := context.WithTimeout(ctx, loadWait)
	defer cancel()
	return r.b.awaitFirstSync(ctx, r.ready, refused) // false while Redis is down too: no load to wait for
}

// loadWait bounds how long a lookup waits for the announcements' load: a
// subscription, its first sync and one read, a few milliseconds unless
// Redis is slow.
const loadWait = time.Second

// load reads the announcements kept in Redis, retrying while Redis cannot
// be reached, until they are all known or the broker closes. It reads them
// once the internal channel's watch has had its first sync (watcher.synced):
// read before, an announcement made while the subscription was being
// confirmed was in neither the history read nor what the sync delivered,
// and this instance never refused that client.
func (r *RedisThrottles) load() {
	wait := 100 * time.Millisecond
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		r.b.watch.synced(ctx, r.b.Key(throttleChannel)) // not synced (Redis slow or down): read anyway, or fail and retry
		clocked := r.measureClock(ctx)
		// a position of no epoch: the read is truncated to the newest events
		page, err := r.hub.Read(ctx, throttleChannel, &replay.Position{}, throttleHistory.Count)
		cancel()
		// not applied before Redis' clock was measured once: apply would
		// take every announcement of the history, a day of them, for new
		if err == nil && clocked {
			for _, ev := range page.Events {
				r.apply(ev)
			}
			r.mu.Lock()
			r.loaded, r.reloading = true, false
			if !r.last.Holds(page.Head) {
				r.last = page.Head
			}
			r.mu.Unlock()
			r.readyOnce.Do(func() { close(r.ready) })
			return
		}
		select {
		case <-r.stop:
			return
		case <-time.After(wait):
		}
		wait = min(2*wait, 5*time.Second)
	}
}

// measureClock measures how far the clock of Redis (the primary of the
// announcements) is ahead of this instance's. It reports whether that is
// known: measured now, or by an earlier load (a failed measurement keeps
// it).
func (r *RedisThrottles) measureClock(ctx context.Context) bool {
	node, err := r.b.nodeFor(ctx, r.b.Key(throttleChannel))
	if err == nil {
		sent := r.b.now()
		var at time.Time
		if at, err = node.Time(ctx).Result(); err == nil {
			back := r.b.now()
			mid := sent.Add(back.Sub(sent) / 2)
			r.mu.Lock()
			r.offset, r.clocked = at.UnixMilli()-mid.UnixMilli(), true
			r.mu.Unlock()
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.clocked // not yet: load tries again
}

// Deliver receives the announcements of every instance.
func (r *RedisThrottles) Deliver(_ int, ev *replay.Event) {
	r.apply(ev)
	if r.noteGap(ev) {
		go r.load()
	}
}

// noteGap records an announcement's position; it reports whether the
// history must be read again: announcements before this one may never have
// arrived, and no read of the history is under way already. An event of a
// local epoch (published while Redis was down, fallback local) is not
// Redis' history: it is applied, nothing more.
func (r *RedisThrottles) noteGap(ev *replay.Event) bool {
	if ev.Local {
		return false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case r.last.Holds(ev.Pos):
		return false // known already
	case r.last.Follows(ev.Pos) || !r.loaded || r.reloading: // the zero position (an empty history) is followed by seq 1
		r.last = ev.Pos
		return false
	}
	r.last = ev.Pos
	r.reloading = true
	return true
}

// apply remembers an announced throttle for what is left of it.
func (r *RedisThrottles) apply(ev *replay.Event) {
	data, ok := frameData(ev.Frame)
	if !ok {
		return
	}
	var a announcement
	if json.Unmarshal(data, &a) != nil || a.Key == "" {
		return
	}
	now := r.b.now()
	r.mu.Lock()
	offset := r.offset
	r.mu.Unlock()
	// the announcement's time is Redis': what is left of the throttle is
	// counted on Redis' clock. One not measured yet counts on this
	// instance's (offset 0), off by its skew at worst: taken for new, an
	// old announcement re-delivered before the first load (a watch's sync
	// once Redis answers again) refused its client again for its length
	left := time.Duration(ev.Pos.Time+a.MS-(now.UnixMilli()+offset)) * time.Millisecond
	if ev.Local || ev.Pos.Time == 0 {
		left = time.Duration(a.MS) * time.Millisecond
	}
	if left > 0 {
		_ = r.known.Throttle(context.Background(), a.Key, left)
	}
}

// frameData returns the data of a one-line event frame.
func frameData(frame []byte) ([]byte, bool) {
	const field = "data: "
	i := bytes.Index(frame, []byte("\n"+field))
	if i < 0 {
		if !bytes.HasPrefix(frame, []byte(field)) {
			return nil, false
		}
		i = -1
	}
	rest := frame[i+1+len(field):]
	end := bytes.IndexByte(rest, '\n')
	if end < 0 {
		return nil, false
	}
	return rest[:end], true
}

// Interface guards
var (
	_ Throttles  = (*RedisThrottles)(nil)
	_ Subscriber = (*RedisThrottles)(nil)
)
