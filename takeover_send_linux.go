//go:build linux

package caddysse

import (
	"errors"
	"strconv"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/caddy-sse/caddy-sse/internal/uring"
)

// watch sets the events the loop waits for on a connection.
func (l *pollLoop) watch(tk *tconn, events uint32) {
	tk.outArmed = events&unix.EPOLLOUT != 0
	ev := tk.event(events)
	_ = unix.EpollCtl(l.epfd, unix.EPOLL_CTL_MOD, tk.sock(), &ev)
}

// flushPending writes what the socket did not take before.
func (l *pollLoop) flushPending(tk *tconn) error {
	p := tk.pending
	tk.pending = nil
	err := tk.send(p)
	if len(tk.pending) == 0 && tk.outArmed {
		l.watch(tk, unix.EPOLLIN|unix.EPOLLRDHUP)
	}
	return err
}

// for when it is writable.
func (tk *tconn) send(p []byte) error {
	for len(p) > 0 {
		n, err := unix.Write(tk.sock(), p)
		if n > 0 {
			p = p[n:]
			tk.blocked.Store(0) // it takes bytes: a slow reader is not stalled
		}
		switch {
		case err == nil, errors.Is(err, unix.EINTR):
		case errors.Is(err, unix.EAGAIN):
			tk.keep(p)
			return nil
		default:
			return err
		}
	}
	tk.blocked.Store(0)
	return nil
}

// keep holds what the socket did not take until it is writable.
func (tk *tconn) keep(p []byte) {
	tk.pending = append(tk.pending, p...)
	tk.blocked.CompareAndSwap(0, time.Now().UnixNano())
	if !tk.outArmed {
		tk.loop.watch(tk, unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLOUT)
	}
}

// enqueue keeps a stream's chunk for the round's io_uring submission.
func (l *pollLoop) enqueue(s *stream, chunk []byte) {
	tk := s.tk.Load()
	if tk.queued {
		l.sendQueued() // one send per socket and submission keeps them in order
	}
	tk.queued = true
	l.queue = append(l.queue, uring.IO{FD: tk.sock(), Buf: chunk})
	l.owner = append(l.owner, s)
	if len(l.queue) >= submitEvery {
		l.sendQueued()
		// every queued chunk is out (or copied to its stream's pending):
		// the next streams reuse the buffer while it is in the cache
		l.chunk = l.chunk[:0]
	}
}

// submitEvery is how many sends wait in the queue at most. Measured at
// 10k streams (docs/PERFORMANCE.md): a submission per 128 sends costs less
// CPU and latency than one per round. A round's single submission of
// thousands keeps the thread in the kernel for tens of milliseconds; the
// receiving side's network work, which loopback runs inside the sender's
// system call, is then handed to ksoftirqd and waits for it, and the first
// streams wait for the last. Much smaller batches pay for more system
// calls again.
const submitEvery = 128

// sendQueued sends the queued chunks and handles each result as send
// would. It leaves l.chunk alone: a stream may be writing its chunk there.
func (l *pollLoop) sendQueued() {
	if len(l.queue) == 0 {
		return
	}
	if err := l.ring.Submit(l.queue, l.sentFn); err != nil {
		// the ring is broken: streams whose sends did not come back may
		// have lost bytes, so they end (their clients resume from their
		// last event); the loop writes on with write(2)
		l.ring.Close()
		l.ring = nil
		for _, s := range l.owner {
			if tk := s.tk.Load(); tk.queued {
				tk.queued = false
				l.end(s, err)
			}
		}
	}
	clear(l.queue)
	clear(l.owner)
	l.queue, l.owner = l.queue[:0], l.owner[:0]
}

// sent handles the result of the i-th queued send.
func (l *pollLoop) sent(i, n int, err error) {
	s, p := l.owner[i], l.queue[i].Buf
	tk := s.tk.Load()
	tk.queued = false
	switch {
	case err == nil && n == len(p):
		tk.blocked.Store(0)
	case err == nil, errors.Is(err, unix.EAGAIN), errors.Is(err, unix.EINTR):
		if n > 0 {
			tk.blocked.Store(0) // it took bytes: blocked from now on
		}
		tk.keep(p[n:])
	default:
		l.end(s, err)
	}
}

// loopWriter is a stream's streamWriter while its loop writes it: writes
// go into the loop's chunk, a flush sends the chunk without blocking.
type loopWriter struct {
	tk *tconn
	s  *stream
}

func (w *loopWriter) Write(p []byte) error {
	l := w.tk.loop
	if len(l.chunk) == l.chunkAt {
		l.chunk = append(l.chunk, headroom[:]...)
	}
	l.chunk = append(l.chunk, p...)
	return nil
}

// Flush frames the chunk and sends it, or queues it for the round's
// submission while the loop is batching.
func (w *loopWriter) Flush() error {
	l := w.tk.loop
	at := l.chunkAt
	if len(l.chunk)-at <= chunkHeadroom {
		return nil
	}
	size := len(l.chunk) - at - chunkHeadroom
	var head [chunkHeadroom]byte
	h := strconv.AppendInt(head[:0], int64(size), 16)
	h = append(h, '\r', '\n')
	start := at + chunkHeadroom - len(h)
	copy(l.chunk[start:], h)
	l.chunk = append(l.chunk, '\r', '\n')
	if l.batching && l.ring != nil {
		// the slice keeps its bytes even if chunk grows into a new array
		l.enqueue(w.s, l.chunk[start:len(l.chunk):len(l.chunk)])
		l.chunkAt = len(l.chunk) // 0 if enqueue submitted the queue
		return nil
	}
	err := w.tk.send(l.chunk[start:])
	l.chunk = l.chunk[:at]
	if at == 0 && cap(l.chunk) > 4<<20 {
		l.chunk = nil // do not keep a huge batch's buffer
	}
	return err
}

func (w *loopWriter) WriteLast(p []byte) error {
	if err := w.Write(p); err != nil {
		return err
	}
	return w.Flush()
}

// MayBlock is false: the loop must never wait.
func (w *loopWriter) MayBlock() bool { return false }

// roundNow is the loop's round clock; 0 outside a round.
func (w *loopWriter) roundNow() int64 { return w.tk.loop.clock }

// schedule makes the stream's loop service it.
func (tk *tconn) schedule(s *stream) { tk.loop.schedule(s) }

// blockedSince is when the socket stopped taking bytes (Unix ns), or 0.
func (tk *tconn) blockedSince() int64 { return tk.blocked.Load() }

// fdSink writes to a socket the event loop holds, waiting with poll(2)
// while it is full.
type fdSink struct {
	fd int
	// hurriedTo is the deadline (Unix ns) hurry gave every write, 0 until
	// the stream is told to close.
	hurriedTo atomic.Int64
}

// newFDSink makes the sink of a cleartext stream's goroutines, which a
// close hurries (the loop's own writes never block).
func newFDSink(s *stream, fd int) *fdSink {
	sink := &fdSink{fd: fd}
	// set before looking at closing, which close sets before it hurries:
	// a close at the same time is seen by one side or the other
	s.setHurry(sink.hurry)
	if s.closing.Load() != nil {
		sink.hurry()
	}
	return sink
}

// hurry brings the deadline of writes in flight and to come down to
// lastWordsTimeout from now.
func (fs *fdSink) hurry() {
	fs.hurriedTo.CompareAndSwap(0, time.Now().Add(lastWordsTimeout).UnixNano())
}

func (fs *fdSink) writeBy(p []byte, deadline time.Time) error {
	return writeFull(fs.fd, p, deadline, &fs.hurriedTo)
}

// hurryCheck is how long a wait for a full socket may last before
// writeFull looks whether it was hurried.
const hurryCheck = 100 * time.Millisecond

// writeFull writes all of p to a non-blocking socket, waiting with poll(2)
// while it is full, until deadline or, once hurried, hurriedTo.
func writeFull(fd int, p []byte, deadline time.Time, hurriedTo *atomic.Int64) error {
	for len(p) > 0 {
		n, err := unix.Write(fd, p)
		if n > 0 {
			p = p[n:]
		}
		switch {
		case err == nil, errors.Is(err, unix.EINTR):
			continue
		case !errors.Is(err, unix.EAGAIN):
			return err
		}
		if h := hurriedTo.Load(); h != 0 && h < deadline.UnixNano() {
			deadline = time.Unix(0, h)
		}
		left := time.Until(deadline)
		if left <= 0 {
			return errSlowWrite
		}
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
		wait := min(left, hurryCheck)
		if _, err := unix.Poll(fds, int(wait/time.Millisecond)+1); err != nil && !errors.Is(err, unix.EINTR) {
			return err
		}
	}
	return nil
}
