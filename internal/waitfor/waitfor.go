// Package waitfor is the tests' one way to wait for a condition: poll it
// until it holds, and fail the test, naming what was awaited, once the
// deadline passes. Each package keeps its own deadline and pace.
package waitfor

import (
	"testing"
	"time"
)

// Until polls cond every every until it holds, for at most within; what
// names the wait in the failure.
func Until(t testing.TB, what string, within, every time.Duration, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(within); !cond(); time.Sleep(every) {
		if time.Now().After(deadline) {
			t.Fatalf("waited %v for %s", within, what)
		}
	}
}
