//go:build linux

package caddysse

import (
	"context"
	"errors"
	"time"

	"golang.org/x/sys/unix"
)

// end closes a stream's connection and releases it, on a goroutine of its
// own (finishing may throttle the client, in Redis).
func (l *pollLoop) end(s *stream, err error) {
	tk := s.tk.Load()
	if tk.queued {
		l.sendQueued() // before its descriptor is closed (a failed send may end it)
	}
	if !tk.ended.CompareAndSwap(false, true) {
		return // it ends once
	}
	_ = unix.EpollCtl(l.epfd, unix.EPOLL_CTL_DEL, tk.sock(), nil)
	l.mu.Lock()
	delete(l.byToken, tk.token)
	l.mu.Unlock()
	s.releaseAdmission() // before the client sees the end: it may come back at once
	tk.closeConn()
	tk.pending = nil
	l.count.Add(-1)
	go func() {
		s.finish(context.Background(), err)
		s.release()
	}()
}

// errStopping ends the streams still open when the loops stop.
var errStopping = errors.New("the server is stopping")

// endAll ends every stream when the loop stops; one told to close says its
// server_closing first, as it would have on the loop. A stream lent to a
// goroutine is only shut down: the goroutine may be in the middle of a
// write(2) on its descriptor, and a descriptor closed under it could be
// given to a new connection that would then receive this stream's bytes;
// and a TLS stream told to close would be lent again (closeOnGoroutine), a
// second goroutine writing through the first one's writer and connection.
// Its write fails at once instead, and the goroutine ends it (giveBack).
func (l *pollLoop) endAll() {
	l.mu.Lock()
	l.stopped = true
	l.mu.Unlock()
	// given back before the stop: taken back as the loop would, so that one
	// whose goroutine ended it (its last words said, or a write failed) is
	// only ended, and the others are written by the loop again, not through
	// their goroutine's writer
	l.takeReturned()
	l.mu.Lock()
	streams := make([]*stream, 0, len(l.byToken))
	for _, s := range l.byToken {
		if tk := s.tk.Load(); tk.busy.Load() {
			_ = unix.Shutdown(tk.sock(), unix.SHUT_RDWR)
			continue
		}
		streams = append(streams, s)
	}
	l.mu.Unlock()
	for _, s := range streams {
		if n := s.closing.Load(); n != nil {
			// told to close, not serviced yet (run took the stop before
			// the kick): its last words, without waiting for its lease
			l.closeNow(s, n)
			continue
		}
		l.end(s, errStopping)
	}
	select {
	case <-l.polled: // woken by shutdown's write to the eventfd
	case <-time.After(4 * time.Second):
		return // it is stuck: its descriptors stay, rather than be reused under it
	}
	unix.Close(l.epfd)
	unix.Close(l.wakefd)
	if l.ring != nil {
		l.ring.Close()
	}
}

func (l *pollLoop) shutdown() {
	l.mu.Lock()
	l.closed = true
	l.mu.Unlock()
	// the eventfd is made readable before stop is closed: once stop is
	// closed, poll may return for another event and endAll close the
	// eventfd, and a write after that would go to whatever the kernel gave
	// its number to since (a client's socket). poll passes the wake-up on
	// until it sees stop closed.
	var one = [8]byte{1}
	_, _ = unix.Write(l.wakefd, one[:]) // wakes poll out of epoll_wait
	close(l.stop)
	select {
	case <-l.done:
	case <-time.After(5 * time.Second):
	}
}

// send writes p without blocking; what the socket does not take is kept
