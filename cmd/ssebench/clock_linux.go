package main

import (
	"time"

	"golang.org/x/sys/unix"
)

// monoStart pairs a reading of CLOCK_MONOTONIC with a time.Time, from the
// closest of a few tries (the pair is off by at most half the time
// between the two time.Now around the system call).
func monoStart() (int64, time.Time) {
	best := time.Duration(1<<63 - 1)
	var base int64
	var t0 time.Time
	for range 5 {
		a := time.Now()
		var ts unix.Timespec
		if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
			return time.Now().UnixNano(), time.Now() // never on Linux
		}
		b := time.Now()
		if d := b.Sub(a); d < best {
			best, base, t0 = d, ts.Nano(), a.Add(d/2)
		}
	}
	return base, t0
}
