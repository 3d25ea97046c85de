package caddysse

import (
	"context"
	"encoding/json"
	"slices"
	"time"

	"go.uber.org/zap"

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

// degrade marks the stream degraded, keeping the client's cursor for the
// replay once the backend is back.
func (s *stream) degrade(idText string) {
	s.idText = &idText
	s.degraded.Store(true)
}

// writeDegraded tells the client that its stream is live-only for now.
func (s *stream) writeDegraded() error {
	s.h.logger.Warn("stream opened without history: the backend is unreachable",
		zap.Strings("channels", s.names), zap.String("principal", s.who.principal))
	data, _ := json.Marshal(map[string][]string{"channels": s.names})
	s.buf = wire.AppendEnd(wire.AppendEvent(s.buf[:0], wire.TypeDegraded, data))
	if err := s.out.Write(s.buf); err != nil {
		return err
	}
	return s.flush()
}

// recover tries to leave the degraded state: it reports whether the stream
// may write live events now. A failed attempt drops what was queued (it is
// in the history the replay will read), but for the events that reached
// only this instance (fallback local): no history has them, so they are
// written now, as to every other stream.
func (s *stream) recover(ctx context.Context) (bool, error) {
	if s.h.hub.Available() {
		sp, err := s.startingPoint(ctx, *s.idText)
		if err == nil {
			err = s.addSinceOpened(ctx, &sp)
		}
		if err == nil {
			s.degraded.Store(false)
			s.h.metrics.replay(*s.idText != "", len(sp.truncated) > 0)
			return true, s.writeStart(sp)
		}
	}
	batch, _ := s.take()
	local := slices.DeleteFunc(batch, func(q queued) bool { return !q.ev.Local })
	_, err := s.drainBatch(ctx, local, false)
	clear(local)
	s.resumeLive()
	return false, err
}

// openedSlack is how much earlier than the stream's start an event may
// have been published and still be written to a degraded stream's live
// channels: the backend's clock (which dates events) may be behind ours.
const openedSlack = 5 * time.Second

// addSinceOpened gives the starting point's live channels (those the
// client's cursor does not name) the events published since the stream
// opened. A stream that opens with its history reads each channel's head
// then, and writes what follows; a degraded one reads it only now, and the
// events published between the backend's return and this read (before this
// instance was subscribed again, some of them) would be behind it. Events
// from a little before it opened may be among them: its client, which holds
// no position there, is better off with those than without the others.
// If more were published since it opened than a replay holds, it gets the
// newest and is told that channel was truncated, as any replay cut short.
func (s *stream) addSinceOpened(ctx context.Context, sp *startingPoint) error {
	since := time.Unix(0, s.began).Add(-openedSlack).UnixMilli()
	for slot := range s.keys {
		if !s.fresh.has(slot) || sp.pages[slot].Head.IsZero() {
			continue
		}
		page, err := s.h.hub.Read(ctx, s.keys[slot], &replay.Position{}, s.h.ReplayLimit)
		if err != nil {
			return err
		}
		events := page.Events
		for len(events) > 0 && events[0].Pos.Time < since {
			events = events[1:]
		}
		if len(events) > 0 && events[len(events)-1].Pos.Epoch == sp.pages[slot].Head.Epoch {
			sp.pages[slot].Events = events
			if cutShort(page, len(events), s.h.ReplayLimit) {
				sp.truncated = append(sp.truncated, s.names[slot])
			}
		}
	}
	return nil
}

// cutShort reports whether a page of the newest events, of which the kept
// last ones are all since the stream opened, may have left out some from
// since then: it is full, none of it was older, and its first event is not
// the channel's first.
func cutShort(page replay.Page, kept, limit int) bool {
	return len(page.Events) == limit && kept == limit && page.Events[0].Pos.Seq > 1
}
