package pubsub

import (
	"context"
	"errors"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/caddy-sse/caddy-sse/internal/clusterslot"
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

	mu         sync.RWMutex
	last       replay.Position
	known      bool
	warnedType bool

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
	select {
	case w.kick <- struct{}{}:
	default:
	}
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
	return wt.last, wt.known
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
	if wt == nil {
		return replay.Position{}, false
	}
	select {
	case <-wt.ready:
	default:
		timer := time.NewTimer(syncWait)
		defer timer.Stop()
		select {
		case <-wt.ready:
		case <-timer.C:
		case <-ctx.Done():
		case <-w.b.downSignal(): // no sync to wait for: the stream opens degraded
		}
	}
	return wt.delivered()
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
		if s.attach(key, current) {
			subscribe[s] = append(subscribe[s], key)
		}
	}
	for s, keys := range unsubscribe {
		s.unsubscribe(keys)
	}
	for s, keys := range subscribe {
		s.subscribe(keys)
	}
}

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
	w.b.log.Debug("could not place a channel subscription yet", zap.String("key", key), zap.Error(err))
	w.mu.Lock()
	defer w.mu.Unlock()
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
	select {
	case w.kick <- struct{}{}:
	default:
	}
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
// gap is filled from the stream first. A rewritten history (an event at or
// before the last delivered position but newer than it: a failover lost
// events) is delivered as is; streams end on it and are told on reconnect.
func (w *watcher) accept(wt *watch, ev *replay.Event) {
	defer wt.markReady() // known now; after the unlock, so that startAt's read lock is free
	wt.mu.Lock()
	defer wt.mu.Unlock()
	switch {
	case !wt.known:
	case wt.last.Contradicts(ev.Pos):
		w.b.log.Warn("channel history was rewritten (events lost, e.g. in a failover)",
			zap.String("channel", wt.channel), zap.Uint64("seq", ev.Pos.Seq))
	case wt.last.Covers(ev.Pos):
		return
	case wt.last.Follows(ev.Pos):
	default:
		w.repairLocked(wt)
		if wt.last.Covers(ev.Pos) && !wt.last.Contradicts(ev.Pos) {
			return
		}
	}
	w.deliverLocked(wt, ev)
}

func (w *watcher) deliverLocked(wt *watch, ev *replay.Event) {
	wt.last, wt.known = ev.Pos, true
	w.b.deliver(wt.channel, ev)
}

// repairLocked delivers the events of the stream after the last delivered
// position. A history that no longer follows on (trimmed, lost) is
// delivered from what is left: streams notice the hole themselves.
func (w *watcher) repairLocked(wt *watch) {
	if !wt.known {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	after := wt.last
	page, bad, err := w.b.read(ctx, wt.key, &after, w.b.opts.RepairLimit)
	if err != nil {
		w.b.log.Debug("repairing a channel failed", zap.String("channel", wt.channel), zap.Error(err))
		return
	}
	w.warnBad(wt, bad)
	for _, ev := range page.Events {
		if !wt.last.Covers(ev.Pos) || wt.last.Contradicts(ev.Pos) {
			w.deliverLocked(wt, ev)
		}
	}
	if len(page.Events) == 0 && page.Truncated {
		wt.last = page.Head
	}
}

// syncHead compares a channel's head with what was delivered: it sets the
// starting point of a new watch, and repairs an old one that fell behind.
//
// A new watch has a window: a stream that subscribed read its starting
// point before this instance's Redis subscription was confirmed, so an
// event published in between may never be announced here. The newest event
// is therefore delivered at the first sync: a stream that is behind it sees
// a gap and reads the history, the others drop it as a duplicate.
//
// newest is that event, read in the same check as head (nil if there is
// none, or if it was not read).
func (w *watcher) syncHead(wt *watch, head replay.Position, newest *replay.Event) {
	defer wt.markReady() // known now; after the unlock, so that startAt's read lock is free
	wt.mu.Lock()
	defer wt.mu.Unlock()
	switch {
	case !wt.known:
		wt.last, wt.known = head, true
		if newest != nil && newest.Pos == head {
			w.deliverLocked(wt, newest)
		}
	case head != wt.last:
		w.repairLocked(wt)
	}
}

// beyondHead is the position to read after for a channel's newest event: a
// read past the head is truncated to the newest events.
func beyondHead(head replay.Position) replay.Position {
	return replay.Position{Epoch: head.Epoch, Seq: head.Seq + 1, Time: head.Time}
}

func (w *watcher) warnBad(wt *watch, bad int) {
	if bad > 0 && !wt.warnedType {
		wt.warnedType = true
		w.b.log.Warn("events with an invalid type or non-UTF-8 data arrived through Redis; they are sent as id-only blocks",
			zap.String("channel", wt.channel))
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
		w.b.log.Warn("malformed announcement on a shard channel", zap.String("key", key), zap.Error(err))
		return
	}
	ev, valid := encodeEvent(n.pos, n.typ, n.data)
	if !valid {
		w.warnBad(wt, 1)
	}
	w.accept(wt, ev)
}

// shard is the pub/sub connection to one primary and the channels it
// carries.
type shard struct {
	w      *watcher
	id     string
	client redis.UniversalClient

	mu          sync.Mutex
	keys        map[string]*watch
	ps          *redis.PubSub
	unconfirmed int       // subscriptions sent and not yet confirmed
	confirming  time.Time // when the last confirmation came, or the first was awaited
	toSync      []string  // confirmed, head not yet compared
	toSyncSince time.Time // when the oldest of toSync was confirmed
	// leaving counts the unsubscribes this instance sent and Redis has
	// not confirmed yet, per key: those confirmations are not Redis moving
	// the slot away, even if the key is back on the shard by then.
	leaving   map[string]int
	lastCheck time.Time
	wake      chan struct{}
	quit      chan struct{}
	closed    bool
	parked    bool // run waits for a channel (parkIfEmpty)
}

// newShard returns a shard whose first full check is a check interval
// away: until then every key it carries is new, and is checked once its
// subscription is confirmed (a full check at the first message read them
// all a second time).
func newShard(w *watcher, id string, client redis.UniversalClient) *shard {
	return &shard{w: w, id: id, client: client, keys: make(map[string]*watch), leaving: make(map[string]int),
		lastCheck: time.Now(), wake: make(chan struct{}, 1), quit: make(chan struct{})}
}

// attach puts key on this shard; it reports whether it must be subscribed
// (false if it already was, in which case its head is compared again).
func (s *shard) attach(key string, wt *watch) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, had := s.keys[key]
	s.keys[key] = wt
	if had {
		s.queueSyncLocked(key)
	}
	return !had
}

func (s *shard) remove(key string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.keys[key]; !ok {
		return false
	}
	delete(s.keys, key)
	return true
}

func (s *shard) subscribe(keys []string) {
	s.mu.Lock()
	ps, parked := s.ps, s.parked
	if ps != nil {
		s.awaitLocked(len(keys))
	}
	s.mu.Unlock()
	if ps == nil {
		if parked {
			s.wakeUp()
		}
		return // the connection subscribes every key when it (re)connects
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := s.ssubscribe(ctx, ps, keys); err != nil {
		s.w.b.log.Debug("subscribing failed; the connection will be replaced", zap.String("shard", s.id), zap.Error(err))
		s.kill(ps)
	}
}

func (s *shard) unsubscribe(keys []string) {
	s.mu.Lock()
	ps := s.ps
	if ps != nil {
		s.leaveLocked(keys)
	}
	s.mu.Unlock()
	if ps == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := s.sunsubscribe(ctx, ps, keys); err != nil {
		s.kill(ps)
	}
}

// ssubscribe subscribes keys on ps, one command per hash slot (slotBatches).
func (s *shard) ssubscribe(ctx context.Context, ps *redis.PubSub, keys []string) error {
	for _, batch := range s.slotBatches(keys) {
		if err := ps.SSubscribe(ctx, batch...); err != nil {
			return err
		}
	}
	return nil
}

// sunsubscribe unsubscribes keys on ps, one command per hash slot.
func (s *shard) sunsubscribe(ctx context.Context, ps *redis.PubSub, keys []string) error {
	for _, batch := range s.slotBatches(keys) {
		if err := ps.SUnsubscribe(ctx, batch...); err != nil {
			return err
		}
	}
	return nil
}

// slotBatches splits keys into what one SSUBSCRIBE or SUNSUBSCRIBE may
// carry. A cluster refuses (CROSSSLOT) a command whose shard channels hash
// to different slots, and one primary's shard holds channels of many slots;
// a single Redis or Sentinel takes them all at once.
func (s *shard) slotBatches(keys []string) [][]string {
	if s.w.b.cluster == nil || len(keys) < 2 {
		return [][]string{keys}
	}
	bySlot := map[uint16][]string{}
	for _, key := range keys {
		slot := clusterslot.Of(key)
		bySlot[slot] = append(bySlot[slot], key)
	}
	batches := make([][]string, 0, len(bySlot))
	for _, batch := range bySlot {
		batches = append(batches, batch)
	}
	return batches
}

// leaveLocked records unsubscribes about to be sent (see leaving).
func (s *shard) leaveLocked(keys []string) {
	for _, key := range keys {
		s.leaving[key]++
	}
}

// leftLocked takes the confirmation of an unsubscribe of key; false if
// this instance did not ask for it (Redis moved the slot).
func (s *shard) leftLocked(key string) bool {
	n := s.leaving[key]
	switch {
	case n == 0:
		return false
	case n == 1:
		delete(s.leaving, key)
	default:
		s.leaving[key] = n - 1
	}
	return true
}

// kill closes a broken connection so that run replaces it.
func (s *shard) kill(ps *redis.PubSub) { _ = ps.Close() }

func (s *shard) wakeUp() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

func (s *shard) close() {
	s.mu.Lock()
	s.closed = true
	ps := s.ps
	s.mu.Unlock()
	close(s.quit)
	if ps != nil {
		_ = ps.Close()
	}
}

// run keeps the shard's connection up: connect, subscribe every key,
// receive until the connection fails, back off, again.
func (s *shard) run() {
	defer s.w.wg.Done()
	backoff := 50 * time.Millisecond
	for {
		ps, err := s.connect()
		if ps == nil {
			return // closed
		}
		if err == nil {
			err = s.receive(ps)
		}
		_ = ps.Close()
		s.mu.Lock()
		s.ps = nil
		closed := s.closed
		s.mu.Unlock()
		if closed {
			return
		}
		if err != nil {
			s.w.b.unavailable(err)
			s.w.b.reconnects.Add(1)
		}
		s.relocate()
		if !s.waitToReconnect(backoff) {
			return
		}
		backoff = min(2*backoff, 2*time.Second)
		if err == nil {
			backoff = 50 * time.Millisecond
		}
	}
}

// connect makes a new connection and subscribes every key on it; nil if
// the shard is closed.
func (s *shard) connect() (*redis.PubSub, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s.mu.Lock()
	if s.closed {
		// close ran meanwhile: a connection made now would never be closed
		s.mu.Unlock()
		return nil, nil
	}
	s.parked = false
	ps := s.client.SSubscribe(ctx)
	s.ps = ps
	keys := make([]string, 0, len(s.keys))
	for key := range s.keys {
		keys = append(keys, key)
	}
	s.unconfirmed = 0
	s.awaitLocked(len(keys))
	s.toSync = s.toSync[:0]
	clear(s.leaving) // a new connection: what the old one was to confirm never comes
	s.mu.Unlock()
	if len(keys) > 0 {
		if err := s.ssubscribe(ctx, ps, keys); err != nil {
			return ps, err
		}
	}
	return ps, nil
}

// waitToReconnect waits for the backoff, or until woken (Redis answers
// again). A shard that carries no channel waits until it gets one
// (subscribe wakes it): the shard of a primary that failed over and stays
// down must stop dialling it, which would tell every stream Redis is down.
// False if the shard is closed.
func (s *shard) waitToReconnect(backoff time.Duration) bool {
	for {
		var retry <-chan time.Time
		parked := s.parkIfEmpty()
		if !parked {
			retry = time.After(backoff)
		}
		select {
		case <-retry:
			return true
		case <-s.wake:
			if !parked || !s.parkIfEmpty() {
				return true
			}
		case <-s.quit:
			return false
		}
	}
}

// parkIfEmpty reports whether the shard carries no channel, and records it
// for subscribe.
func (s *shard) parkIfEmpty() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.parked = len(s.keys) == 0
	return s.parked
}

// relocate sends the keys whose slots another primary serves now to the
// manager, to be placed there, after the shard's connection ended. Redis
// tells a moved slot with MOVED or an unsubscribe (moveAway), but a primary
// that failed and stays down tells nothing: its replica took its slots
// over, and only the cluster's state says so.
func (s *shard) relocate() {
	cluster := s.w.b.cluster
	if cluster == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	cluster.ReloadState(ctx) // in the background: a later end of the connection sees it
	s.mu.Lock()
	keys := make([]string, 0, len(s.keys))
	for key := range s.keys {
		keys = append(keys, key)
	}
	s.mu.Unlock()
	var moved []string
	for _, key := range keys {
		node, err := cluster.MasterForKey(ctx, key)
		if err != nil {
			return // no state yet: the next end of the connection tries again
		}
		if node.Options().Addr != s.id {
			moved = append(moved, key)
		}
	}
	if len(moved) == 0 {
		return
	}
	s.w.b.log.Info("channels moved to another primary", zap.String("from", s.id), zap.Int("channels", len(moved)))
	s.mu.Lock()
	for _, key := range moved {
		delete(s.keys, key)
	}
	s.mu.Unlock()
	s.w.replace(moved)
}

// receive reads the connection until it fails; it returns nil if the
// connection was closed on purpose (kill or close).
func (s *shard) receive(ps *redis.PubSub) error {
	interval := s.w.b.opts.CheckInterval
	idle := 0
	for {
		msg, err := ps.ReceiveTimeout(context.Background(), interval)
		if err != nil {
			switch {
			case isTimeout(err):
				idle++
				if idle >= 3 {
					return errors.New("pub/sub connection silent for three check intervals")
				}
				_ = ps.Ping(context.Background())
				s.maybeCheck(true)
				continue
			case isMoved(err):
				s.w.b.log.Debug("a shard channel moved", zap.String("shard", s.id), zap.Error(err))
				s.moveAway()
				continue
			case errors.Is(err, redis.ErrClosed):
				return nil // closed on purpose: kill or close
			default:
				return err
			}
		}
		idle = 0
		s.w.b.setUp(true, nil)
		switch m := msg.(type) {
		case *redis.Message:
			s.w.onNotice(m.Channel, m.Payload)
		case *redis.Subscription:
			s.onSubscription(m)
		}
		s.maybeCheck(false)
	}
}

func (s *shard) onSubscription(m *redis.Subscription) {
	s.mu.Lock()
	_, ours := s.keys[m.Channel]
	switch m.Kind {
	case "ssubscribe":
		s.unconfirmed--
		s.confirming = time.Now()
		s.queueSyncLocked(m.Channel)
	case "sunsubscribe":
		if !s.leftLocked(m.Channel) && ours {
			// Redis unsubscribed us: the slot moved to another primary
			s.mu.Unlock()
			s.moveAway()
			return
		}
	}
	s.mu.Unlock()
}

// awaitLocked counts n subscriptions sent; the clock of confirmations
// starts when the first is awaited.
func (s *shard) awaitLocked(n int) {
	if s.unconfirmed <= 0 {
		s.confirming = time.Now()
	}
	s.unconfirmed += n
}

// unconfirmedTooLong reports whether subscriptions have waited a whole
// check interval without any being confirmed. Redis confirms each one at
// once; one that never is (a reply lost in a connection that otherwise
// works) would leave its channel unwatched for good, so the connection is
// replaced and every key subscribed again.
func (s *shard) unconfirmedTooLong() bool {
	return s.unconfirmed > 0 && time.Since(s.confirming) >= s.w.b.opts.CheckInterval
}

// moveAway sends every key of this shard back to the manager, which places
// it again on the primary that serves it now.
func (s *shard) moveAway() {
	s.mu.Lock()
	keys := make([]string, 0, len(s.keys))
	for key := range s.keys {
		keys = append(keys, key)
	}
	s.keys = make(map[string]*watch)
	ps := s.ps
	if ps != nil && len(keys) > 0 {
		s.leaveLocked(keys)
	}
	s.mu.Unlock()
	if ps != nil && len(keys) > 0 {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = s.sunsubscribe(ctx, ps, keys)
		cancel()
	}
	s.w.replace(keys)
}

// queueSyncLocked adds a confirmed key to the next check of new heads.
func (s *shard) queueSyncLocked(key string) {
	if len(s.toSync) == 0 {
		s.toSyncSince = time.Now()
	}
	s.toSync = append(s.toSync, key)
}

// syncDueLocked reports whether the confirmed keys should be checked
// before the rest of the subscriptions sent are confirmed: while a burst of
// new channels keeps subscriptions in flight, the first ones must not wait
// for a lull (their streams wait for the sync).
func (s *shard) syncDueLocked() bool {
	return len(s.toSync) >= checkBatchSize || time.Since(s.toSyncSince) >= syncBatchWait
}

// syncBatchWait is how long confirmed keys wait for others to be checked
// with them while subscriptions are still in flight.
const syncBatchWait = 5 * time.Millisecond

// maybeCheck compares heads: of channels just (re)subscribed, once all
// subscriptions are confirmed or the connection is idle; of every channel,
// once per check interval.
func (s *shard) maybeCheck(idle bool) {
	s.mu.Lock()
	var keys []string
	full := time.Since(s.lastCheck) >= s.w.b.opts.CheckInterval
	if full && s.unconfirmedTooLong() {
		ps, waiting := s.ps, s.unconfirmed
		s.mu.Unlock()
		s.w.b.log.Warn("Redis did not confirm channel subscriptions; reconnecting to subscribe again",
			zap.String("shard", s.id), zap.Int("unconfirmed", waiting))
		if ps != nil {
			s.kill(ps)
		}
		return
	}
	switch {
	case full:
		s.lastCheck = time.Now()
		for key := range s.keys {
			keys = append(keys, key)
		}
		s.toSync = s.toSync[:0]
	case len(s.toSync) > 0 && (s.unconfirmed <= 0 || idle || s.syncDueLocked()):
		// a key subscribed both by connect and by a batch racing it is
		// confirmed twice: check it once
		keys = slices.Compact(slices.Sorted(slices.Values(s.toSync)))
		s.toSync = s.toSync[:0]
	}
	s.mu.Unlock()
	if len(keys) > 0 {
		s.check(keys)
	}
}

// check reads the heads of keys in pipelines and syncs each watch.
func (s *shard) check(keys []string) {
	for len(keys) > 0 {
		n := min(checkBatchSize, len(keys))
		if again := s.checkBatch(keys[:n]); len(again) > 0 {
			// the library was missing and is loaded now: these channels
			// are not left unsynced until the next full check
			s.checkBatch(again)
		}
		keys = keys[n:]
	}
}

// checkBatchSize is how many heads one pipeline reads.
const checkBatchSize = 500

// checkBatch syncs the heads of keys; it returns the keys to check again
// because Redis did not have the library yet (it has been loaded).
func (s *shard) checkBatch(keys []string) (again []string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cmds := s.readPipelined(ctx, keys, func(int) []any { return readArgs(0, nil) })
	var moved []string
	var lerr error
	loaded := false // the keys of a shard are on one primary: one load serves the batch
	var synced []headOf
	for i, cmd := range cmds {
		reply, err := cmd.Result()
		switch {
		case functionsForbidden(err):
			s.w.b.useScripts(err)
			continue
		case isFunctionMissing(err):
			if !loaded {
				lerr, loaded = s.w.b.loadFunctions(ctx, keys[i]), true
			}
			if functionsForbidden(lerr) {
				s.w.b.useScripts(lerr)
			}
			if lerr == nil || functionsForbidden(lerr) {
				again = append(again, keys[i])
			}
			continue
		case isMoved(err):
			moved = append(moved, keys[i])
			continue
		case err != nil:
			s.w.b.classify(err)
			continue
		}
		page, _, err := parsePage(reply)
		if err != nil {
			continue
		}
		if wt := s.w.lookup(keys[i]); wt != nil {
			synced = append(synced, headOf{wt: wt, head: page.Head})
		}
	}
	s.readNewest(ctx, synced)
	for _, h := range synced {
		s.w.syncHead(h.wt, h.head, h.newest)
	}
	if len(moved) > 0 {
		s.moveAway()
	}
	return again
}

// headOf is a watch's head as a check read it, with its newest event for
// a watch that is not synced yet.
type headOf struct {
	wt     *watch
	head   replay.Position
	newest *replay.Event
}

// readNewest reads, in one pipeline, the newest event of every channel in
// heads whose watch has its first sync to come (syncHead delivers it). One
// read each in turn cost the shard's connection a round trip per channel
// while every new stream of those channels waited for the sync.
func (s *shard) readNewest(ctx context.Context, heads []headOf) {
	var first []int
	var keys []string
	for i, h := range heads {
		if !h.head.IsZero() && !h.wt.isKnown() {
			first = append(first, i)
			keys = append(keys, h.wt.key)
		}
	}
	if len(keys) == 0 {
		return
	}
	cmds := s.readPipelined(ctx, keys, func(j int) []any {
		beyond := beyondHead(heads[first[j]].head)
		return readArgs(1, &beyond) // truncated: the newest
	})
	for j, cmd := range cmds {
		reply, err := cmd.Result()
		if err != nil {
			continue // the sync goes on without it: as if never announced
		}
		page, bad, err := parsePage(reply)
		if err != nil || len(page.Events) != 1 {
			continue
		}
		h := &heads[first[j]]
		s.w.warnBad(h.wt, bad)
		h.newest = page.Events[0]
	}
}

// readPipelined runs the library's read on each of keys, with args(i) for
// keys[i], in one pipeline; each command's error is for the caller.
func (s *shard) readPipelined(ctx context.Context, keys []string, args func(i int) []any) []*redis.Cmd {
	pipe := s.client.Pipeline()
	cmds := make([]*redis.Cmd, len(keys))
	scriptsOnly := s.w.b.scriptsOnly.Load()
	for i, key := range keys {
		if scriptsOnly {
			cmds[i] = scripts[FunctionRead].EvalRO(ctx, pipe, []string{key}, args(i)...)
		} else {
			cmds[i] = pipe.FCallRo(ctx, FunctionRead, []string{key}, args(i)...)
		}
	}
	_, _ = pipe.Exec(ctx)
	return cmds
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, os.ErrDeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout())
}

func isMoved(err error) bool {
	return err != nil && (strings.HasPrefix(err.Error(), "MOVED ") || strings.HasPrefix(err.Error(), "ASK "))
}
