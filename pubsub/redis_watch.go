package pubsub

import (
	"context"
	"errors"
	"net"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
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

// watch is one watched channel. mu serializes its deliveries.
type watch struct {
	channel, key string

	mu         sync.Mutex
	last       replay.Position
	known      bool
	warnedType bool
}

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
	if wanted {
		wt := &watch{channel: channel, key: key}
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
	w.mu.Lock()
	wt := w.byKey[key]
	w.mu.Unlock()
	if wt == nil || !wt.mu.TryLock() {
		return replay.Position{}, false
	}
	defer wt.mu.Unlock()
	return wt.last, wt.known
}

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
func (w *watcher) syncHead(wt *watch, head replay.Position) {
	wt.mu.Lock()
	defer wt.mu.Unlock()
	switch {
	case !wt.known:
		wt.last, wt.known = head, true
		if ev := w.newest(wt, head); ev != nil {
			w.deliverLocked(wt, ev)
		}
	case head != wt.last:
		w.repairLocked(wt)
	}
}

// newest returns the channel's newest event, if it is still the one at
// head.
func (w *watcher) newest(wt *watch, head replay.Position) *replay.Event {
	if head.IsZero() {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	beyond := replay.Position{Epoch: head.Epoch, Seq: head.Seq + 1, Time: head.Time}
	page, bad, err := w.b.read(ctx, wt.key, &beyond, 1) // truncated: the newest
	if err != nil || len(page.Events) != 1 || page.Events[0].Pos != head {
		return nil
	}
	w.warnBad(wt, bad)
	return page.Events[0]
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
	lastCheck   time.Time
	wake        chan struct{}
	quit        chan struct{}
	closed      bool
}

func newShard(w *watcher, id string, client redis.UniversalClient) *shard {
	return &shard{w: w, id: id, client: client, keys: make(map[string]*watch),
		wake: make(chan struct{}, 1), quit: make(chan struct{})}
}

// attach puts key on this shard; it reports whether it must be subscribed
// (false if it already was, in which case its head is compared again).
func (s *shard) attach(key string, wt *watch) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, had := s.keys[key]
	s.keys[key] = wt
	if had {
		s.toSync = append(s.toSync, key)
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
	ps := s.ps
	if ps != nil {
		s.awaitLocked(len(keys))
	}
	s.mu.Unlock()
	if ps == nil {
		return // the connection subscribes every key when it (re)connects
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := ps.SSubscribe(ctx, keys...); err != nil {
		s.w.b.log.Debug("subscribing failed; the connection will be replaced", zap.String("shard", s.id), zap.Error(err))
		s.kill(ps)
	}
}

func (s *shard) unsubscribe(keys []string) {
	s.mu.Lock()
	ps := s.ps
	s.mu.Unlock()
	if ps == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := ps.SUnsubscribe(ctx, keys...); err != nil {
		s.kill(ps)
	}
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
		ps := s.connect()
		if ps == nil {
			return // closed
		}
		err := s.receive(ps)
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
		select {
		case <-time.After(backoff):
		case <-s.wake:
		case <-s.quit:
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
func (s *shard) connect() *redis.PubSub {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s.mu.Lock()
	if s.closed {
		// close ran meanwhile: a connection made now would never be closed
		s.mu.Unlock()
		return nil
	}
	ps := s.client.SSubscribe(ctx)
	s.ps = ps
	keys := make([]string, 0, len(s.keys))
	for key := range s.keys {
		keys = append(keys, key)
	}
	s.unconfirmed = 0
	s.awaitLocked(len(keys))
	s.toSync = s.toSync[:0]
	s.mu.Unlock()
	if len(keys) > 0 {
		if err := ps.SSubscribe(ctx, keys...); err != nil {
			s.kill(ps)
		}
	}
	return ps
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
		s.toSync = append(s.toSync, m.Channel)
	case "sunsubscribe":
		if ours {
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
	s.mu.Unlock()
	if ps != nil && len(keys) > 0 {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = ps.SUnsubscribe(ctx, keys...)
		cancel()
	}
	s.w.replace(keys)
}

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
	case len(s.toSync) > 0 && (s.unconfirmed <= 0 || idle):
		keys = append(keys, s.toSync...)
		s.toSync = s.toSync[:0]
	}
	s.mu.Unlock()
	if len(keys) > 0 {
		s.check(keys)
	}
}

// check reads the heads of keys in pipelines and syncs each watch.
func (s *shard) check(keys []string) {
	const batch = 500
	for len(keys) > 0 {
		n := min(batch, len(keys))
		if again := s.checkBatch(keys[:n]); len(again) > 0 {
			// the library was missing and is loaded now: these channels
			// are not left unsynced until the next full check
			s.checkBatch(again)
		}
		keys = keys[n:]
	}
}

// checkBatch syncs the heads of keys; it returns the keys to check again
// because Redis did not have the library yet (it has been loaded).
func (s *shard) checkBatch(keys []string) (again []string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pipe := s.client.Pipeline()
	cmds := make([]*redis.Cmd, len(keys))
	scriptsOnly := s.w.b.scriptsOnly.Load()
	for i, key := range keys {
		if scriptsOnly {
			cmds[i] = scripts[FunctionRead].EvalRO(ctx, pipe, []string{key}, 0)
		} else {
			cmds[i] = pipe.FCallRo(ctx, FunctionRead, []string{key}, 0)
		}
	}
	_, _ = pipe.Exec(ctx) // each command's error is looked at below
	var moved []string
	var lerr error
	loaded := false // the keys of a shard are on one primary: one load serves the batch
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
			s.w.syncHead(wt, page.Head)
		}
	}
	if len(moved) > 0 {
		s.moveAway()
	}
	return again
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, os.ErrDeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout())
}

func isMoved(err error) bool {
	return err != nil && (strings.HasPrefix(err.Error(), "MOVED ") || strings.HasPrefix(err.Error(), "ASK "))
}
