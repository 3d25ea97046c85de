package caddysse

import (
	"sync"
	"time"

	"go.uber.org/zap"
)

// warnEvery is how often a warning that can come per request is logged
// while its cause lasts; the others of that interval are logged at debug
// level, and counted in the next one's "suppressed". While Redis is down
// every stream that opens and every publish meets it: logged each time,
// 200 streams and 200 publishes made 600 warnings in 2.3 s, drowning what
// an operator needs (the single "redis is unreachable") in a flood whose
// size grows with the traffic. Each refused request is counted in the
// metrics (caddy_sse_rejections_total) and answered with its error.
const warnEvery = 10 * time.Second

// rareWarning lets one warning through per warnEvery.
type rareWarning struct {
	mu         sync.Mutex
	next       time.Time
	suppressed int
}

// allow reports whether the warning is logged now and, if so, how many
// were left out since the last one logged.
func (w *rareWarning) allow(now time.Time) (bool, int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if now.Before(w.next) {
		w.suppressed++
		return false, 0
	}
	w.next = now.Add(warnEvery)
	n := w.suppressed
	w.suppressed = 0
	return true, n
}

// warnings are the handler's warnings that can come per request.
type warnings struct {
	publishFailed, capUnavailable, capUnavailableFull, throttlesUnavailable, degraded rareWarning
}

// warnRarely logs msg at warn level at most once per warnEvery (see
// warnEvery), and at debug level otherwise.
func (h *Handler) warnRarely(w *rareWarning, msg string, fields ...zap.Field) {
	if h.logger.Core().Enabled(zap.WarnLevel) {
		if ok, suppressed := w.allow(time.Now()); ok {
			if suppressed > 0 {
				fields = append(fields, zap.Int("suppressed", suppressed))
			}
			h.logger.Warn(msg, fields...)
			return
		}
	}
	if ce := h.logger.Check(zap.DebugLevel, msg); ce != nil {
		ce.Write(fields...)
	}
}
