package caddysse

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"
)

// throttleCallTimeout bounds a call to the throttles of a shared backend.
const throttleCallTimeout = 2 * time.Second

// throttleKey names a client in the throttles (SPEC S7): its principal
// from its remote address, so that another device of the same user is not
// punished, or the address alone without a principal. Principals are
// namespaced like channels.
func (h *Handler) throttleKey(who client) string {
	return h.Namespace + "\x00" + who.principal + "\x00" + who.ip
}

func (h *Handler) throttleOn() bool { return h.Throttle > 0 }

// throttled returns how long the client is still refused; zero if it is
// not, or if the throttles could not be asked (they fail open).
func (h *Handler) throttled(ctx context.Context, who client) time.Duration {
	if !h.throttleOn() {
		return 0
	}
	left, err := h.hub.Throttles().Remaining(ctx, h.throttleKey(who))
	if err != nil {
		h.warnRarely(&h.warnings.throttlesUnavailable, "throttles unavailable; admitting the stream", zap.String("principal", who.principal), zap.Error(err))
		return 0
	}
	return left
}

// endedSlow reports whether a stream ended because its client was too
// slow: a write blocked for the slow-client timeout, or its queue stayed
// full that long. A stream told to close for a reload or a stop is not:
// the close hurries the write in flight (lastWordsTimeout), and the
// deadline that ends it is the close's, not the client's slowness — a
// client behind for a moment must not be throttled, and refused when it
// reconnects, because a reload came then.
func (s *stream) endedSlow(err error) bool {
	if n := s.closing.Load(); n != nil {
		return n.slow
	}
	return errors.Is(err, errSlowWrite)
}

// throttleSlowClient refuses a slow client for the throttle period, then
// counts and logs its disconnection: once it is counted, the client is
// refused (its stream's end reaches it before this runs, and it may come
// back at once).
func (h *Handler) throttleSlowClient(ctx context.Context, s *stream, who client, lasted time.Duration) {
	if h.throttleOn() {
		// the request's context may be canceled already: the failed write
		// that made the client slow closes an HTTP/1 connection
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), throttleCallTimeout)
		defer cancel()
		if err := h.hub.Throttles().Throttle(ctx, h.throttleKey(who), time.Duration(h.Throttle)); err != nil {
			h.logger.Warn("could not throttle a slow client", zap.String("principal", who.principal), zap.Error(err))
		}
	}
	h.metrics.slowClient()
	h.logger.Info("slow client disconnected",
		zap.String("principal", who.principal),
		zap.String("remote_ip", who.ip),
		zap.Strings("channels", s.names),
		zap.Duration("duration", lasted),
		zap.Duration("throttle", max(time.Duration(h.Throttle), 0)))
}
