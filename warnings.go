package caddysse

import (
	"time"

	"go.uber.org/zap"

	"github.com/caddy-sse/caddy-sse/internal/rarelog"
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

// warnings are the handler's warnings that can come per request.
type warnings struct {
	publishFailed, historyUnavailable, capUnavailable, capUnavailableFull, throttlesUnavailable, degraded rarelog.Warning
}

// warnRarely logs msg at warn level at most once per warnEvery (see
// warnEvery), and at debug level otherwise.
func (h *Handler) warnRarely(w *rarelog.Warning, msg string, fields ...zap.Field) {
	w.Log(h.logger, warnEvery, msg, fields...)
}
