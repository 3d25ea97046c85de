// Package rarelog logs a warning that can come per request or per message
// at most once per interval while its cause lasts: the others are logged
// at debug level and counted in the next warning's "suppressed". A flood
// whose size grows with the traffic (every publish meeting a Redis that is
// down, every malformed announcement anyone may send) would bury the one
// line an operator needs.
package rarelog

import (
	"sync"
	"time"

	"go.uber.org/zap"
)

// Warning is one such warning; its zero value is ready.
type Warning struct {
	mu         sync.Mutex
	next       time.Time
	suppressed int
}

// Log logs msg at warn level if no warning was logged within every, with
// how many were left out since the last one; at debug level otherwise.
func (w *Warning) Log(logger *zap.Logger, every time.Duration, msg string, fields ...zap.Field) {
	if logger.Core().Enabled(zap.WarnLevel) {
		if ok, suppressed := w.allow(time.Now(), every); ok {
			if suppressed > 0 {
				fields = append(fields, zap.Int("suppressed", suppressed))
			}
			logger.Warn(msg, fields...)
			return
		}
	}
	if ce := logger.Check(zap.DebugLevel, msg); ce != nil {
		ce.Write(fields...)
	}
}

// allow reports whether the warning is logged now and, if so, how many
// were left out since the last one logged.
func (w *Warning) allow(now time.Time, every time.Duration) (bool, int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if now.Before(w.next) {
		w.suppressed++
		return false, 0
	}
	w.next = now.Add(every)
	n := w.suppressed
	w.suppressed = 0
	return true, n
}
