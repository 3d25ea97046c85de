package main

import "time"

// The time in an event's data (its publish) and the time it is received
// are read from monoNow: CLOCK_MONOTONIC in ns on Linux, which no step of
// the wall clock (NTP, date -s) moves and which every process of the box
// reads alike, so that the -procs workers, other processes, compare the
// parent's publish times with their own clock. (Not across boxes, nor
// across time namespaces, which offset it; the workers are started in the
// tool's.) A third party that stamps events for the tool must use the
// same clock: clock_gettime(CLOCK_MONOTONIC), Python's
// time.monotonic_ns().
//
// monoNow is the clock's reading at the process's start plus Go's
// monotonic time since then (on Linux the same clock, read through the
// vDSO: cheaper than the system call of unix.ClockGettime on every read).
func monoNow() int64 { return monoBase + int64(time.Since(monoT0)) }

// monoOf is monoNow at t (a time.Time of this process, read with
// time.Now).
func monoOf(t time.Time) int64 { return monoBase + int64(t.Sub(monoT0)) }

var monoBase, monoT0 = monoStart()
