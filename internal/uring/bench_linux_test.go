//go:build linux

package uring

import (
	"testing"

	"golang.org/x/sys/unix"
)

// The cost of sending one small event to each of 1000 sockets: a write(2)
// each, or one ring submission for all (go test -bench . ./internal/uring).
// The readers are drained with the timer stopped.
func BenchmarkSendToSockets(b *testing.B) {
	const sockets = 1000
	event := []byte("data: {\"c\":\"bench0\",\"s\":1,\"t\":1700000000000000000}\nid: 1\n\n")
	setup := func(b *testing.B) (writers, readers []int) {
		for range sockets {
			fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { unix.Close(fds[0]); unix.Close(fds[1]) })
			writers, readers = append(writers, fds[0]), append(readers, fds[1])
		}
		return writers, readers
	}
	drain := func(b *testing.B, readers []int) {
		b.StopTimer()
		buf := make([]byte, 4096)
		for _, fd := range readers {
			if _, err := unix.Read(fd, buf); err != nil {
				b.Fatal(err)
			}
		}
		b.StartTimer()
	}
	b.Run("write", func(b *testing.B) {
		writers, readers := setup(b)
		for b.Loop() {
			for _, fd := range writers {
				if _, err := unix.Write(fd, event); err != nil {
					b.Fatal(err)
				}
			}
			drain(b, readers)
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*sockets), "ns/send")
	})
	b.Run("ring", func(b *testing.B) {
		r, err := New(4096)
		if err != nil {
			b.Skip(err)
		}
		defer r.Close()
		writers, readers := setup(b)
		ios := make([]IO, len(writers))
		for i, fd := range writers {
			ios[i] = IO{FD: fd, Buf: event}
		}
		done := func(i, n int, err error) {
			if err != nil || n != len(event) {
				b.Fatalf("send %d: %d, %v", i, n, err)
			}
		}
		for b.Loop() {
			if err := r.Submit(ios, done); err != nil {
				b.Fatal(err)
			}
			drain(b, readers)
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*sockets), "ns/send")
	})
}

// What one system call costs on this machine by itself (getppid(2) does
// nothing): the part of every write(2) that a ring submission pays once for
// many sends. On a VM with page-table isolation it is about a microsecond.
func BenchmarkSystemCall(b *testing.B) {
	for b.Loop() {
		unix.Getppid()
	}
}
