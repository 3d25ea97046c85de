package caddysse

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/caddy-sse/caddy-sse/pubsub"
	"github.com/caddy-sse/caddy-sse/replay"
	"github.com/caddy-sse/caddy-sse/wire"
)

// errHistoryGap ends a stream whose missed events are no longer all in the
// history: its client reconnects with its Last-Event-ID and is told that its
// replay was truncated, instead of silently missing events.
var errHistoryGap = errors.New("missed events are no longer in the history")

// errHistoryRewritten ends a stream whose channel's history no longer
// contains events it wrote (lost in a failover): like errHistoryGap, the
// reconnect is told that its replay was truncated.
var errHistoryRewritten = errors.New("the channel's history was rewritten")

// errNeedsHistory stops a writer that may not block (an event loop's) at
// an event that needs the history read first.
var errNeedsHistory = errors.New("the stream needs its history read")

// errClosing interrupts a stream's writing once it has been told to close,
// so that it closes without first writing all that is queued.
var errClosing = errors.New("stream closing")

// queued is an event waiting to be written, with the slot of its channel.
type queued struct {
	ev   *replay.Event
	slot int
}

// closeNotice tells a stream to end: with a server_closing event, or, for
// a slow client, with a comment.
type closeNotice struct {
	reason string
	retry  time.Duration
	slow   bool
}

// slowClient tells a stream that its queue stayed full too long.
var slowClient = &closeNotice{slow: true}

// stream is one open SSE connection: the channels it reads, the position it
// has written for each, and the bounded queue of live events waiting to be
// written. The hub's fan-out (any goroutine) fills the queue through
// Deliver; the connection's own goroutine drains it and writes.
type stream struct {
	// The fields written or read at every delivery come first, in four
	// cache lines; those of a stream's start, end and rare paths follow.
	// 10k streams do not fit in the caches: each line a delivery touches is
	// a miss.
	h      *Handler
	cursor []replay.ChannelPosition
	// fresh marks the slots that started at their channel's head (the
	// client's cursor did not name them) and have written nothing yet: see
	// writeFresh and addSinceOpened.
	fresh slotBits
	// ids and buf format what the stream writes; an event loop lends a
	// taken-over stream its own while it writes it (lendScratch), so that
	// idle streams keep neither.
	ids *replay.CursorEncoder
	buf []byte
	out streamWriter

	mu       sync.Mutex
	overflow bool
	// overflowLogged: the writer logged the overflow under way (queueFull);
	// the writer's, cleared with overflow under mu (resumeLive)
	overflowLogged bool
	begun          bool  // registered and counted (see begin, release)
	shard          uint8 // the copy of the per-delivery metrics it writes: its event loop's, if it has one
	beatDue        atomic.Bool
	degraded       atomic.Bool // opened without its history; see degraded.go
	uncounted      uint32      // events written since the metrics last counted them (per flush)
	pending        []queued
	spare          []queued
	queuedLen      int64
	dropped        int64 // live events not queued since the last count

	lastWrite      atomic.Int64 // Unix nanoseconds of the last flush
	closing        atomic.Pointer[closeNotice]
	tk             atomic.Pointer[tconn] // set once an event loop writes it (takeover)
	eventsSent     int64
	batchStartedMs int64 // when the stream took its queue, for latency
	// batchResumed says that the batch drainBatch gets next is the rest of
	// one it took already (an event loop hands it to a goroutine at a gap):
	// its take was observed and timed then, not again
	batchResumed bool

	names         []string                // channels as the client names them
	keys          []string                // channels as the hub names them (namespaced)
	pooled        atomic.Pointer[drained] // set while the drainer writes it (drainer.go)
	overflowSince atomic.Int64            // Unix nanoseconds the queue overflowed; 0 if it has not
	// hurry, if set, brings the deadline of a write in flight down to
	// lastWordsTimeout, from any goroutine: a stream told to close must not
	// wait the whole slow-client timeout on a client that stopped reading
	// (a stop waits for it). Set by whoever makes the stream's writer.
	hurry atomic.Pointer[func()]
	// net is its net/http writer while it writes there (not taken over):
	// the registry cuts its calls blocked for the slow-client timeout.
	net  atomic.Pointer[httpStreamWriter]
	rare atomic.Pointer[rareState] // what few streams need (rareState); nil until one does

	who    client // who opened it, for caps, throttles and logs
	remote string // the client's address, for logs
	began  int64  // when it began streaming, Unix nanoseconds
	sub    *pubsub.Subscription
	adm    *admission
}

// roundClock is a writer that runs rounds of many streams' writes and
// reads the clock once for several of them (an event loop).
type roundClock interface {
	roundNow() int64 // Unix nanoseconds; 0 if not in a round
}

// now is the time to stamp a write with, Unix nanoseconds: its event
// loop's round clock, within a few µs of the system's (clockEvery), or the
// system's.
func (s *stream) now() int64 {
	if rc, ok := s.out.(roundClock); ok {
		if t := rc.roundNow(); t != 0 {
			return t
		}
	}
	return time.Now().UnixNano()
}

// lasted is how long the stream has been streaming.
func (s *stream) lasted() time.Duration { return time.Duration(s.h.now().UnixNano() - s.began) }

func newStream(h *Handler, names []string) *stream {
	s := &stream{
		h:      h,
		names:  names,
		keys:   names, // the same without a namespace: one slice less per stream
		cursor: make([]replay.ChannelPosition, len(names)),
		fresh:  newSlotBits(len(names)),
		shard:  h.metrics.goroutineShard(),
	}
	if h.Namespace != "" {
		s.keys = make([]string, len(names))
	}
	for i, name := range names {
		s.keys[i] = h.channelKey(name)
		s.cursor[i].Hash = replay.HashChannel(s.keys[i])
	}
	return s
}

// Deliver queues a live event; it never blocks. When the queue is full the
// stream stops taking live events and will catch up from the history; the
// registry's ticker ends it if it stays so for the slow-client timeout.
func (s *stream) Deliver(slot int, ev *replay.Event) {
	size := int64(len(ev.Frame))
	s.mu.Lock()
	switch {
	case s.overflow:
		s.dropped++
		s.noteLost(slot, ev)
	case len(s.pending) >= s.h.Queue || (len(s.pending) > 0 && s.queuedLen+size > s.h.QueueBytes):
		// an empty queue takes any event: a frame of many short lines can
		// be larger than queue_bytes, and would otherwise overflow every
		// stream at once
		s.overflow = true
		s.dropped++
		s.overflowSince.Store(time.Now().UnixNano())
		s.noteLost(slot, ev)
	default:
		s.pending = append(s.pending, queued{ev: ev, slot: slot})
		s.queuedLen += size
	}
	s.mu.Unlock()
	s.poke()
}

// poke wakes the stream's goroutine (or schedules it on its event loop)
// if it is not awake already.
func (s *stream) poke() {
	if tk := s.tk.Load(); tk != nil {
		tk.schedule(s)
		return
	}
	if s.pooled.Load() != nil {
		s.h.drainer.schedule(s)
	}
}

// close asks the stream to end with a server_closing event.
func (s *stream) close(n *closeNotice) {
	if s.closing.CompareAndSwap(nil, n) {
		if hurry := s.hurry.Load(); hurry != nil {
			(*hurry)()
		}
	}
	s.poke()
}

// setHurry sets how a write in flight is hurried (see hurry); nil for none.
func (s *stream) setHurry(hurry func()) {
	if hurry == nil {
		s.hurry.Store(nil)
		return
	}
	s.hurry.Store(&hurry)
}

// take swaps the queue out, so that Deliver fills the spare while the
// stream writes; both slices are reused, so steady state allocates nothing.
func (s *stream) take() ([]queued, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	batch := s.pending
	s.pending = s.spare[:0]
	s.spare = batch
	s.queuedLen = 0
	return batch, s.overflow
}

// hasQueued reports whether live events wait in the queue.
func (s *stream) hasQueued() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.pending) > 0
}

// rareState is what few streams need, kept apart so that every other
// stream is smaller (an idle stream is one allocation of 384 bytes): a
// stream that opened degraded (degrade), and the fallback-local events a
// full queue did not take (noteLost). Made once, by whichever needs it
// first; lostLocal is guarded by the stream's mu, the rest belongs to the
// stream's writer.
type rareState struct {
	idText string // the client's cursor, for the replay once Redis is back
	cause  error  // why the stream opened degraded
	// unknown marks the slots whose position a degraded stream does not
	// know: they are left out of its ids until it writes one of their
	// events; nil once it recovered
	unknown slotBits
	// pending marks the channels a stream degraded in part waits for (those
	// Redis refuses this instance); nil if it is degraded as a whole or not
	pending slotBits
	// truncCounted: the metrics counted its replay as truncated (countStart)
	truncCounted bool
	// opened holds where this instance last saw each channel the cursor
	// does not name (zero: not seen); nil if it saw none
	opened []replay.Position
	// lostLocal holds, per slot, the position of a fallback-local event
	// the full queue did not take (nil if none): no history has it, so
	// the stream cannot catch up on it (see endAtLostLocal)
	lostLocal []replay.Position
	// beforeLocal holds, per slot, where the stream was in the shared
	// history when it wrote its first fallback-local event of a run of
	// them (nil if it wrote none): see noteLocal and leaveLocal
	beforeLocal []sharedPosition
}

// sharedPosition is a stream's position in a channel's shared history,
// kept while its cursor holds the fallback-local events it wrote after it.
type sharedPosition struct {
	pos       replay.Position // in the shared history
	fresh     bool            // the slot was fresh (writeFresh)
	lastLocal replay.Position // the last local event written after it
	held      bool
}

// rareState returns the stream's rareState, making it if it has none.
func (s *stream) rareState() *rareState {
	if r := s.rare.Load(); r != nil {
		return r
	}
	s.rare.CompareAndSwap(nil, new(rareState))
	return s.rare.Load()
}

// unknownSlots returns the slots whose position a degraded stream does
// not know yet (nil: none).
func (s *stream) unknownSlots() slotBits {
	if r := s.rare.Load(); r != nil {
		return r.unknown
	}
	return nil
}

// noteLost remembers a fallback-local event that the full queue did not
// take (called with s.mu held).
func (s *stream) noteLost(slot int, ev *replay.Event) {
	if !ev.Local {
		return
	}
	r := s.rareState()
	if r.lostLocal == nil {
		r.lostLocal = make([]replay.Position, len(s.keys))
	}
	r.lostLocal[slot] = ev.Pos
}

// noteLocal remembers, before the stream writes a fallback-local event of
// slot (at local), where the stream is in the channel's shared history,
// unless it wrote a local event there just before: the local events follow
// no history, and once Redis delivers again its events follow that
// position, not the local ones (leaveLocal).
func (s *stream) noteLocal(slot int, local replay.Position) {
	r := s.rareState()
	if r.beforeLocal == nil {
		r.beforeLocal = make([]sharedPosition, len(s.keys))
	}
	b := &r.beforeLocal[slot]
	if !b.held || s.cursor[slot].Pos != b.lastLocal {
		*b = sharedPosition{pos: s.cursor[slot].Pos, fresh: s.fresh.has(slot), held: true}
	}
	b.lastLocal = local
}

// leaveLocal puts a slot whose cursor holds the fallback-local events it
// wrote last back where it was in the shared history before them, for an
// event of that history (live, or read to fill a gap). Without it the
// first event Redis delivered once back did not follow the local one: the
// stream read the history after a local position, which no history has,
// and ended as truncated — though it missed nothing, and its reconnect was
// replayed the channel's kept history again. The local events stay in the
// client's Last-Event-ID until the stream writes a shared one, so that a
// reconnect meanwhile is told it was truncated (SPEC S9). A cursor moved
// since by anything else (a degraded stream's start) is left alone.
func (s *stream) leaveLocal(slot int) {
	r := s.rare.Load()
	if r == nil || r.beforeLocal == nil {
		return
	}
	b := &r.beforeLocal[slot]
	if !b.held {
		return
	}
	if s.cursor[slot].Pos == b.lastLocal {
		s.cursor[slot].Pos = b.pos
		if b.fresh {
			s.fresh.set(slot)
		}
	}
	*b = sharedPosition{}
}

// resumeLive makes the stream take live events again after an overflow.
// Called before reading the history, so that events published meanwhile are
// either in what is read or in the queue (or both: duplicates are skipped).
// It does not if fallback-local events were not queued meanwhile (no
// history has them): it returns their positions instead, in the same
// critical section, so that none is dropped after the look.
func (s *stream) resumeLive() []replay.Position {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r := s.rare.Load(); r != nil && r.lostLocal != nil {
		return r.lostLocal
	}
	s.overflow = false
	s.overflowLogged = false
	s.overflowSince.Store(0)
	return nil
}

// endAtLostLocal ends a stream whose queue did not take fallback-local
// events (lost, per slot): it cannot catch up on them, so it
// writes an id-only block that puts each such channel at one of them (it
// moves the client's Last-Event-ID without dispatching anything) and ends,
// so that the reconnect is told those channels were truncated instead of
// missing the events silently.
func (s *stream) endAtLostLocal(lost []replay.Position) error {
	for slot, pos := range lost {
		if !pos.IsZero() {
			s.cursor[slot].Pos = pos
			s.fresh.clear(slot)
			if unknown := s.unknownSlots(); unknown != nil {
				unknown.clear(slot)
			}
		}
	}
	if err := s.writeID(); err != nil {
		return err
	}
	if s.closing.Load() != nil {
		return errClosing // its server_closing follows, and flushes
	}
	if err := s.flush(); err != nil {
		return err
	}
	return errHistoryGap
}

// writeID writes an id-only block of the stream's cursor: it moves the
// client's Last-Event-ID without dispatching anything.
func (s *stream) writeID() error {
	s.buf = s.appendIDBlock(s.buf[:0])
	return s.out.Write(s.buf)
}

// appendIDBlock appends the id line of the stream's cursor and the blank
// line that ends its block.
func (s *stream) appendIDBlock(buf []byte) []byte {
	if s.ids == nil {
		s.ids = new(replay.CursorEncoder)
	}
	return wire.AppendID(buf, s.ids.Encode(s.idEntries()))
}

// unloggedOverflow reports whether the queue overflowed without the writer
// taking it since (a write blocked on a client that stopped reading, the
// usual slow client), and how deep it is: the stream's end logs it then.
func (s *stream) unloggedOverflow() (bool, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.overflow && !s.overflowLogged, len(s.pending)
}

// takeDropped returns how many live events were not queued since the last
// call, for the metrics.
func (s *stream) takeDropped() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := s.dropped
	s.dropped = 0
	return n
}

// writeStep is what a stream written by the drainer's goroutines does at
// each wake-up: its last words if it is told to close,
// or what is queued. It reports whether the stream ended, and with what.
func (s *stream) writeStep(ctx context.Context) (ended bool, err error) {
	if n := s.closing.Load(); n != nil {
		s.releaseBeforeClosing(n)
		return true, s.writeClosing(n)
	}
	if err := s.drain(ctx); err != nil {
		if errors.Is(err, errClosing) {
			n := s.closing.Load()
			s.releaseBeforeClosing(n)
			return true, s.writeClosing(n)
		}
		return true, err
	}
	return false, nil
}

// drain writes what is queued (catching up from the history after an
// overflow), or a heartbeat if the stream is due one, and flushes once.
func (s *stream) drain(ctx context.Context) error {
	if s.degraded.Load() {
		return s.drainDegraded(ctx)
	}
	batch, overflowed := s.take()
	_, err := s.drainBatch(ctx, batch, overflowed)
	return err
}

// drainBatch writes a batch taken from the queue, as drain does. On a
// writer that may not block it stops at the first event that needs the
// history (a gap) and returns the rest of the batch with errNeedsHistory,
// having flushed what it wrote.
func (s *stream) drainBatch(ctx context.Context, batch []queued, overflowed bool) ([]queued, error) {
	if len(batch) > 0 && !s.batchResumed {
		s.batchStartedMs = s.now() / int64(time.Millisecond)
		s.h.metrics.queueDepth(s.shard, len(batch))
	}
	s.batchResumed = false
	if overflowed {
		s.queueFull(len(batch))
	}
	wrote := false
	for i := range batch {
		n, err := s.writeLive(ctx, batch[i])
		if errors.Is(err, errNeedsHistory) {
			rest := batch[i:]
			if wrote {
				err = errors.Join(err, s.flush())
			}
			return rest, err
		}
		if err != nil {
			return nil, err
		}
		wrote = wrote || n
		batch[i] = queued{} // let the GC have events we no longer hold
	}
	if overflowed {
		if lost := s.resumeLive(); lost != nil {
			return nil, s.endAtLostLocal(lost)
		}
		s.h.metrics.catchUp()
		pending := s.pendingSlots()
		for slot := range s.keys {
			if pending != nil && pending.has(slot) {
				continue // not started: its start reads the history
			}
			n, err := s.repair(ctx, slot)
			if err != nil {
				return nil, err
			}
			wrote = wrote || n
		}
	}
	if !wrote {
		return nil, s.heartbeatIfDue()
	}
	return nil, s.flush()
}

// heartbeatIfDue writes a heartbeat comment if the stream is due one.
func (s *stream) heartbeatIfDue() error {
	if !s.beatDue.Load() {
		return nil
	}
	s.buf = wire.AppendComment(s.buf[:0], "heartbeat")
	if err := s.out.Write(s.buf); err != nil {
		return err
	}
	return s.flush()
}

func (s *stream) flush() error {
	s.countDelivered()
	if err := s.out.Flush(); err != nil {
		return err
	}
	s.beatDue.Store(false)
	s.lastWrite.Store(s.now())
	return nil
}

// countDelivered adds the events written since the last count to the
// metrics: once per flush, not per event, to keep the shared counter cool.
func (s *stream) countDelivered() {
	s.h.metrics.delivered(s.shard, int64(s.uncounted))
	s.uncounted = 0
}

// queueFull logs the start of an overflow episode, once per episode: it is
// seen here when the stream takes the queue that overflowed, or when the
// stream ends without having taken it (unloggedOverflow).
func (s *stream) queueFull(depth int) {
	s.overflowLogged = true
	s.h.metrics.dropped(s.takeDropped())
	s.h.logger.Warn("sse_queue_full",
		zap.String("principal", s.who.principal),
		zap.Strings("channels", s.names),
		zap.Int("queue_depth", depth),
		zap.Int("queue_limit", s.h.Queue),
		zap.Int64("queue_bytes_limit", s.h.QueueBytes))
}

// writeLive writes a live event unless the stream has written it already
// (it was in the replay); a gap before it is filled from the history first.
func (s *stream) writeLive(ctx context.Context, q queued) (bool, error) {
	if q.ev.Local {
		// fallback local: no history to follow; its epoch makes any cursor
		// that includes it truncated later
		s.noteLocal(q.slot, q.ev.Pos)
		return true, s.writeLiveEvent(q)
	}
	s.leaveLocal(q.slot)
	at := s.cursor[q.slot].Pos
	if s.fresh.has(q.slot) {
		wrote, err, done := s.writeFresh(q, at)
		if done {
			return wrote, err
		}
		at = s.cursor[q.slot].Pos
	}
	if at.Contradicts(q.ev.Pos) {
		// a failover lost events this stream wrote, and their seqs went to
		// new events: end, so that the reconnect is told it was truncated
		return false, errHistoryRewritten
	}
	if at.Covers(q.ev.Pos) {
		return false, nil
	}
	if at.Follows(q.ev.Pos) {
		return true, s.writeLiveEvent(q)
	}
	if !s.out.MayBlock() {
		return false, errNeedsHistory
	}
	wrote, err := s.repair(ctx, q.slot)
	if err != nil {
		return false, err
	}
	at = s.cursor[q.slot].Pos
	switch {
	case at.Covers(q.ev.Pos):
		return wrote, nil
	case at.Follows(q.ev.Pos):
		return true, s.writeLiveEvent(q)
	default:
		return wrote, errHistoryGap
	}
}

// writeFresh writes a live event of a slot that started at its channel's
// head and has written nothing yet, if it is of another epoch than that
// head (done is false otherwise: the usual rules apply). The history was
// lost after the head was read (a flush, an eviction): the slot starts over
// from the new epoch's first event instead of ending the stream, since its
// client holds no position there that could be truncated; so does a slot
// whose head a failover lost (an event of its epoch contradicts it). (An
// event of the head's own epoch that the head counts is not written: the
// Redis watcher delivers a channel's newest event when it starts watching
// it, and re-delivers older ones when it repairs; a degraded stream gets
// what was published since it opened from addSinceOpened.)
func (s *stream) writeFresh(q queued, at replay.Position) (wrote bool, err error, done bool) {
	pos := q.ev.Pos
	switch {
	case at.Contradicts(pos):
		// a failover lost the head the slot started at, and pos took a
		// seq of the lost events: published after the stream opened
		return true, s.writeLiveEvent(q), true
	case at.IsZero(), pos.Epoch == at.Epoch:
		return false, nil, false
	case pos.Seq == 1:
		return true, s.writeLiveEvent(q), true
	case !s.out.MayBlock():
		return false, errNeedsHistory, true
	default:
		s.cursor[q.slot].Pos = replay.Position{} // repair reads the epoch from its start
		return false, nil, false
	}
}

// repair writes the events of a channel's history that follow the stream's
// position. If the history no longer follows on from it, the stream ends.
//
// It reads at most catchUpLimit events: the channel's history is that of
// its publishers (other handlers of the hub may keep more than this one),
// and ending the stream would only have its reconnect replay the same
// events, up to replay_limit.
func (s *stream) repair(ctx context.Context, slot int) (bool, error) {
	s.leaveLocal(slot)
	at := s.cursor[slot].Pos
	page, err := s.readHistory(ctx, slot, &at, s.catchUpLimit())
	if err != nil {
		return false, err
	}
	if page.Truncated {
		return false, errHistoryGap
	}
	for _, ev := range page.Events {
		if err := s.writeEvent(slot, ev); err != nil {
			return true, err
		}
	}
	return len(page.Events) > 0, nil
}

// catchUpLimit is the most events a stream reads to fill a gap (a queue
// overflow, a missed announcement): as many as a reconnect would replay
// (replay_limit), or as its handler keeps (history) if that is more. The
// history it reads may hold more than the handler's own history: handlers
// that share a hub share its channels, and each publishes with its own
// history settings. A gap the history covers is filled as long as the
// stream's own limits allow, instead of the stream ending as truncated.
func (s *stream) catchUpLimit() int { return max(s.h.ReplayLimit, s.h.HistorySize) }

// readHistory reads the events of a channel's history after from (the
// newest if from is nil), at most limit. Once the stream is open it gives up
// with errClosing when the stream's handler closes its streams (a reload, a
// stop), which tells them first: a read from a Redis that hangs (a
// catch-up, a degraded stream's recovery) would otherwise keep a stream
// told to close from saying so and ending until go-redis gives up on it
// (20 s by default; it does not interrupt a read when its context is
// canceled), and a stop waits for it. The read runs on a goroutine of its
// own for that, which ends with it. A stream that is still opening is not
// registered, so it is not told: its read stays on its goroutine.
func (s *stream) readHistory(ctx context.Context, slot int, from *replay.Position, limit int) (replay.Page, error) {
	return askUntilClosing(ctx, s, func(ctx context.Context) (replay.Page, error) {
		return s.h.hub.Read(ctx, s.keys[slot], from, limit)
	})
}

// askUntilClosing returns what ask answers, or errClosing as soon as
// closing begins: a backend that hangs does not hold a reload or a stop up
// (the abandoned ask is cancelled, and makes no more attempts). The
// embedded hub never waits: it is asked on this goroutine.
func askUntilClosing[T any](ctx context.Context, s *stream, ask func(context.Context) (T, error)) (T, error) {
	r := s.h.streams
	if _, embedded := s.h.hub.Broker().(*pubsub.Memory); r == nil || embedded || !s.begun {
		return ask(ctx)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type answer struct {
		v   T
		err error
	}
	done := make(chan answer, 1)
	go func() {
		v, err := ask(ctx)
		done <- answer{v, err}
	}()
	select {
	case got := <-done:
		return got.v, got.err
	case <-r.reads.Done():
		var zero T
		return zero, errClosing
	}
}

// writeLiveEvent writes a queued event and records how long it took from
// its publish until the stream took it from the queue.
func (s *stream) writeLiveEvent(q queued) error {
	s.h.metrics.latency(s.shard, s.batchStartedMs-q.ev.Pos.Time)
	return s.writeEvent(q.slot, q.ev)
}

// writeEvent writes an event's shared frame and this stream's id line,
// which is the stream's cursor after the event. A stream told to close
// stops here.
func (s *stream) writeEvent(slot int, ev *replay.Event) error {
	if s.closing.Load() != nil {
		return errClosing
	}
	s.cursor[slot].Pos = ev.Pos
	s.fresh.clear(slot)
	if unknown := s.unknownSlots(); unknown != nil {
		unknown.clear(slot)
	}
	if s.ids == nil {
		s.ids = new(replay.CursorEncoder)
	}
	s.buf = wire.AppendID(s.buf[:0], s.ids.Encode(s.idEntries()))
	if err := s.out.Write(ev.Frame); err != nil {
		return err
	}
	s.eventsSent++
	s.uncounted++
	return s.out.Write(s.buf)
}

// writeClosing tells the client that the server is closing (reload or
// shutdown) and when to reconnect, then ends the stream. A slow client is
// told why it is cut off, if that can still be written in a short while.
func (s *stream) writeClosing(n *closeNotice) error {
	if n.slow {
		s.buf = wire.AppendComment(s.buf[:0], "connection closed: slow client")
		return s.out.WriteLast(s.buf)
	}
	s.buf = appendClosing(s.appendResumeID(s.buf[:0]), n)
	// last words: a client that does not take them within lastWordsTimeout
	// is not waited for (a stop waits for every stream)
	return s.out.WriteLast(s.buf)
}

// appendResumeID appends, before server_closing, an id-only block of the
// stream's cursor, so that the reconnect resumes where the stream is: a
// stream that wrote no event yet had given its client no id, and its
// reconnect started live, missing what was published while it waited
// (close_jitter) — the reload it was told of lost events after all. (It
// also keeps the client's position under the letter of the WHATWG
// standard, whose last event ID buffer starts empty on each connection.)
// A degraded stream does not know its channels' positions: it says
// nothing, and its client keeps the id it came with (said back at its
// opening, for the letter of WHATWG: open).
func (s *stream) appendResumeID(buf []byte) []byte {
	if s.degraded.Load() {
		return buf
	}
	return s.appendIDBlock(buf)
}

// appendClosing appends the retry hint and server_closing event of n.
func appendClosing(buf []byte, n *closeNotice) []byte {
	buf = wire.AppendRetry(buf, n.retry.Milliseconds())
	buf = wire.AppendEvent(buf, wire.TypeServerClosing, []byte(`{"reason":"`+n.reason+`"}`))
	return wire.AppendEnd(buf)
}

// slotBits holds a bit per slot of a stream.
type slotBits []uint64

func newSlotBits(n int) slotBits { return make(slotBits, (n+63)/64) }

func (b slotBits) has(slot int) bool { return b[slot/64]&(1<<(slot%64)) != 0 }

func (b slotBits) set(slot int) { b[slot/64] |= 1 << (slot % 64) }

func (b slotBits) clear(slot int) { b[slot/64] &^= 1 << (slot % 64) }
