package caddysse

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"sort"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/caddy-sse/caddy-sse/pubsub"
	"github.com/caddy-sse/caddy-sse/replay"
	"github.com/caddy-sse/caddy-sse/wire"
)

// subscribe serves a GET or HEAD: checks the request (SPEC S2), replays
// what the client's cursor missed (S5) and streams live events until the
// client leaves or the server closes.
//
// The checks run in openStream, whose frame is gone before the stream is
// written: what stays on this goroutine's stack for the stream's life (on
// net/http and HTTP/2) is kept small, so that the stack is not grown from
// 8 to 16 KiB for it.
func (h *Handler) subscribe(w http.ResponseWriter, r *http.Request) error {
	var s *stream
	var start startingPoint
	var err error
	h.onOwnStack(h.keepsHandlerGoroutine(r), func() { s, start, err = h.openStream(w, r) })
	if s == nil {
		return err
	}
	handedOff := false
	defer func() {
		if !handedOff {
			s.release()
		}
	}()
	// the stream ends, and releases what it holds, on its own once taken
	// over
	handedOff = h.serveStream(w, r, s, start)
	return nil // the response has begun: an error here could not be sent
}

// openStream checks and admits a subscription, subscribes it, finds its
// starting point and writes its headers. It returns no stream if the
// request was answered already (refused, or a HEAD), with the error to
// return.
func (h *Handler) openStream(w http.ResponseWriter, r *http.Request) (*stream, startingPoint, error) {
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	principal, rej := h.resolvePrincipal(r, repl)
	if rej != nil {
		return nil, startingPoint{}, h.reject(w, r, rej, 0)
	}
	names, rej := h.resolveChannels(r, repl)
	if rej != nil {
		return nil, startingPoint{}, h.reject(w, r, rej, 0, zap.String("principal", principal))
	}
	s := newStream(h, names) // holds nothing yet: nothing to release
	if rej := collidingChannels(s.names, s.cursor); rej != nil {
		return nil, startingPoint{}, h.reject(w, r, rej, 0, zap.String("principal", principal), zap.Strings("channels", names))
	}
	if rej := reconnectTooLarge(r, len(s.names)); rej != nil {
		return nil, startingPoint{}, h.reject(w, r, rej, 0, zap.String("principal", principal), zap.Strings("channels", names))
	}
	if n := h.streams.closingNotice(); n != nil {
		return nil, startingPoint{}, h.tellToReconnect(w, r, n)
	}
	repl.Set("http.sse.channels", strings.Join(names, ","))
	repl.Set("http.sse.principal", principal)
	who := client{principal: principal, ip: clientIP(r)}
	adm, rej, retryAfter := h.admit(r.Context(), who)
	if rej != nil {
		return nil, startingPoint{}, h.reject(w, r, rej, retryAfter, zap.String("principal", principal), zap.Strings("channels", names))
	}
	s.who, s.remote = who, r.RemoteAddr
	s.adm = adm
	opened := false
	defer func() {
		if !opened {
			s.release()
		}
	}()
	if r.Method == http.MethodGet {
		s.sub = h.hub.Subscribe(s, s.keys)
	}
	start, err := s.startingPoint(r.Context(), lastEventID(r))
	switch {
	case errors.Is(err, pubsub.ErrUnavailable):
		// SPEC S9: open live-only, say so, and replay once Redis is back
		s.degrade(lastEventID(r), err, nil)
		start = startingPoint{}
	case err != nil:
		if n := h.streams.closingNotice(); n != nil {
			return nil, startingPoint{}, h.tellToReconnect(w, r, n) // its hub went with the config
		}
		return nil, startingPoint{}, h.refuseUnreadHistory(w, r, err, principal, names)
	case start.refused != nil:
		s.degrade(lastEventID(r), start.refusal, start.refused) // those channels only
	}
	s.writeHeaders(w, start.truncated)
	if r.Method == http.MethodHead {
		return nil, startingPoint{}, nil
	}
	sw := newHTTPStreamWriter(w, r, time.Duration(h.SlowClientTimeout))
	s.out = sw
	s.setHurry(sw.hurry)
	s.net.Store(sw)
	opened = true
	return s, start, nil
}

// tellToReconnect answers a stream request that reached a config on its
// way out — a reload or stop began while the request was on its way (the
// old server still serves the connections it had), or while its history
// was read, and the config's hub is closed — as the config's open streams
// were answered: server_closing, so that the client reconnects to the next
// config. A 503 would make a browser's EventSource give up for good. It
// opens as every stream does, then says server_closing at once. Its
// opening gives the client's cursor back as the id (endWithClientID): the
// stream has no position of its own to give.
func (h *Handler) tellToReconnect(w http.ResponseWriter, r *http.Request, n *closeNotice) error {
	h.logger.Debug("stream told to reconnect: the config is closing", zap.String("reason", n.reason), zap.String("remote", r.RemoteAddr))
	writeShortStream(w, r, appendClosing(endWithClientID(h.appendPreambleLines(nil), lastEventID(r)), n))
	return nil
}

// appendClientID appends an id-only block of the client's cursor idText if
// it is one, and reports whether it did. An answer that opens a connection
// without giving a position of its own says the client's back so that the
// client keeps it under the letter of the WHATWG standard: its last event
// ID buffer starts empty on each connection, and the first blank line
// (even one that dispatches nothing) sets its Last-Event-ID to that buffer
// — its next connection would start live, losing what was published
// meanwhile, or replay again from an older lastEventID in its URL. The
// cursor is written re-encoded from what it parsed to, never as the text
// the client sent (a lastEventID query parameter can hold a newline); text
// that is not a cursor is not said back.
func appendClientID(buf []byte, idText string) ([]byte, bool) {
	entries, ok := replay.ParseCursor(idText)
	if !ok {
		return buf, false
	}
	var ids replay.CursorEncoder
	return wire.AppendID(buf, ids.Encode(entries)), true
}

// endWithClientID ends the block in buf with the id line of the client's
// cursor idText if it is one (appendClientID), or with its blank line.
func endWithClientID(buf []byte, idText string) []byte {
	if out, ok := appendClientID(buf, idText); ok {
		return out
	}
	return wire.AppendEnd(buf)
}

// serveStream starts the stream on net/http — headers, preamble, replay,
// through Caddy's response pipeline like any response — then hands it to
// the takeover writer if it can, or writes it on this goroutine until it
// ends. It reports whether it handed the stream over.
func (h *Handler) serveStream(w http.ResponseWriter, r *http.Request, s *stream, start startingPoint) bool {
	if sw, ok := s.out.(*httpStreamWriter); ok {
		defer sw.end()
	}
	own := h.keepsHandlerGoroutine(r)
	var err error
	h.onOwnStack(own, func() {
		s.begin(lastEventID(r) != "", start)
		err = s.open(r.Context(), start)
	})
	if err == nil && h.takeOver(w, r, s) {
		return true
	}
	if err == nil {
		err = h.drainer.serve(r.Context(), s)
	}
	h.onOwnStack(own, func() { s.finish(r.Context(), err) })
	return false
}

// begin registers an open stream, counts it and logs it.
func (s *stream) begin(replay bool, start startingPoint) {
	h := s.h
	s.began = h.now().UnixNano()
	h.streams.add(s)
	h.metrics.streamOpened()
	s.begun = true
	switch {
	case !s.degraded.Load():
		h.metrics.replay(replay, len(start.truncated) > 0)
	case s.pendingSlots() != nil:
		// it waits for refused channels only: the others' replay is
		// written now (one degraded as a whole is counted when it recovers)
		s.countStart(s.rare.Load(), true, len(start.truncated) > 0)
	}
	// Check first: the fields cost allocations on every stream's start
	// even when debug logging is off.
	if ce := h.logger.Check(zap.DebugLevel, "stream opened"); ce != nil {
		ce.Write(zap.Strings("channels", s.names),
			zap.String("principal", s.who.principal),
			zap.String("remote", s.remote),
			zap.Bool("replay", replay),
			zap.Strings("truncated", start.truncated))
	}
}

// finish counts and logs a stream that ended with err; a slow client is
// throttled. It may block (the throttles may be in Redis).
func (s *stream) finish(ctx context.Context, err error) {
	h := s.h
	s.countDelivered()
	if unlogged, depth := s.unloggedOverflow(); unlogged {
		s.queueFull(depth) // its writer never took the queue that overflowed
	}
	h.metrics.dropped(s.takeDropped())
	if s.endedSlow(err) {
		h.throttleSlowClient(ctx, s, s.who, s.lasted())
	}
	if ce := h.logger.Check(zap.DebugLevel, "stream ended"); ce != nil {
		ce.Write(zap.Strings("channels", s.names),
			zap.String("principal", s.who.principal),
			zap.String("remote", s.remote),
			zap.Duration("duration", s.lasted()),
			zap.Int64("events_sent", s.eventsSent),
			zap.NamedError("reason", s.endReason(ctx, err)))
	}
}

// errQueueStayedFull is why a stream ended whose queue stayed full for the
// slow-client timeout (the registry's ticker told it to close).
var errQueueStayedFull = errors.New("its queue stayed full for the slow-client timeout")

// endReason says why a stream ended, for its log line: err, or else what
// ended it without an error — told to close (a reload, a stop, a queue
// that stayed full) after its last words were written, or its client
// leaving, which the net_http writer sees only as its request's end.
func (s *stream) endReason(ctx context.Context, err error) error {
	switch n := s.closing.Load(); {
	case err != nil:
		return err
	case n != nil && n.slow:
		return errQueueStayedFull
	case n != nil:
		return fmt.Errorf("server closing: %s", n.reason)
	case ctx.Err() != nil:
		return errClientGone
	}
	return nil
}

// release lets go of what the stream holds: its place in the registry and
// the metrics, its subscription, its share of the caps. It runs once, when
// the stream ends (or fails to start).
func (s *stream) release() {
	if s.begun {
		s.h.streams.remove(s)
		s.h.metrics.streamClosed()
		s.begun = false
	}
	s.sub.Close()
	s.sub = nil
	s.releaseAdmission()
}

// releaseAdmission gives back the stream's share of the caps. The takeover
// writer calls it before it closes a connection, so that a client told to
// reconnect at once (server_closing with retry 0) is not refused by its
// own old stream's lease.
func (s *stream) releaseAdmission() {
	if s.adm != nil {
		s.adm.release()
		s.adm = nil
	}
}

// releaseAdmissionThen gives back the stream's share of the caps, and
// reports whether then will be called once the shared store no longer
// counts its lease (admission.releaseThen).
func (s *stream) releaseAdmissionThen(then func()) bool {
	a := s.adm
	if a == nil {
		return false
	}
	s.adm = nil
	return a.releaseThen(then)
}

// leaseGoneWait bounds how long a stream told to reconnect waits for its
// lease to leave the shared store before it says so (a Redis that does
// not answer: the lease lapses within its ttl then). A removal takes a
// round trip; the bound keeps a stop prompt while Redis hangs, and the
// shared store stops making streams wait once a removal is that late
// (RedisLeases.ReleaseThen).
const leaseGoneWait = 500 * time.Millisecond

// releaseBeforeClosing gives back the share of its principal's cap of a
// stream about to be told to reconnect (not one cut off as a slow client,
// which is throttled), and waits, within leaseGoneWait, until the shared
// store no longer counts it: the client may come back at once through
// another instance, which would refuse it at the cap for its own old
// stream (a 429 makes a browser's EventSource give up for good). On
// goroutines only; the event loops do the same without waiting
// (pollLoop.close).
func (s *stream) releaseBeforeClosing(n *closeNotice) {
	if n == nil || n.slow {
		return
	}
	gone := make(chan struct{})
	if !s.releaseAdmissionThen(func() { close(gone) }) {
		return
	}
	t := time.NewTimer(leaseGoneWait)
	defer t.Stop()
	select {
	case <-gone:
	case <-t.C:
	}
}

// lastEventID returns the client's cursor text: the Last-Event-ID header
// wins over the lastEventID query parameter, because EventSource resends
// its original URL on every reconnect but a fresh header.
func lastEventID(r *http.Request) string {
	if id := r.Header.Get("Last-Event-ID"); id != "" {
		return id
	}
	return queryFirst(r.URL, "lastEventID")
}

// startingPoint is what a stream writes before going live: per channel the
// history page to replay, and which channels were truncated.
type startingPoint struct {
	pages     []replay.Page
	truncated []string
	// refused marks the channels left out because Redis refuses this
	// instance their subscription (an ACL) while it read the others: the
	// stream waits for those alone (degraded.go); nil if none. refusal is
	// why.
	refused slotBits
	refusal error
}

// startingPoint reads, for every channel, the events after the client's
// cursor (or only the head, for a channel the cursor does not name). It
// also sets each channel's position to where the client is: a reconnect
// in the middle of the replay resumes from there.
func (s *stream) startingPoint(ctx context.Context, idText string) (startingPoint, error) {
	return s.startingPointOf(ctx, idText, nil)
}

// startingPointOf is startingPoint for the channels of only (all if nil).
// A channel whose subscription Redis refuses is left out (refused), unless
// every channel it reads is: then it fails as their reads did. A deliberate
// ACL may never grant it, and the others need not wait for it.
func (s *stream) startingPointOf(ctx context.Context, idText string, only slotBits) (startingPoint, error) {
	var cursor []replay.ChannelPosition
	garbage := false
	if idText != "" {
		var ok bool
		cursor, ok = replay.ParseCursor(idText)
		garbage = !ok
	}
	sp := startingPoint{pages: make([]replay.Page, len(s.keys))}
	read := 0
	for slot := range s.keys {
		if only != nil && !only.has(slot) {
			continue
		}
		after, named := replay.Lookup(cursor, s.cursor[slot].Hash)
		var from *replay.Position
		if named {
			from = &after
		}
		page, err := s.readHistory(ctx, slot, from, s.h.ReplayLimit)
		if errors.Is(err, pubsub.ErrSubscribeDenied) {
			sp.refuse(slot, len(s.keys), err)
			s.fresh.clear(slot) // its head was not read
			continue
		}
		if err != nil {
			return sp, err
		}
		read++
		sp.pages[slot] = page
		s.cursor[slot].Pos = page.Head
		s.fresh.clear(slot)
		if !named {
			s.fresh.set(slot)
		}
		if named && !(page.Truncated && len(page.Events) == 0) {
			// the replay moves it on. A channel truncated with nothing left
			// to replay is at its head at once, so that the ids of the other
			// channels' replay do not carry its unusable old position (the
			// client would be told truncated again)
			s.cursor[slot].Pos = after
		}
		if page.Truncated || garbage {
			sp.truncated = append(sp.truncated, s.names[slot])
		}
	}
	if read == 0 && sp.refusal != nil {
		return sp, sp.refusal
	}
	return sp, nil
}

// refuse marks slot (of n) as left out for Redis' refusal err.
func (sp *startingPoint) refuse(slot, n int, err error) {
	if sp.refused == nil {
		sp.refused = newSlotBits(n)
	}
	sp.refused.set(slot)
	sp.refusal = err
}

// writeHeaders sends the stream's headers (SPEC S2).
func (s *stream) writeHeaders(w http.ResponseWriter, truncated []string) {
	hdr := w.Header()
	setStreamHeaders(hdr)
	if len(truncated) > 0 {
		hdr.Set("X-Replay-Truncated", "true")
	}
	w.WriteHeader(http.StatusOK)
}

// refuseUnreadHistory refuses a stream whose history Redis answered with an
// error (not an outage, which degrades the stream instead): 503
// history_unavailable. The operator must hear of it, not only the refused
// client; a client that left during the read is no one's concern. Redis'
// reply stays in the log: it names keys, scripts and, in a MOVED, the
// cluster's internal addresses, none of a subscriber's business (a
// publish's detail goes to the backend, which holds the secret).
func (h *Handler) refuseUnreadHistory(w http.ResponseWriter, r *http.Request, err error, principal string, names []string) error {
	if r.Context().Err() == nil {
		h.warnRarely(&h.warnings.historyUnavailable, "history unavailable", zap.Strings("channels", names), zap.Error(err))
	}
	return h.reject(w, r, &rejection{status: http.StatusServiceUnavailable, code: "history_unavailable", detail: "the history could not be read"}, time.Second,
		zap.String("principal", principal), zap.Strings("channels", names))
}

// setStreamHeaders sets the headers of every stream. no-transform keeps
// Caddy's encode (and other proxies) from compressing and buffering it.
func setStreamHeaders(hdr http.Header) {
	hdr.Set("Content-Type", "text/event-stream")
	hdr.Set("Cache-Control", "no-store, no-transform")
	hdr.Set("X-Accel-Buffering", "no")
	hdr.Del("Content-Length")
}

// appendPreambleLines appends what every stream opens with, a comment and
// the retry hint, without the blank line that ends the block.
func (h *Handler) appendPreambleLines(buf []byte) []byte {
	buf = wire.AppendComment(buf, "ok")
	return wire.AppendRetry(buf, time.Duration(h.Retry).Milliseconds())
}

// open writes the stream's preamble (a comment, the retry hint and, where
// the stream knows its channels' positions, its cursor as the id), flushes
// the headers with it, then the truncation notice and the replay.
//
// The id makes a stream that is cut before its first event (a load
// balancer, a network change, a reload) resume where it started instead of
// live, losing what was published while its client reconnected; it also
// keeps a reconnected client's Last-Event-ID under the letter of the WHATWG
// standard, whose last event ID buffer starts empty on each connection and
// whose first blank line would otherwise set it to "". A degraded stream
// does not know its positions: it gives the client's cursor back, if it
// came with one (endWithClientID), which its client keeps. One degraded in
// part (Redis refuses some of its channels) gives the positions it knows,
// as its events' ids do: its started channels' at least.
func (s *stream) open(ctx context.Context, sp startingPoint) error {
	idGiven := !s.degraded.Load() || s.pendingSlots() != nil
	s.buf = s.h.appendPreambleLines(s.buf[:0])
	if idGiven {
		s.buf = s.appendIDBlock(s.buf)
	} else {
		s.buf = endWithClientID(s.buf, s.rare.Load().idText) // made by degrade
	}
	if err := s.out.Write(s.buf); err != nil {
		return err
	}
	if err := s.flush(); err != nil {
		return err
	}
	if s.closing.Load() != nil {
		return nil // closing already: run tells the client at once
	}
	if !s.degraded.Load() {
		return s.writeStart(sp, idGiven)
	}
	if s.pendingSlots() == nil {
		return s.writeDegraded()
	}
	// its other channels start now; their truncation is told first (SPEC
	// S5: the first event of the stream), then which channels wait
	if err := s.writeTruncated(sp.truncated); err != nil {
		return err
	}
	if err := s.writeDegraded(); err != nil {
		return err
	}
	return s.writeReplayOf(sp, idGiven)
}

// writeStart writes the truncation notice and the replay of a starting
// point, and flushes. idGiven says that the stream's cursor went out as an
// id since its positions were last set.
//
// A start that replays nothing gives the cursor in an id-only block if it
// was not given: after a truncation, and on a degraded stream that has just
// recovered as a whole (recover), which opened without an id — cut before
// its first event, it would otherwise reconnect live (its client may have
// come without a cursor), losing what was published meanwhile, as a stream
// that opens with its positions no longer does.
func (s *stream) writeStart(sp startingPoint, idGiven bool) error {
	if err := s.writeTruncated(sp.truncated); err != nil {
		return err
	}
	return s.writeReplayOf(sp, idGiven)
}

// writeTruncated writes the truncation notice of channels, if any.
func (s *stream) writeTruncated(channels []string) error {
	if len(channels) == 0 {
		return nil
	}
	data, _ := json.Marshal(map[string][]string{"channels": channels})
	s.buf = wire.AppendEnd(wire.AppendEvent(s.buf[:0], wire.TypeTruncated, data))
	return s.out.Write(s.buf)
}

// writeReplayOf is writeStart after the truncation notice.
func (s *stream) writeReplayOf(sp startingPoint, idGiven bool) error {
	replayed, err := s.writeReplay(sp.pages)
	if err != nil {
		if errors.Is(err, errClosing) {
			return nil // run tells the client at once
		}
		return err
	}
	if replayed == 0 && !idGiven && (len(sp.truncated) > 0 || !s.degraded.Load()) {
		// nothing replayed moves the client's Last-Event-ID off the cursor
		// that was truncated (or did not parse): until the next event, each
		// reconnect would be told truncated again though it missed nothing.
		// (A stream degraded in part still does not know the positions of
		// the channels it waits for: it says nothing unless truncated.)
		if err := s.writeID(); err != nil {
			return err
		}
	}
	return s.flush()
}

// writeReplay writes the pages merged by publish time across channels (best
// effort: there is no global order); within a channel the order is strict.
// It returns how many events it wrote.
func (s *stream) writeReplay(pages []replay.Page) (int, error) {
	var all []queued
	for slot, page := range pages {
		for _, ev := range page.Events {
			all = append(all, queued{ev: ev, slot: slot})
		}
	}
	if len(pages) > 1 {
		sort.SliceStable(all, func(i, j int) bool { return all[i].ev.Pos.Time < all[j].ev.Pos.Time })
	}
	for i, q := range all {
		if err := s.writeEvent(q.slot, q.ev); err != nil {
			s.h.metrics.replayed(i)
			return i, err
		}
	}
	s.h.metrics.replayed(len(all))
	return len(all), nil
}
