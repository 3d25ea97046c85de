package pubsub

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/caddy-sse/caddy-sse/internal/clusterslot"
)

// shard is the pub/sub connection to one primary and the channels it
// carries.
type shard struct {
	w      *watcher
	id     string
	client redis.UniversalClient // under mu: useClient replaces it

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
	// ctx is cancelled when the shard closes: its calls to Redis end then
	ctx    context.Context
	cancel context.CancelFunc
	closed bool
	parked bool // run waits for a channel (parkIfEmpty)
	// checking: a check of heads runs (maybeCheck); the next waits for it
	checking bool
	// denied is Redis' refusal of the shard's subscriptions (NOPERM: an
	// ACL), until a connection has all of them confirmed; its watches are
	// marked denied meanwhile (redis_denied.go).
	denied error

	// sendMu keeps sent in the order the commands go on the wire; sent
	// and the fields after it are under mu (redis_shard_refused.go)
	sendMu    sync.Mutex
	sent      []subscribeCmd
	refused   map[string]bool // keys Redis refused alone; true while asked again
	oneByOne  bool
	nextRetry time.Time
	// retriedUpTo: refused keys are asked again in turn, from this name on
	retriedUpTo string

	// gaveUp is when the shard last moved each slot's channels away,
	// Redis having told that its primary serves the slot no more (under
	// mu; gaveUpRecently)
	gaveUp map[int]time.Time
}

// newShard returns a shard whose first full check is a check interval
// away: until then every key it carries is new, and is checked once its
// subscription is confirmed (a full check at the first message read them
// all a second time).
func newShard(w *watcher, id string, client redis.UniversalClient) *shard {
	ctx, cancel := context.WithCancel(context.Background())
	return &shard{w: w, id: id, client: client, keys: make(map[string]*watch), leaving: make(map[string]int),
		lastCheck: time.Now(), wake: make(chan struct{}, 1), quit: make(chan struct{}), ctx: ctx, cancel: cancel}
}

// attach puts key on this shard; it reports whether it must be subscribed
// (false if it already was, in which case its head is compared again).
func (s *shard) attach(key string, wt *watch) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	old, had := s.keys[key]
	s.keys[key] = wt
	wt.subscribed.Store(had && old.subscribed.Load()) // a watch replaced keeps its subscription
	if had {
		s.queueSyncLocked(key)
	}
	// while Redis refuses the shard's subscriptions, a new stream of the
	// channel opens degraded at once; a confirmation clears it
	_, refused := s.refused[key]
	wt.denied.Store(s.denied != nil || refused)
	return !had
}

// useClient has the shard connect and read with c, the client go-redis
// has for its primary now: go-redis closes the client of a node that was
// out of the cluster's slot map for a minute (a primary that failed over,
// or gave its slots away), and makes a new one once it serves slots again.
func (s *shard) useClient(c redis.UniversalClient) {
	s.mu.Lock()
	s.client = c
	s.mu.Unlock()
}

// currentClient is the client the shard reads with (useClient).
func (s *shard) currentClient() redis.UniversalClient {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.client
}

func (s *shard) remove(key string) bool {
	s.mu.Lock()
	if _, ok := s.keys[key]; !ok {
		s.mu.Unlock()
		return false
	}
	delete(s.keys, key)
	ended := s.forgetRefusedLocked() && s.denied == nil
	s.mu.Unlock()
	if ended {
		s.w.b.shardAllowed(s.id, false) // no channel of its own is refused any more
	}
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
	ctx, cancel := context.WithTimeout(s.ctx, 5*time.Second)
	defer cancel()
	if err := s.ssubscribe(ctx, ps, keys); err != nil {
		s.w.b.log().Debug("subscribing failed; the connection will be replaced", zap.String("shard", s.id), zap.Error(err))
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
	ctx, cancel := context.WithTimeout(s.ctx, 5*time.Second)
	defer cancel()
	if err := s.sunsubscribe(ctx, ps, keys); err != nil {
		s.kill(ps)
	}
}

// ssubscribe subscribes keys on ps, one command per hash slot
// (slotBatches), or per key once Redis refused one of several
// (subscribeBatches).
func (s *shard) ssubscribe(ctx context.Context, ps *redis.PubSub, keys []string) error {
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	for _, batch := range s.subscribeBatches(keys) {
		if err := s.sendSubscribe(ctx, ps, batch); err != nil {
			return err
		}
	}
	return nil
}

// sunsubscribe unsubscribes keys on ps, one command per hash slot.
func (s *shard) sunsubscribe(ctx context.Context, ps *redis.PubSub, keys []string) error {
	s.sendMu.Lock()
	defer s.sendMu.Unlock()
	for _, batch := range s.slotBatches(keys) {
		s.mu.Lock()
		s.noteSentLocked(ps, batch, true)
		s.mu.Unlock()
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

// leftLocked takes the answer to an unsubscribe of key this instance sent
// (unsubscribedLocked, answeredLocked); false if none was awaited.
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

// ping has the connection answer a PING, so that its receive loop runs the
// check that attach queued for a key the shard still carried (unwatched and
// watched again before the manager ran): no confirmation comes for it, and
// on a quiet shard the new watch's first sync would wait for the next
// message or check interval, its new streams for syncWait.
func (s *shard) ping() {
	s.mu.Lock()
	ps := s.ps
	s.mu.Unlock()
	if ps == nil {
		return // connecting: every key is subscribed, and checked, then
	}
	ctx, cancel := context.WithTimeout(s.ctx, 5*time.Second)
	defer cancel()
	if err := ps.Ping(ctx); err != nil {
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
	s.cancel() // a call to a Redis that hangs must not hold up the close
	if ps != nil {
		_ = ps.Close()
	}
}

// run keeps the shard's connection up: connect, subscribe every key,
// receive until the connection fails, back off, again. A reconnection is
// counted once a connection is made after one failed, however many
// attempts failed in between.
func (s *shard) run() {
	defer s.w.wg.Done()
	backoff := 50 * time.Millisecond
	lost := false
	for {
		ps, err := s.connect()
		if ps == nil {
			return // closed
		}
		if err == nil {
			if lost {
				s.w.b.reconnects.Add(1)
				lost = false
			}
			err = s.receive(ps)
		}
		_ = ps.Close()
		s.mu.Lock()
		s.ps = nil
		closed := s.closed
		carried := make([]*watch, 0, len(s.keys))
		for _, wt := range s.keys {
			carried = append(carried, wt)
		}
		s.mu.Unlock()
		if closed {
			return
		}
		for _, wt := range carried {
			wt.lostSubscription()
		}
		if err != nil && !errors.Is(err, errDenied) {
			s.w.b.unavailable(err)
			lost = true
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
	ctx, cancel := context.WithTimeout(s.ctx, 5*time.Second)
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
	s.sent = nil
	for key := range s.refused {
		s.refused[key] = false // asked again below, with every key
	}
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
	s.parked = len(s.keys) == 0
	parked, denied := s.parked, s.denied != nil
	s.mu.Unlock()
	if parked && denied {
		s.allow(false) // no channel of its own is refused any more
	}
	return parked
}

// deny records that Redis refused the shard's subscriptions (err): its
// channels get no live events until a connection has them all confirmed.
func (s *shard) deny(err error) {
	s.setDenied(err)
	s.w.b.shardDenied(s.id, err)
}

// allow ends a refusal: every subscription of the connection is confirmed
// (confirmed), or the shard carries no channel any more.
func (s *shard) allow(confirmed bool) {
	s.setDenied(nil)
	s.w.b.shardAllowed(s.id, confirmed)
}

// setDenied records the refusal in force (nil: none) on the shard and its
// channels.
func (s *shard) setDenied(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.denied = err
	for key, wt := range s.keys {
		_, refused := s.refused[key]
		wt.denied.Store(err != nil || refused)
	}
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
	ctx, cancel := context.WithTimeout(s.ctx, 5*time.Second)
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
	s.w.b.log().Info("channels moved to another primary", zap.String("from", s.id), zap.Int("channels", len(moved)))
	s.mu.Lock()
	for _, key := range moved {
		delete(s.keys, key)
	}
	ended := s.forgetRefusedLocked() && s.denied == nil
	s.mu.Unlock()
	if ended {
		s.w.b.shardAllowed(s.id, false)
	}
	s.w.replace(moved)
}

// receive reads the connection until it fails; it returns nil if the
// connection was closed on purpose (kill or close).
func (s *shard) receive(ps *redis.PubSub) error {
	interval := s.w.b.opts.CheckInterval
	idle := 0
	for {
		wait := s.retryWait(interval)
		msg, err := ps.ReceiveTimeout(s.ctx, wait)
		if err != nil {
			switch {
			case isTimeout(err) && wait < interval:
				// not a silence: a retry of refused keys is due
				s.retryRefused(s.ctx, ps)
				continue
			case isTimeout(err):
				idle++
				if idle >= 3 {
					return errors.New("pub/sub connection silent for three check intervals")
				}
				if err := ps.Ping(s.ctx); err != nil {
					// as in ping: a PING that cannot be written is a
					// broken connection, which go-redis replaces and
					// subscribes again by itself (PubSub.releaseConn),
					// unseen here: what was announced meanwhile is lost
					// to watches not marked behind. Replaced by run, the
					// connection marks them.
					s.kill(ps)
				}
				s.maybeCheck(true)
				s.retryRefused(s.ctx, ps)
				continue
			case isMoved(err):
				s.w.b.log().Debug("a shard channel moved", zap.String("shard", s.id), zap.Error(err))
				slot := redirectedSlot(err)
				s.redirectedOldest(slot)
				s.moveSlot(slot)
				continue
			case errors.Is(err, redis.ErrClosed):
				return nil // closed on purpose: kill or close
			case isPingRefused(err):
				// a user without +ping: the refusal answers the PING as
				// a PONG would (the connection is alive, below), and is
				// no refusal of a subscription, awaited or not
				s.w.b.warnPingRefused(err)
				msg = nil
			case isNoPerm(err):
				// Redis answers, and would refuse them again on a new
				// connection: not an outage (redis_denied.go); the
				// refusal of one command holds for its keys alone
				if s.refuseOldest(s.ctx, ps, err) {
					idle = 0
					// the keys confirmed before it may be due for their
					// first sync, and no other reply may come for long
					s.maybeCheck(false)
					continue
				}
				s.deny(err)
				return errDenied
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
		s.retryRefused(s.ctx, ps)
	}
}

func (s *shard) onSubscription(m *redis.Subscription) {
	s.mu.Lock()
	_, ours := s.keys[m.Channel]
	switch m.Kind {
	case "ssubscribe":
		if wt := s.keys[m.Channel]; wt != nil {
			wt.subscribed.Store(true)
		}
		s.unconfirmed--
		s.confirming = time.Now()
		s.queueSyncLocked(m.Channel)
		refusalEnded := s.confirmedLocked(m.Channel) && len(s.refused) == 0
		if (s.denied != nil && s.unconfirmed <= 0) || (refusalEnded && s.denied == nil) {
			s.mu.Unlock()
			s.allow(true)
			return
		}
	case "sunsubscribe":
		if !s.unsubscribedLocked(m.Channel) && ours {
			// Redis unsubscribed us: the slot moved to another primary
			s.mu.Unlock()
			s.moveSlot(int(clusterslot.Of(m.Channel)))
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

// moveSlot sends the keys of this shard in slot (all of them if slot is
// negative) back to the manager, which places them again on the primary
// that serves them now. The other slots' keys stay: a resharding moves
// slots one by one, and each would otherwise have the shard subscribe all
// its channels again.
func (s *shard) moveSlot(slot int) {
	if slot >= 0 {
		s.mu.Lock()
		s.gaveUpLocked(slot) // also if none of its keys is left here
		s.mu.Unlock()
	}
	s.moveSlots(func(of int) bool { return slot < 0 || of == slot })
}

// moveSlotsOf moves the slots of keys (moveSlot).
func (s *shard) moveSlotsOf(keys []string) {
	slots := make(map[int]bool, 1)
	for _, key := range keys {
		slots[int(clusterslot.Of(key))] = true
	}
	s.moveSlots(func(of int) bool { return slots[of] })
}

// moveSlots moves the keys whose slot is in (moveSlot). They are not
// unsubscribed: a primary that gives a slot up unsubscribes its channels
// itself (the unsubscribes it sends then are what moves them, or a MOVED
// to a subscription that never took), and would answer an unsubscribe of
// them with a MOVED.
func (s *shard) moveSlots(in func(slot int) bool) {
	s.mu.Lock()
	keys := make([]string, 0, len(s.keys))
	var moved []*watch
	for key, wt := range s.keys {
		if slot := int(clusterslot.Of(key)); in(slot) {
			keys = append(keys, key)
			moved = append(moved, wt)
			delete(s.keys, key)
			s.gaveUpLocked(slot)
		}
	}
	ended := s.forgetRefusedLocked() && s.denied == nil
	s.mu.Unlock()
	for _, wt := range moved {
		// unsubscribed until the new primary's check: a new stream reads
		// the head itself meanwhile, as after a lost connection, instead
		// of starting at the last event delivered before the move
		wt.lostSubscription()
	}
	if ended {
		s.w.b.shardAllowed(s.id, false)
	}
	s.w.replace(keys)
}

// gaveUpLocked notes that the shard's primary gave slot up (gaveUpRecently).
func (s *shard) gaveUpLocked(slot int) {
	if s.gaveUp == nil {
		s.gaveUp = make(map[int]time.Time)
	}
	s.gaveUp[slot] = time.Now()
}

// gaveUpRecently reports whether the shard moved the channels of key's
// slot away less than slotGaveUpHold ago. The manager then does not place
// key here again, though the cluster's state names this primary: go-redis
// read that state from a node not told of the move yet, and reads it again
// only 200 ms after. Placed here, the channel got a MOVED and was moved
// away again, in a loop as fast as the round trips went until then (a
// thousand SSUBSCRIBE refused by the old primary for one channel of a
// moved slot, per instance). A slot that really came back to the primary
// within the hold is placed once it ends.
func (s *shard) gaveUpRecently(key string) bool {
	slot := int(clusterslot.Of(key))
	s.mu.Lock()
	defer s.mu.Unlock()
	at, ok := s.gaveUp[slot]
	if ok && time.Since(at) >= slotGaveUpHold {
		delete(s.gaveUp, slot)
		return false
	}
	return ok
}

// slotGaveUpHold is how long the channels of a slot a shard's primary gave
// up are not placed on it again (gaveUpRecently): a little over go-redis'
// pause between two reads of the cluster's state. A state that names the
// old primary longer (the nodes asked were told later) costs one refused
// SSUBSCRIBE per hold.
const slotGaveUpHold = 250 * time.Millisecond
