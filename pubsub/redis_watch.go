package pubsub

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/caddy-sse/caddy-sse/replay"
)

// watcher subscribes this instance to the shard channels of the channels
// its streams read, and turns announcements into in-order deliveries:
//   - one pub/sub connection per Redis primary (a shard), each channel
//     subscribed on the primary that serves its slot; go-redis' own cluster
//     pub/sub follows a single node per connection, so it is not used;
//   - each channel remembers the last position delivered, so duplicates are
//     dropped and a gap (a lost announcement, a reconnect) is filled from the
//     channel's stream, once per instance, before later events;
//   - every CheckInterval each shard compares its channels' heads with what
//     was delivered, to repair quiet channels too, and pings its connection;
//   - a failed connection is replaced (with backoff), resubscribed, and its
//     channels caught up; a channel whose slot moved (MOVED, or Redis
//     unsubscribing it) is subscribed again where it lives now.
//
// Subscribing starts lazily with the first Watch: no goroutine and no
// connection before a stream needs one.
type watcher struct {
	b *Redis

	mu      sync.Mutex
	byKey   map[string]*watch
	shards  map[string]*shard
	pending map[string]*watch // keys to (re)assign to a shard
	started bool
	closed  bool
	kick    chan struct{}
	stop    chan struct{}
	wg      sync.WaitGroup
}

// watch is one watched channel. mu serializes its deliveries; new streams
// read last under its read lock, so that many at once do not turn each
// other away.
type watch struct {
	channel, key string

	mu    sync.RWMutex
	last  replay.Position
	known bool
	// behind: the shard's connection ended and no check has compared the
	// head since; events may have been published meanwhile, so last is not
	// where a new stream starts (delivered).
	behind bool
	// losses counts the subscriptions lost (lostSubscription): a check
	// whose heads were read before a loss must not clear behind.
	losses uint64
	// unreadSyncs counts the first syncs given up because the read of the
	// newest event failed (syncHead).
	unreadSyncs int

	// denied: Redis refuses the subscriptions of its shard (an ACL): no
	// live event comes (redis_denied.go).
	denied atomic.Bool
	// subscribed: Redis confirmed the channel's subscription on its
	// shard's connection. The first sync waits for it (syncHead): a head
	// read before it could be passed by an event announced before the
	// subscription took effect, and a stream waiting for the sync would go
	// on before Redis answered — refused, it is to open degraded.
	subscribed atomic.Bool

	// ready is closed once last is known (or the watch is dropped): the
	// streams that join a channel before its first sync wait for it
	// (startAt) instead of each reading the head from Redis.
	ready     chan struct{}
	readyOnce sync.Once
}

func newWatch(channel, key string) *watch {
	return &watch{channel: channel, key: key, ready: make(chan struct{})}
}

// markReady wakes the streams waiting for the watch's first sync.
func (wt *watch) markReady() { wt.readyOnce.Do(func() { close(wt.ready) }) }

func newWatcher(b *Redis) *watcher {
	return &watcher{
		b:       b,
		byKey:   make(map[string]*watch),
		shards:  make(map[string]*shard),
		pending: make(map[string]*watch),
		kick:    make(chan struct{}, 1),
		stop:    make(chan struct{}),
	}
}

// want records that the channel is (or is no longer) watched. It never
// blocks: the manager goroutine subscribes and unsubscribes.
func (w *watcher) want(channel string, wanted bool) {
	key := w.b.Key(channel)
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return
	}
	if old := w.byKey[key]; old != nil {
		old.markReady() // replaced or dropped: its waiters read Redis
	}
	if wanted {
		wt := newWatch(channel, key)
		w.byKey[key] = wt
		w.pending[key] = wt
	} else {
		delete(w.byKey, key)
		w.pending[key] = nil
	}
	if !w.started {
		w.started = true
		w.wg.Add(1)
		go w.manage()
	}
	w.kickManager()
}

// delivered returns the last position delivered on a watched channel whose
// subscription is confirmed and whose head has been compared since; false
// if there is none, or if a delivery or repair is under way.
//
// A stream that subscribed to the hub may start there instead of at the
// head read from Redis: every later event reaches it through this watch,
// in order, announced or repaired — one Redis call less per connection.
func (w *watcher) delivered(key string) (replay.Position, bool) {
	return w.lookup(key).delivered()
}

// isKnown reports whether the watch has had its first sync (or event):
// ready is closed then, or when the watch was dropped, and a dropped
// watch needs no sync either.
func (wt *watch) isKnown() bool {
	select {
	case <-wt.ready:
		return true
	default:
		return false
	}
}

func (wt *watch) delivered() (replay.Position, bool) {
	if wt == nil || !wt.mu.TryRLock() {
		return replay.Position{}, false
	}
	defer wt.mu.RUnlock()
	return wt.last, wt.known && !wt.behind
}

// watchMark is where a watch was when a check read its head.
type watchMark struct {
	last   replay.Position
	losses uint64
}

func (wt *watch) mark() watchMark {
	wt.mu.RLock()
	defer wt.mu.RUnlock()
	return watchMark{last: wt.last, losses: wt.losses}
}

// lastKnown is the last position the watch of channel delivered, also
// while behind (Redis may be down: it is what this instance saw last).
func (b *Redis) lastKnown(channel string) (replay.Position, bool) {
	wt := b.watch.lookup(b.Key(channel))
	if wt == nil || !wt.mu.TryRLock() {
		return replay.Position{}, false
	}
	defer wt.mu.RUnlock()
	return wt.last, wt.known && !wt.last.IsZero()
}

// adoptEmpty has the watch of key, at the position before a channel's first
// event, start further streams at head instead: the same position, of the
// epoch namedHead started. A watch that has delivered an event since is
// left as it is.
func (w *watcher) adoptEmpty(key string, head replay.Position) {
	wt := w.lookup(key)
	if wt == nil {
		return
	}
	wt.mu.Lock()
	defer wt.mu.Unlock()
	if wt.known && wt.last.IsZero() {
		wt.last = head
	}
}

// lostSubscription marks the watch as behind until its next check: its
// shard's connection ended, and what was published meanwhile arrives only
// with the repair after the new subscription is confirmed. A stream that
// started at last then would be handed those events, published before it
// joined (SPEC S4: a fresh stream starts live).
func (wt *watch) lostSubscription() {
	wt.subscribed.Store(false)
	wt.mu.Lock()
	wt.behind = true
	wt.losses++
	wt.mu.Unlock()
}

// startAt is delivered for a stream that just subscribed: if the channel's
// watch has not had its first sync yet, it waits for it, for at most
// syncWait. A burst of new streams (a ramp, a reconnect storm) then costs
// Redis one pipelined head read per channel, made by the shard's check,
// instead of a read per stream queueing for the connection pool: with 1000
// new channels a ramp had 580 streams waiting for a pooled connection at
// once and a connect p99 of 0.6-1.3 s (docs/PERFORMANCE.md).
func (w *watcher) startAt(ctx context.Context, key string) (replay.Position, bool) {
	wt := w.lookup(key)
	if wt == nil || !w.awaitKnown(ctx, wt) {
		return replay.Position{}, false
	}
	return wt.delivered()
}

// awaitKnown waits until the watch has had its first sync, for at most
// syncWait; false if Redis refuses its channel. There is no sync to wait
// for while Redis is down or refuses the channel: the stream opens
// degraded (Read checks).
func (w *watcher) awaitKnown(ctx context.Context, wt *watch) bool {
	if wt.denied.Load() {
		return false
	}
	select {
	case <-wt.ready:
	default:
		ctx, cancel := context.WithTimeout(ctx, syncWait)
		defer cancel()
		w.b.awaitFirstSync(ctx, wt.ready, wt.denied.Load)
	}
	return !wt.denied.Load()
}

// denied reports whether Redis refuses the subscription of the watched
// channel of key.
func (w *watcher) denied(key string) bool {
	wt := w.lookup(key)
	return wt != nil && wt.denied.Load()
}

// countDenied returns how many watched channels Redis refuses the
// subscription of (not the internal channel of throttles).
func (w *watcher) countDenied() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := 0
	for key, wt := range w.byKey {
		if wt.denied.Load() && key != w.b.Key(throttleChannel) {
			n++
		}
	}
	return n
}

// synced waits until the watch of key has had its first sync (or was
// dropped), ctx ends or Redis is found down; false if it did not sync (or
// key is not watched). A subscriber that reads a channel's history once,
// without noticing gaps itself, reads it after this: the first sync
// delivers only the newest of the events its head covers, and one
// announced while the subscription was being confirmed is then in the
// history, not lost.
func (w *watcher) synced(ctx context.Context, key string) bool {
	wt := w.lookup(key)
	if wt == nil {
		return false
	}
	return w.b.awaitFirstSync(ctx, wt.ready, wt.denied.Load)
}

// awaitFirstSync waits until ready is closed (true), ctx ends, Redis is
// found down, or Redis refuses the subscription that refused reports
// (false). The refusal of another channel does not end the wait: an ACL
// may refuse some channels only.
func (b *Redis) awaitFirstSync(ctx context.Context, ready <-chan struct{}, refused func() bool) bool {
	for {
		refusal := b.deniedSignal() // before the flag: a refusal after it signals
		if refused() {
			return false
		}
		select {
		case <-ready:
			return true
		case <-ctx.Done():
			return false
		case <-b.downSignal():
			return false
		case <-refusal: // perhaps another channel's: look again
		}
	}
}

// syncWait bounds how long a new stream waits for its channel's first
// sync before it reads the head itself: a sync takes a few round trips
// (subscribe, confirmation, pipelined check), more on a saturated machine;
// it never comes if this instance cannot subscribe at all. A stream stops
// waiting at once when Redis is found down.
const syncWait = time.Second

// count returns how many channels of streams are watched (not the
// internal channel of throttles).
func (w *watcher) count() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := len(w.byKey)
	if _, ok := w.byKey[w.b.Key(throttleChannel)]; ok {
		n--
	}
	return n
}

func (w *watcher) lookup(key string) *watch {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.byKey[key]
}

// manage applies subscription changes, batched per shard, and retries
// the ones that could not be placed (e.g. the cluster is down).
func (w *watcher) manage() {
	defer w.wg.Done()
	retry := time.NewTicker(time.Second)
	defer retry.Stop()
	for {
		select {
		case <-w.kick:
		case <-retry.C:
		case <-w.stop:
			return
		}
		w.apply()
	}
}

func (w *watcher) apply() {
	w.mu.Lock()
	changes := w.pending
	w.pending = make(map[string]*watch)
	w.mu.Unlock()

	subscribe := map[*shard][]string{}
	unsubscribe := map[*shard][]string{}
	resync := map[*shard]bool{} // shards that carried a key already: its check is queued
	held := map[string]*watch{}
	for key := range changes {
		current := w.lookup(key)
		if current == nil {
			if s := w.detach(key); s != nil {
				unsubscribe[s] = append(unsubscribe[s], key)
			}
			continue
		}
		s, err := w.shardFor(key)
		if err != nil {
			w.retryLater(key, current, err)
			continue
		}
		if w.b.cluster != nil && s.gaveUpRecently(key) {
			held[key] = current // the state is older than the move
			continue
		}
		if s.attach(key, current) {
			subscribe[s] = append(subscribe[s], key)
		} else {
			resync[s] = true
		}
	}
	for s, keys := range unsubscribe {
		s.unsubscribe(keys)
	}
	for s, keys := range subscribe {
		s.subscribe(keys)
	}
	for s := range resync {
		s.ping()
	}
	if len(held) > 0 {
		w.placeLater(held)
	}
}

// placeLater has the manager place keys again in placeRetry, with a new
// state of the cluster: the one it has names the primary that gave their
// slot up (shard.gaveUpRecently).
func (w *watcher) placeLater(keys map[string]*watch) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	w.b.cluster.ReloadState(ctx) // in the background, after go-redis' pause
	cancel()
	w.mu.Lock()
	for key, wt := range keys {
		w.requeueLocked(key, wt)
	}
	w.mu.Unlock()
	time.AfterFunc(placeRetry, w.kickManager)
}

// kickManager has the manager apply the pending changes now.
func (w *watcher) kickManager() {
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

// placeRetry is how soon keys held back from the primary that gave their
// slot up are placed again (placeLater).
const placeRetry = 25 * time.Millisecond

// detach removes key from the shard it was subscribed on.
func (w *watcher) detach(key string) *shard {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, s := range w.shards {
		if s.remove(key) {
			return s
		}
	}
	return nil
}

func (w *watcher) retryLater(key string, wt *watch, err error) {
	w.b.log().Debug("could not place a channel subscription yet", zap.String("key", key), zap.Error(err))
	w.mu.Lock()
	defer w.mu.Unlock()
	w.requeueLocked(key, wt)
}

// requeueLocked puts key back among the pending changes to be placed,
// unless a newer change of it is pending or wt is no longer its watch.
func (w *watcher) requeueLocked(key string, wt *watch) {
	if _, set := w.pending[key]; !set && w.byKey[key] == wt {
		w.pending[key] = wt
	}
}

// shardFor returns the shard (connection) for the primary that serves key.
func (w *watcher) shardFor(key string) (*shard, error) {
	id, client := "main", w.b.client
	if w.b.cluster != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		node, err := w.b.cluster.MasterForKey(ctx, key)
		if err != nil {
			return nil, err
		}
		id, client = node.Options().Addr, node
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return nil, ErrClosed
	}
	s := w.shards[id]
	if s == nil {
		s = newShard(w, id, client)
		w.shards[id] = s
		w.wg.Add(1)
		go s.run()
	} else {
		s.useClient(client)
	}
	return s, nil
}

// replace sends keys back to the manager to be placed again: their slot
// moved to another primary.
func (w *watcher) replace(keys []string) {
	if w.b.cluster != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		w.b.cluster.ReloadState(ctx)
		cancel()
	}
	w.mu.Lock()
	for _, key := range keys {
		if wt := w.byKey[key]; wt != nil {
			w.pending[key] = wt
		}
	}
	w.mu.Unlock()
	w.kickManager()
}

// recovered is told that Redis answers again: shards waiting to reconnect
// try at once.
func (w *watcher) recovered() {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, s := range w.shards {
		s.wakeUp()
	}
}

func (w *watcher) close() {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return
	}
	w.closed = true
	close(w.stop)
	for _, wt := range w.byKey {
		wt.markReady()
	}
	shards := make([]*shard, 0, len(w.shards))
	for _, s := range w.shards {
		shards = append(shards, s)
	}
	w.mu.Unlock()
	for _, s := range shards {
		s.close()
	}
	w.wg.Wait()
}

// accept delivers an announced event in order: duplicates are dropped, a
// gap is filled from the stream first. So is a rewritten history (an event
// at or before the last delivered position but newer than it: a failover
// lost events and gave their seqs to new ones), and any event while the
// subscription was lost and the head not compared since: an event that
// seems to follow may follow a lost one, and the new events before it were
// announced while this instance was not subscribed. Streams end at the
// first new event of a rewritten history and are told on reconnect.
func (w *watcher) accept(wt *watch, ev *replay.Event) {
	defer wt.markReady() // known now; after the unlock, so that startAt's read lock is free
	wt.mu.Lock()
	defer wt.mu.Unlock()
	switch {
	case !wt.known:
	case wt.last.Holds(ev.Pos):
		return
	case wt.last.Follows(ev.Pos) && !wt.behind:
	default:
		if wt.last.Contradicts(ev.Pos) {
			w.b.log().Warn("channel history was rewritten (events lost, e.g. in a failover)",
				zap.String("channel", wt.channel), zap.Uint64("seq", ev.Pos.Seq))
		}
		if w.repairLocked(wt) {
			wt.behind = false // caught up with the head, while subscribed
		}
		if wt.last.Holds(ev.Pos) {
			return
		}
	}
	w.deliverLocked(wt, ev)
}

// deliverPublished delivers an event this instance has just appended at
// pos, without waiting for Redis to announce it back, if it is the next
// event of a watch that is caught up: no other event can come between
// them, and the announcement, when it comes, is a duplicate (accept). Any
// other watch waits for the announcement as before. It takes a hop off the
// publish's way to this instance's streams (docs/PERFORMANCE.md).
//
// A watch someone else holds is left to the announcement too: Redis sends
// it with the reply, and the shard's goroutine, woken with the publishing
// one, often has it first; waiting for its lock put 7 % of the publishes
// to sleep before their reply was written (a trace of bench-redis-spread).
func (w *watcher) deliverPublished(key string, pos replay.Position, msg Message) {
	wt := w.lookup(key)
	if wt == nil {
		return
	}
	if !wt.mu.TryLock() {
		return
	}
	defer wt.mu.Unlock()
	if !wt.known || wt.behind || wt.denied.Load() || !wt.last.Follows(pos) {
		return
	}
	if ev, valid := encodeEvent(pos, msg.Type, string(msg.Data)); valid {
		w.deliverLocked(wt, ev)
	}
}

func (w *watcher) deliverLocked(wt *watch, ev *replay.Event) {
	wt.last, wt.known = ev.Pos, true
	w.b.deliver(wt.channel, ev)
}

// repairLocked delivers the events of the stream after the last delivered
// position. A history that no longer follows on (trimmed, lost) is
// delivered from what is left: streams notice the hole themselves. It
// reports whether it read the history.
func (w *watcher) repairLocked(wt *watch) bool {
	if !wt.known {
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	after := wt.last
	page, bad, err := w.b.read(ctx, wt.key, &after, w.b.opts.RepairLimit)
	if err != nil {
		w.b.log().Debug("repairing a channel failed", zap.String("channel", wt.channel), zap.Error(err))
		return false
	}
	w.warnBad(wt, bad)
	for _, ev := range page.Events {
		if !wt.last.Holds(ev.Pos) {
			w.deliverLocked(wt, ev)
		}
	}
	if page.Truncated {
		// the history goes on from its head, not from last: after a
		// failover that lost events the head is behind last, every event
		// left is one already delivered, and new streams start here
		wt.last = page.Head
	}
	return true
}

// syncHead compares a channel's head with what was delivered: it sets the
// starting point of a new watch, and repairs an old one that fell behind.
//
// A new watch has a window: a stream that subscribed read its starting
// point before this instance's Redis subscription was confirmed, so an
// event published in between may never be announced here. The newest event
// is therefore delivered at the first sync: a stream that is behind it sees
// a gap and reads the history, the others drop it as a duplicate. A first
// sync whose read of the newest event failed is left to the next check:
// started at the head without it, the watch left such a stream silent until
// a next event, which may never come. Its streams meanwhile wait for syncWait
// and read the head themselves, and an announcement starts it as well. After
// maxUnreadSyncs such checks the read is taken to fail for good (a key of the
// wrong type, an ACL that refuses the read's script) and the watch starts at
// the head without it, logged: else every new stream of the channel would
// wait syncWait for as long as the instance runs.
//
// h.newest is that event, read in the same check as the head (nil if there
// is none, or if it was not read). h.before is where the watch was when the
// head was read: a watch that has delivered past the head since is not
// behind (its events are announced while the check runs), and reading its
// history would only hold up its next announcement; a watch whose
// subscription was lost since stays behind.
func (w *watcher) syncHead(h headOf) {
	wt, head, before := h.wt, h.head, h.before
	wt.mu.Lock()
	if !wt.known && !wt.subscribed.Load() {
		wt.mu.Unlock() // a check of every channel: its confirmation syncs it
		return
	}
	if !wt.known && h.unread != nil && !w.givesUpNewest(wt, h.unread) {
		wt.mu.Unlock()
		return
	}
	defer wt.markReady() // known now; after the unlock, so that startAt's read lock is free
	defer wt.mu.Unlock()
	switch {
	case !wt.known:
		wt.last, wt.known = head, true
		if h.newest != nil && h.newest.Pos == head {
			w.deliverLocked(wt, h.newest)
		}
	case head.IsZero() && wt.last.IsZero():
		// before the first event still, of the epoch a stream started
		// (adoptEmpty) or of none (its history lost): nothing to deliver
		wt.last = head
	case head == wt.last:
	case wt.last != before.last && wt.last.Holds(head):
		// announced past head while the check ran
	default:
		w.repairLocked(wt)
	}
	if wt.losses != before.losses {
		return // lost after the read: events may have gone unannounced since
	}
	// caught up with the head this check read, unless the repair failed
	wt.behind = head != wt.last && !wt.last.Holds(head)
}

// maxUnreadSyncs is how many first syncs of a watch may fail to read the
// channel's newest event before the watch starts without it (syncHead).
const maxUnreadSyncs = 3

// givesUpNewest counts a first sync whose read of the newest event failed
// with err, and reports whether the watch is to start without that event
// now. wt.mu is held.
func (w *watcher) givesUpNewest(wt *watch, err error) bool {
	wt.unreadSyncs++
	if wt.unreadSyncs < maxUnreadSyncs {
		return false
	}
	w.b.log().Warn("the newest event of a channel could not be read at its first syncs; its watch starts without it "+
		"(a stream that joined the channel before this instance's subscription may wait for the next event)",
		zap.String("channel", wt.channel), zap.Int("attempts", wt.unreadSyncs), zap.Error(err))
	return true
}

// beyondHead is the position to read after for a channel's newest event: a
// read past the head is truncated to the newest events.
func beyondHead(head replay.Position) replay.Position {
	return replay.Position{Epoch: head.Epoch, Seq: head.Seq + 1, Time: head.Time}
}

func (w *watcher) warnBad(wt *watch, bad int) {
	if bad > 0 {
		w.b.warnBad(wt.channel)
	}
}

// onNotice handles an announcement received on a shard channel.
func (w *watcher) onNotice(key, payload string) {
	wt := w.lookup(key)
	if wt == nil {
		return // unwatched meanwhile
	}
	n, err := parseNotice(payload)
	if err != nil {
		w.b.badNotices.Log(w.b.log(), rareWarningEvery, "malformed announcement on a shard channel", zap.String("key", key), zap.Error(err))
		return
	}
	ev, valid := encodeEvent(n.pos, n.typ, n.data)
	if !valid {
		w.warnBad(wt, 1)
	}
	w.accept(wt, ev)
}
