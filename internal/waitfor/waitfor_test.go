package waitfor

import (
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"
)

// recorder stands in for the test a wait fails: it keeps the failure and
// ends the waiting goroutine, as testing.T's Fatalf does.
type recorder struct {
	testing.TB
	failure string
}

func (r *recorder) Helper() {}

func (r *recorder) Fatalf(format string, args ...any) {
	r.failure = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// wait runs Until as a test would and returns its failure, if any.
func wait(what string, within time.Duration, cond func() bool) string {
	r := &recorder{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		Until(r, what, within, time.Millisecond, cond)
	}()
	<-done
	return r.failure
}

func TestUntilReturnsOnceTheConditionHolds(t *testing.T) {
	polls := 0
	if failure := wait("the third poll", time.Minute, func() bool { polls++; return polls == 3 }); failure != "" {
		t.Fatalf("failed: %s", failure)
	}
	if polls != 3 {
		t.Fatalf("polled %d times, want 3", polls)
	}
}

func TestUntilFailsNamingTheWaitOnceTheDeadlinePasses(t *testing.T) {
	began := time.Now()
	failure := wait("a condition that never holds", 30*time.Millisecond, func() bool { return false })
	if !strings.Contains(failure, "a condition that never holds") || !strings.Contains(failure, "30ms") {
		t.Fatalf("failure %q does not name the wait and its deadline", failure)
	}
	if waited := time.Since(began); waited < 30*time.Millisecond {
		t.Fatalf("gave up after %v, before the deadline", waited)
	}
}
