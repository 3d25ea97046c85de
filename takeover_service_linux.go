//go:build linux

package caddysse

import (
	"context"
	"errors"
	"time"

	"golang.org/x/sys/unix"
)

// serviceReady services the streams scheduled since the last round, then
// sends what the round wrote (one ring submission, or the writes done).
func (l *pollLoop) serviceReady() {
	l.mu.Lock()
	batch := l.ready
	l.ready = l.spare[:0]
	l.spare = batch
	l.mu.Unlock()
	for i, s := range batch {
		if i%clockEvery == 0 {
			l.clock = time.Now().UnixNano()
		}
		s.tk.Load().scheduled.Store(false)
		l.service(s)
		batch[i] = nil
	}
	l.sendQueued()
	l.clock = 0
	l.chunk, l.chunkAt = l.chunk[:0], 0
	if cap(l.chunk) > 4<<20 {
		l.chunk = nil // do not keep a huge round's buffer
	}
}

// service writes what the stream has: its closing, a queued batch, a
// heartbeat. Anything that may block goes to a goroutine (slow).
func (l *pollLoop) service(s *stream) {
	tk := s.tk.Load()
	if tk.ended.Load() || tk.busy.Load() || tk.adopting.Load() {
		return // adopt schedules it again when it is done
	}
	// What the previous stream wrote and did not flush (it stopped mid-batch:
	// told to close, or its history rewritten) is dropped here, before this
	// stream writes anything, its closing included: loopWriter.Write would
	// otherwise take those bytes for the start of this stream's chunk.
	l.chunk = l.chunk[:l.chunkAt]
	if err := tk.unwatched.Load(); err != nil {
		l.end(s, *err)
		return
	}
	if n := s.closing.Load(); n != nil {
		l.close(s, n)
		return
	}
	if len(tk.pending) > 0 {
		return // the socket is full: wait until it can take more
	}
	if s.degraded.Load() {
		l.slow(s, nil, false)
		return
	}
	batch, overflowed := s.take()
	if tk.tls != nil {
		// crypto/tls writes block: every write is a goroutine's
		if len(batch) > 0 || overflowed || s.beatDue.Load() {
			l.slow(s, batch, overflowed)
		}
		return
	}
	if overflowed {
		l.slow(s, batch, true)
		return
	}
	l.batching = l.ring != nil
	lent := l.lendScratch(s)
	rest, err := s.drainBatch(context.Background(), batch, false)
	l.takeScratch(s, lent)
	l.batching = false
	if err != nil && tk.queued {
		l.sendQueued() // what it wrote goes out before anything else happens to it
		if tk.ended.Load() {
			return
		}
	}
	switch {
	case tk.ended.Load():
		// a send of the round failed and ended it (enqueue submits every
		// submitEvery chunks): nothing may write to its descriptor now
	case errors.Is(err, errNeedsHistory):
		s.batchResumed = true // taken, observed and timed already
		l.slow(s, rest, false)
	case errors.Is(err, errClosing):
		// told to close between two events (a reload): what it wrote of
		// the batch goes out with server_closing, as on net/http (run)
		l.close(s, s.closing.Load())
	case endsItsBody(err):
		l.endBody(s, err)
	case err != nil:
		l.end(s, err)
	}
}

// close ends a stream told to close: server_closing (or the slow-client
// comment) and the end of the body. What its socket does not take at once
// (it was full when the close came, or fills) is written on a goroutine
// within lastWordsTimeout, as on net/http: a client behind for a moment
// still gets its last words (SPEC S8).
func (l *pollLoop) close(s *stream, n *closeNotice) {
	if l.releaseLeaseFirst(s, n) {
		return // it is scheduled again once its lease is gone
	}
	l.closeNow(s, n)
}

// releaseLeaseFirst gives back the share of its principal's cap of a
// stream about to be told to reconnect, and reports whether its closing
// waits until the shared store no longer counts it, as a goroutine's
// would (stream.releaseBeforeClosing), without holding up the loop: the
// stream is scheduled again then, or after leaseGoneWait. What it wrote
// of a batch goes out meanwhile; its closing follows.
func (l *pollLoop) releaseLeaseFirst(s *stream, n *closeNotice) bool {
	tk := s.tk.Load()
	if l.leaseWaiting(tk) {
		return true // an event came meanwhile: the closing still waits
	}
	if n.slow || s.adm == nil {
		return false
	}
	l.setLeaseWait(tk, true)
	resume := func() { // the first of the lease's removal and the timer
		if l.setLeaseWait(tk, false) {
			tk.schedule(s)
		}
	}
	timer := time.AfterFunc(leaseGoneWait, resume)
	if !s.releaseAdmissionThen(resume) {
		l.setLeaseWait(tk, false)
		timer.Stop()
		return false
	}
	l.flushWritten(s)
	return true
}

// leaseWaiting reports whether the stream's closing waits for its lease.
func (l *pollLoop) leaseWaiting(tk *tconn) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return tk.leaseWait
}

// setLeaseWait sets whether the stream's closing waits for its lease, and
// reports whether it did.
func (l *pollLoop) setLeaseWait(tk *tconn, wait bool) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	was := tk.leaseWait
	tk.leaseWait = wait
	return was
}

// closeNow says the stream's last words at once: close calls it once the
// stream's lease is gone, endAll (the loop is stopping) without waiting.
func (l *pollLoop) closeNow(s *stream, n *closeNotice) {
	s.releaseAdmission()
	tk := s.tk.Load()
	if tk.tls != nil || len(tk.pending) > 0 {
		l.closeOnGoroutine(s, n, nil) // crypto/tls writes block; a full socket waits
		return
	}
	lent := l.lendScratch(s)
	_ = s.writeClosing(n)
	l.takeScratch(s, lent)
	l.endBody(s, nil)
}

// endBody ends a cleartext stream with err after what it wrote and did not
// flush, and the last chunk of its body. What the socket does not take at
// once goes out on a goroutine, after what it held, within
// lastWordsTimeout.
func (l *pollLoop) endBody(s *stream, err error) {
	tk := s.tk.Load()
	l.flushWritten(s)
	if len(tk.pending) > 0 { // the end must follow the unsent part
		tk.pending = append(tk.pending, lastChunk...)
	} else {
		_ = tk.send(lastChunk)
	}
	if len(tk.pending) > 0 {
		l.closeOnGoroutine(s, nil, err) // its last bytes are all in pending
		return
	}
	l.end(s, err)
}

// flushWritten sends what the stream wrote and did not flush, or, if its
// socket holds bytes it has not taken, keeps it after them.
func (l *pollLoop) flushWritten(s *stream) {
	tk := s.tk.Load()
	if len(tk.pending) == 0 {
		_ = s.out.Flush()
	} else if at := l.chunkAt + chunkHeadroom; len(l.chunk) > at {
		tk.pending = appendChunk(tk.pending, l.chunk[at:]) // it follows what the socket holds
	}
}

// lendScratch lends the loop's formatting buffer and cursor encoder to a
// stream that has none. A cleartext stream needs them only while the loop
// writes it (what it formats is copied into the round's chunk at once), so
// idle streams do not each keep them (about 150 bytes of buffer, and 100 of
// encoder). A stream that has its own (a TLS stream, written on
// goroutines) keeps using them.
func (l *pollLoop) lendScratch(s *stream) bool {
	if s.buf != nil {
		return false
	}
	s.buf, l.scratch = l.scratch[:0], nil
	s.ids = &l.ids
	return true
}

// takeScratch takes back what lendScratch lent, before the stream can be
// handed to a goroutine (slow) that would write into it.
func (l *pollLoop) takeScratch(s *stream, lent bool) {
	if lent {
		l.scratch, s.buf, s.ids = s.buf[:0], nil, nil
		if cap(l.scratch) > 1<<20 {
			l.scratch = nil // do not keep a huge event's buffer
		}
	}
}

// closeOnGoroutine writes a stream's last words on a goroutine, after
// what its socket has not taken, then gives the stream back to the loop to
// end with err. With n nil, its last words and the end of its body are in
// what the socket has not taken.
func (l *pollLoop) closeOnGoroutine(s *stream, n *closeNotice, err error) {
	tk := s.tk.Load()
	l.lend(s)
	go func() {
		if n != nil {
			_ = tk.sayClosing(s, n)
		} else {
			// the end of a body: the client has the slow-client timeout
			// to take it, as any write (net/http's end of a body waits
			// too); a close hurries it to lastWordsTimeout (the sink's
			// hurry; a stream closing already was hurried when its sink
			// was made)
			_ = tk.bw.Flush()
		}
		l.giveBack(slowResult{s: s, err: err, end: true})
	}()
}

// slow gives the stream a goroutine for work that may block; the loop
// takes it back when the goroutine is done.
func (l *pollLoop) slow(s *stream, batch []queued, overflowed bool) {
	tk, w := s.tk.Load(), l.lend(s)
	go func() {
		err := s.slowDrain(batch, overflowed)
		if err == nil {
			err = w.Flush()
		}
		if n := s.closing.Load(); n != nil && errors.Is(err, errClosing) {
			// told to close while it wrote: what it wrote goes out with
			// server_closing, as on net/http (run)
			l.giveBack(slowResult{s: s, err: tk.sayClosing(s, n), end: true})
			return
		}
		if endsItsBody(err) {
			_ = tk.bw.endBody() // what it wrote, then the end of the body
		}
		l.giveBack(slowResult{s: s, err: err})
	}()
}

// sayClosing writes a lent stream's last words on its goroutine:
// server_closing (or the slow-client comment) and the end of the body.
func (tk *tconn) sayClosing(s *stream, n *closeNotice) error {
	s.releaseBeforeClosing(n)
	if err := s.writeClosing(n); err != nil {
		return err
	}
	return tk.bw.end()
}

// lend hands the stream to a goroutine with blocking writes: the loop
// stops watching it meanwhile.
func (l *pollLoop) lend(s *stream) streamWriter {
	tk := s.tk.Load()
	tk.busy.Store(true)
	// Only a hang-up or an error can be reported now, and the loop ignores
	// a lent stream's events: one-shot, so a level-triggered hang-up does
	// not wake the loop over and over until the goroutine is done.
	// takeReturned re-arms it, and a hang-up still there is reported then.
	l.watch(tk, unix.EPOLLONESHOT)
	if tk.bw == nil { // most cleartext streams never need it
		var to sink = connSink{tk.tls, &s.closing} // hurried by hurryConn, set on adoption
		if tk.tls == nil {
			to = newFDSink(s, tk.sock())
		}
		tk.bw = &connWriter{to: to, timeout: time.Duration(s.h.SlowClientTimeout)}
	}
	tk.bw.framed = append(tk.bw.framed[:0], tk.pending...)
	tk.pending = nil
	tk.blocked.Store(0) // the goroutine's writes have their own deadline
	s.out = tk.bw
	return tk.bw
}

// giveBack returns a stream from its goroutine to the loop; once the loop
// has stopped (endAll), the goroutine ends the stream itself.
func (l *pollLoop) giveBack(r slowResult) {
	l.mu.Lock()
	if l.stopped {
		l.endOnGoroutine(r) // unlocks
		return
	}
	l.returned = append(l.returned, r)
	l.mu.Unlock()
	l.wake()
}

// endOnGoroutine ends a stream given back after its loop stopped: endAll
// left its descriptor open (shut down) for the goroutine that was writing
// it. Called with l.mu held, which it releases: endAll decides under the
// same lock, so the descriptor is closed by one side only.
func (l *pollLoop) endOnGoroutine(r slowResult) {
	tk := r.s.tk.Load()
	if !tk.ended.CompareAndSwap(false, true) {
		l.mu.Unlock()
		return
	}
	delete(l.byToken, tk.token)
	r.s.releaseAdmission()
	tk.closeConn()
	l.mu.Unlock()
	l.count.Add(-1)
	err := r.err
	if err == nil {
		err = errStopping
	}
	r.s.finish(context.Background(), err)
	r.s.release()
}

// slowDrain is the part of a stream's work that may block on the history.
func (s *stream) slowDrain(batch []queued, overflowed bool) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(s.h.SlowClientTimeout))
	defer cancel()
	if s.degraded.Load() {
		return s.drainDegraded(ctx)
	}
	_, err := s.drainBatch(ctx, batch, overflowed)
	return err
}

func (l *pollLoop) takeReturned() {
	l.mu.Lock()
	returned := l.returned
	l.returned = nil
	l.mu.Unlock()
	for _, r := range returned {
		tk := r.s.tk.Load()
		r.s.out = &tk.lw
		if tk.tls == nil {
			r.s.buf, r.s.ids = nil, nil // its goroutine is done with them; the loop lends its own
		}
		tk.busy.Store(false)
		if r.err != nil || r.end {
			l.end(r.s, r.err)
			continue
		}
		l.watch(tk, unix.EPOLLIN|unix.EPOLLRDHUP)
		if !r.s.degraded.Load() || r.s.hasQueued() || r.s.closing.Load() != nil || r.s.beatDue.Load() {
			// a degraded stream with nothing to do waits for the registry's
			// ticker (it pokes it once the backend answers) or a poke:
			// serviced at once, it would be lent to a goroutine again and
			// again while the backend is down. A close or a heartbeat that
			// came while it was lent was not serviced (it was busy): now.
			l.schedule(r.s)
		}
	}
}
