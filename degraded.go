package caddysse

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/caddy-sse/caddy-sse/pubsub"
	"github.com/caddy-sse/caddy-sse/replay"
	"github.com/caddy-sse/caddy-sse/wire"
)

// A stream opened while its backend (Redis) cannot be reached is degraded
// (SPEC S9): it opens live-only with one sse_degraded event, and as soon as
// the backend answers again it reads its starting point as a stream that
// just opened would — the replay after the client's cursor, or the heads
// with what was published since it opened (addSinceOpened) — and writes
// it, then continues live. Until then it writes nothing but
// heartbeats: without the history it cannot know where its channels are.

// A stream may also wait for some of its channels only: those whose
// subscription Redis refuses this instance (an ACL that grants the others,
// which may never grant these). Its other channels start and go on live as
// on any stream; the refused ones are pending (rareState.pending) and are
// started as a degraded stream would be, each once Redis accepts it.

// degrade marks the stream degraded — as a whole (slots nil), or only the
// channels of slots —, keeping the client's cursor for the
// replay once the backend is back. Until then the ids it writes (of
// fallback-local events) carry the client's positions for the channels its
// cursor names, and leave out those whose position it does not know: the
// zero position would have a reconnect replay their whole history.
//
// A channel the cursor does not name starts where this instance last saw
// it, if it was following it (another stream reads it): the events after
// that position are the ones published since the stream opened, for Redis
// was down when it did (opened). Others start at the time the stream
// opened (addSinceOpened).
func (s *stream) degrade(idText string, cause error, slots slotBits) {
	d := s.rareState()
	d.idText, d.cause, d.unknown, d.pending = idText, cause, newSlotBits(len(s.cursor)), slots
	cursor, _ := replay.ParseCursor(idText)
	for slot := range s.cursor {
		if slots != nil && !slots.has(slot) {
			continue // started: its position is known
		}
		if pos, named := replay.Lookup(cursor, s.cursor[slot].Hash); named {
			s.cursor[slot].Pos = pos
		} else if pos, seen := s.h.hub.LastKnown(s.keys[slot]); seen {
			s.cursor[slot].Pos = pos
			if d.opened == nil {
				d.opened = make([]replay.Position, len(s.cursor))
			}
			d.opened[slot] = pos
		} else if !s.fresh.has(slot) { // its head was not read
			d.unknown.set(slot)
		}
	}
	s.degraded.Store(true)
}

// idEntries are the cursor entries of the stream's ids: all but those of
// channels whose position a degraded stream does not know.
func (s *stream) idEntries() []replay.ChannelPosition {
	unknown := s.unknownSlots()
	if unknown == nil {
		return s.cursor
	}
	known := make([]replay.ChannelPosition, 0, len(s.cursor))
	for slot, e := range s.cursor {
		if !unknown.has(slot) {
			known = append(known, e)
		}
	}
	return known
}

// writeDegraded tells the client that its stream is live-only for now.
// While Redis refuses this instance the subscriptions of the channels (an
// ACL), the broker logs that itself, rate-limited: each stream is logged
// at debug level only.
func (s *stream) writeDegraded() error {
	var cause error
	if r := s.rare.Load(); r != nil {
		cause = r.cause
	}
	if errors.Is(cause, pubsub.ErrSubscribeDenied) {
		if ce := s.h.logger.Check(zap.DebugLevel, "stream opened without history: Redis refuses the subscription of its channels"); ce != nil {
			ce.Write(zap.Strings("channels", s.pendingNames()), zap.String("principal", s.who.principal), zap.NamedError("reason", cause))
		}
	} else {
		s.h.warnRarely(&s.h.warnings.degraded, "stream opened without history: the backend is unreachable",
			zap.Strings("channels", s.pendingNames()), zap.String("principal", s.who.principal), zap.NamedError("reason", cause))
	}
	data, _ := json.Marshal(map[string][]string{"channels": s.pendingNames()})
	s.buf = wire.AppendEnd(wire.AppendEvent(s.buf[:0], wire.TypeDegraded, data))
	if err := s.out.Write(s.buf); err != nil {
		return err
	}
	return s.flush()
}

// pendingSlots returns the channels a stream degraded in part waits for
// (nil: none, or the whole stream is degraded).
func (s *stream) pendingSlots() slotBits {
	if r := s.rare.Load(); r != nil {
		return r.pending
	}
	return nil
}

// pendingNames names the channels the stream waits for: all of them if it
// is degraded as a whole.
func (s *stream) pendingNames() []string {
	pending := s.pendingSlots()
	if pending == nil {
		return s.names
	}
	names := make([]string, 0, len(s.names))
	for slot, name := range s.names {
		if pending.has(slot) {
			names = append(names, name)
		}
	}
	return names
}

// drainDegraded is drain for a degraded stream: it starts what it can,
// then writes the live events of the channels that are not pending.
func (s *stream) drainDegraded(ctx context.Context) error {
	live, err := s.recover(ctx)
	if err != nil {
		return err
	}
	if !live {
		return s.heartbeatIfDue() // proxies must not cut it
	}
	batch, overflowed := s.take()
	if pending := s.pendingSlots(); pending != nil {
		// in the history its start will read
		batch = slices.DeleteFunc(batch, func(q queued) bool { return pending.has(q.slot) && !q.ev.Local })
	}
	_, err = s.drainBatch(ctx, batch, overflowed)
	return err
}

// recover tries to leave the degraded state: it reports whether the stream
// may write live events now — of all its channels, or of those not pending
// still. A failed attempt of a stream degraded as a whole drops what was
// queued (it is in the history the replay will read), but for the events
// that reached only this instance (fallback local): no history has them, so
// they are written now, as to every other stream.
func (s *stream) recover(ctx context.Context) (bool, error) {
	d := s.rare.Load() // made by degrade
	if s.h.hub.Available() {
		sp, err := s.startingPointOf(ctx, d.idText, d.pending)
		if err == nil {
			err = s.addSinceOpened(ctx, &sp)
		}
		if err == nil {
			first := d.pending == nil // degraded as a whole until now: its replay is not counted yet
			s.started(d, sp.refused)
			s.countStart(d, first, len(sp.truncated) > 0)
			return true, s.writeStart(sp, false)
		}
	}
	if d.pending != nil {
		return true, nil // its other channels are live
	}
	batch, overflowed := s.take()
	local := slices.DeleteFunc(batch, func(q queued) bool { return !q.ev.Local })
	_, err := s.drainBatch(ctx, local, false)
	clear(local)
	if err == nil && overflowed {
		// the live events its queue did not take may be local ones, which
		// no history has: end, as a stream that cannot catch up does (its
		// reconnect, with a local position, is told it was truncated). It
		// does not take live events again here: an overflow while it wrote
		// is seen by the next take, not cleared unseen.
		err = errHistoryGap
	}
	return false, err
}

// started notes that the degraded stream's channels are started but for
// those of refused (nil: all are): their positions are known now.
func (s *stream) started(d *rareState, refused slotBits) {
	if refused == nil {
		d.unknown, d.pending = nil, nil
		s.degraded.Store(false)
		return
	}
	for slot := range s.keys {
		if !refused.has(slot) {
			d.unknown.clear(slot)
		}
	}
	d.pending = refused
}

// countStart counts, in the metrics, the replay of a degraded stream that
// starts channels: the stream once, when it starts its first ones (at its
// open, for a stream that waits for refused channels only: begin), and its
// replay as truncated once, whichever of its starts was.
func (s *stream) countStart(d *rareState, first, truncated bool) {
	if d.idText == "" {
		return // no cursor: no replay to count
	}
	switch {
	case first:
		s.h.metrics.replay(true, truncated)
	case truncated && !d.truncCounted:
		s.h.metrics.replayTruncated()
	}
	d.truncCounted = d.truncCounted || truncated
}

// openedSlack is how much earlier than the stream's start an event may
// have been published and still be written to a degraded stream's live
// channels.
const openedSlack = 5 * time.Second

// addSinceOpened gives the starting point's live channels (those the
// client's cursor does not name) the events published since the stream
// opened. A stream that opens with its history reads each channel's head
// then, and writes what follows; a degraded one reads it only now, and the
// events published between the backend's return and this read (before this
// instance was subscribed again, some of them) would be behind it. On a
// channel this instance was following when the stream opened, those are
// the events after the last one it saw (degrade); on another, the events
// dated since the stream opened, less openedSlack: events from a little
// before it opened may be among them, and its client, which holds no
// position there, is better off with those than without the others. The
// events are dated by the hub's clock (Redis'), which this instance's may
// be off by any amount: the opening is placed on the hub's clock, as long
// before its now as the stream has lasted (one ahead of Redis' by more
// than the slack left out, silently, the events of the stream's first
// seconds). If
// more were published since it opened than a replay holds, it gets the
// newest and is told that channel was truncated, as any replay cut short.
func (s *stream) addSinceOpened(ctx context.Context, sp *startingPoint) error {
	var opened []replay.Position
	if r := s.rare.Load(); r != nil {
		opened = r.opened
	}
	for slot := range s.keys {
		if !s.fresh.has(slot) || sp.pages[slot].Head.IsZero() {
			continue
		}
		after := replay.Position{} // the newest events, then kept by time
		if opened != nil && opened[slot].Epoch == sp.pages[slot].Head.Epoch && !opened[slot].IsZero() {
			after = opened[slot] // where this instance was when it opened
		}
		page, err := s.readHistory(ctx, slot, &after, s.h.ReplayLimit)
		if err != nil {
			return err
		}
		events := page.Events
		var since int64
		if after.IsZero() && len(events) > 0 {
			// per channel: those of a cluster have the clocks of their primaries
			now, err := s.hubNow(ctx, slot)
			if err != nil {
				return err
			}
			since = now.Add(-s.lasted() - openedSlack).UnixMilli()
		}
		for after.IsZero() && len(events) > 0 && events[0].Pos.Time < since {
			events = events[1:]
		}
		if len(events) > 0 && events[len(events)-1].Pos.Epoch == sp.pages[slot].Head.Epoch {
			sp.pages[slot].Events = events
			if cutShort(page, len(events)) {
				sp.truncated = append(sp.truncated, s.names[slot])
			}
		}
	}
	return nil
}

// hubNow reads the clock that dates the events of the channel of slot (by
// its name in the hub, namespaced: on a cluster, its primary's), as
// readHistory reads its history: not past the start of closing.
func (s *stream) hubNow(ctx context.Context, slot int) (time.Time, error) {
	return askUntilClosing(ctx, s, func(ctx context.Context) (time.Time, error) {
		return s.h.hub.Now(ctx, s.keys[slot])
	})
}

// cutShort reports whether a page of the newest events, of which the kept
// last ones are all since the stream opened, may have left out some from
// since then: none of it was older, and events before its first were left
// out (truncated: more than limit, or no longer in the history).
func cutShort(page replay.Page, kept int) bool {
	return page.Truncated && kept == len(page.Events) && page.Events[0].Pos.Seq > 1
}
