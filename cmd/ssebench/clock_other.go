//go:build !linux

package main

import "time"

// monoStart elsewhere: the wall clock at the start, then Go's monotonic
// time. Steady within a process; processes are aligned only as well as
// the wall clock was at their starts.
func monoStart() (int64, time.Time) {
	t := time.Now()
	return t.UnixNano(), t
}
