package pubsub

import (
	"sync"
	"time"

	"go.uber.org/zap"
)

// rareWarningEvery is how often a warning that can come per message is
// logged while its cause lasts.
const rareWarningEvery = time.Minute

// rareWarning logs a warning that can come per message or per request
// (whoever may publish on the prefix's shard channels can send any number
// of announcements; every keyed publish meets a Redis that is down) at warn
// level once per rareWarningEvery, with how many were suppressed since
// the last, and at debug level otherwise. Each malformed announcement was
// logged at warn: 500 of them made 500 lines.
type rareWarning struct {
	mu         sync.Mutex
	next       time.Time
	suppressed int
}

func (w *rareWarning) log(logger *zap.Logger, msg string, fields ...zap.Field) {
	if logger.Core().Enabled(zap.WarnLevel) {
		w.mu.Lock()
		now := time.Now()
		warn := !now.Before(w.next)
		n := w.suppressed
		if warn {
			w.next, w.suppressed = now.Add(rareWarningEvery), 0
		} else {
			w.suppressed++
		}
		w.mu.Unlock()
		if warn {
			if n > 0 {
				fields = append(fields, zap.Int("suppressed", n))
			}
			logger.Warn(msg, fields...)
			return
		}
	}
	if ce := logger.Check(zap.DebugLevel, msg); ce != nil {
		ce.Write(fields...)
	}
}
