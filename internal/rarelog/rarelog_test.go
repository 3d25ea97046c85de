package rarelog

import (
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// Within an interval the first warning is logged at warn level and the
// others at debug; the first of the next interval says how many were left
// out, and the count starts again after it.
func TestWarningLogsOncePerIntervalAndCountsTheRest(t *testing.T) {
	core, logs := observer.New(zap.DebugLevel)
	logger := zap.New(core)
	var w Warning
	for range 4 {
		w.Log(logger, time.Hour, "redis is down")
	}
	w.endInterval()
	w.Log(logger, time.Hour, "redis is down")
	w.endInterval()
	w.Log(logger, time.Hour, "redis is down")

	var levels []string
	var suppressed []int64
	for _, e := range logs.All() {
		levels = append(levels, e.Level.String())
		if e.Level == zap.WarnLevel {
			n, _ := e.ContextMap()["suppressed"].(int64)
			suppressed = append(suppressed, n)
		}
	}
	if got := len(levels); got != 6 || levels[0] != "warn" || levels[1] != "debug" || levels[3] != "debug" ||
		levels[4] != "warn" || levels[5] != "warn" {
		t.Fatalf("levels %v, want warn, three debug, warn, warn", levels)
	}
	if len(suppressed) != 3 || suppressed[0] != 0 || suppressed[1] != 3 || suppressed[2] != 0 {
		t.Fatalf("suppressed %v on the warnings, want none, 3, none", suppressed)
	}
}

// A logger that does not log warnings gets the warning at debug level
// (if at all), and nothing is counted as suppressed for later.
func TestWarningBelowWarnLevelIsNotCounted(t *testing.T) {
	quiet, _ := observer.New(zap.ErrorLevel)
	var w Warning
	w.Log(zap.New(quiet), time.Hour, "x")
	w.Log(zap.New(quiet), time.Hour, "x")
	core, logs := observer.New(zap.WarnLevel)
	w.Log(zap.New(core), time.Hour, "x")
	if all := logs.All(); len(all) != 1 || all[0].ContextMap()["suppressed"] != nil {
		t.Fatalf("got %v, want one warning without a suppressed count", all)
	}
}

// endInterval makes the interval of the last warning logged over, as if
// it had passed.
func (w *Warning) endInterval() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.next = time.Now().Add(-time.Nanosecond)
}
