//go:build linux

package caddysse

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"os"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/caddy-sse/caddy-sse/internal/uring"
	"github.com/caddy-sse/caddy-sse/replay"
)

// loopSet is one event loop per CPU; a stream goes to the loop with the
// fewest streams. The loops start with the first stream.
type loopSet struct {
	mu        sync.Mutex
	loops     []*pollLoop
	destroyed bool
	// noRing is why the loops write each stream with its own write(2)
	// instead of sending a round's writes through io_uring; nil if they
	// use io_uring.
	noRing error
}

// ringEntries is how many sends one io_uring system call takes at most:
// room for what a loop queues before it submits (submitEvery), and no more
// (16 KiB of submissions, 8 KiB of completions per loop).
const ringEntries = 2 * submitEvery

// ringSwitch turns io_uring off when set to 0 (for comparing the two, or
// where io_uring misbehaves); by default it is used where the kernel
// allows it.
const ringSwitch = "CADDY_SSE_IO_URING"

func newLoopSet() *loopSet {
	ls := &loopSet{}
	if os.Getenv(ringSwitch) == "0" {
		ls.noRing = errors.New(ringSwitch + "=0")
		return ls
	}
	probe, err := uring.New(ringEntries) // cheap: no loop runs yet
	if err != nil {
		ls.noRing = err
		return ls
	}
	probe.Close()
	return ls
}

// sendsBy says how the loops write.
func (ls *loopSet) sendsBy() string {
	if ls.noRing != nil {
		return "write(2) per stream (io_uring: " + ls.noRing.Error() + ")"
	}
	return "io_uring, one system call per 128 streams"
}

func (ls *loopSet) supported() bool { return true }

// running returns the loops, starting them the first time; nil once the
// set is destroyed or if they cannot start.
func (ls *loopSet) running() []*pollLoop {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.destroyed {
		return nil
	}
	if ls.loops == nil {
		for range runtime.GOMAXPROCS(0) {
			l, err := newPollLoop(ls.noRing == nil)
			if err != nil {
				break
			}
			ls.loops = append(ls.loops, l)
			go l.run()
		}
	}
	return ls.loops
}

// adopt gives a taken-over stream to a loop; false if there is no loop to
// take it (it then keeps a goroutine). A cleartext stream's socket is
// detached from Go and written by the loop. A TLS stream (tc) keeps its
// connection: the loop watches the socket for the client leaving, and
// writes go through tc on a goroutine started for each batch. The loop uses
// that socket's own descriptor, not a duplicate (a process may open few
// files); Go keeps it open until the loop closes tc's socket (closeConn),
// after removing it from its epoll set.
func (ls *loopSet) adopt(s *stream, tcp *net.TCPConn, tc *tls.Conn) bool {
	l := ls.leastBusy()
	if l == nil {
		return false
	}
	grab := detach
	if tc != nil {
		grab = socketFD
	}
	fd, err := grab(tcp)
	if err != nil {
		return false
	}
	if tc == nil {
		s.buf, s.ids = nil, nil // the loop lends them while it writes (lendScratch)
	}
	l.adopt(s, &tconn{loop: l, fd: int32(fd), tls: tc})
	return true
}

func (ls *loopSet) leastBusy() *pollLoop {
	loops := ls.running()
	if len(loops) == 0 {
		return nil
	}
	l := loops[0]
	for _, other := range loops[1:] {
		if other.count.Load() < l.count.Load() {
			l = other
		}
	}
	return l
}

// Destruct stops the loops and closes what they still hold.
func (ls *loopSet) Destruct() error {
	ls.mu.Lock()
	ls.destroyed = true
	loops := ls.loops
	ls.mu.Unlock()
	for _, l := range loops {
		l.shutdown()
	}
	return nil
}

// pollLoop writes the streams it was given from one goroutine: an epoll
// instance tells it when a client leaves or its socket can take more, and
// Deliver schedules a stream when it has something to write. Writes never
// block: what a socket does not take waits for it to be writable, and the
// stream takes no more events until then (its queue fills, overflows, and
// it catches up later, as on net/http). Work that could block — reading the
// history after an overflow or a gap, or while degraded — runs on a
// goroutine of its own for the time it takes.
type pollLoop struct {
	epfd, wakefd int

	mu       sync.Mutex
	ready    []*stream
	spare    []*stream
	returned []slowResult
	// byToken finds a stream from its epoll events. A token is never
	// reused, unlike a file descriptor: an event returned for a connection
	// that was closed meanwhile cannot reach another that got its number.
	byToken   map[uint64]*stream
	lastToken uint64
	closed    bool
	// stopped is set when the loop ends its streams (endAll): from then on
	// a goroutine that gives a stream back ends it itself.
	stopped bool

	count atomic.Int64
	// chunk holds the chunks written in this round (loop goroutine
	// only); the current stream's starts at chunkAt.
	chunk   []byte
	chunkAt int
	// scratch and ids are the formatting buffer and cursor encoder lent
	// to the stream being written (lendScratch).
	scratch []byte
	ids     replay.CursorEncoder
	// ring, if io_uring is available, sends what the streams of a round
	// wrote with one system call; queue is those sends, to whom.
	ring   *uring.Ring
	queue  []uring.IO
	owner  []*stream
	sentFn func(i, n int, err error) // l.sent, made once
	// batching is set while a round's streams write: a flush then
	// queues its chunk instead of writing it.
	batching bool

	kick   chan struct{} // something was scheduled or returned
	events chan []unix.EpollEvent
	ack    chan struct{} // the loop has handled the events it was sent
	stop   chan struct{}
	done   chan struct{}
	polled chan struct{} // poll has ended
}

// tconn is a taken-over stream's connection as its loop sees it.
//
// Every idle cleartext stream keeps one, so its small fields are packed
// together (112 bytes, not 128).
type tconn struct {
	loop  *pollLoop
	token uint64
	// tls is the connection of a TLS stream: the loop only watches fd, a
	// goroutine writes through tls (nil for cleartext streams).
	tls       *tls.Conn
	bw        *connWriter // the writer of its goroutines, made when first needed
	lw        loopWriter
	fd        int32 // ours alone (see detach); a TLS stream's is its socket's
	scheduled atomic.Bool
	busy      atomic.Bool // a goroutine of its own has the stream
	adopting  atomic.Bool // adopt has not added it to the epoll instance yet
	ended     atomic.Bool // claimed by whoever ends it: the loop (end), or a hand-off to a stopping loop
	outArmed  bool
	queued    bool                  // a send of it waits in the loop's queue
	blocked   atomic.Int64          // Unix nanoseconds since the socket stopped taking bytes; 0 if it takes them
	pending   []byte                // bytes the socket has not taken yet
	unwatched atomic.Pointer[error] // the epoll instance refused it: the loop ends it
}

// sock is the connection's file descriptor.
func (tk *tconn) sock() int { return int(tk.fd) }

type slowResult struct {
	s   *stream
	err error
	end bool // the stream is done: end it
}

const chunkHeadroom = 16 // room for a chunk's size line

var headroom [chunkHeadroom]byte

func newPollLoop(withRing bool) (*pollLoop, error) {
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, err
	}
	wakefd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		unix.Close(epfd)
		return nil, err
	}
	l := &pollLoop{epfd: epfd, wakefd: wakefd, byToken: make(map[uint64]*stream),
		kick: make(chan struct{}, 1), events: make(chan []unix.EpollEvent), ack: make(chan struct{}),
		stop: make(chan struct{}), done: make(chan struct{}), polled: make(chan struct{})}
	ev := unix.EpollEvent{Events: unix.EPOLLIN} // token 0: wakeToken
	if err := unix.EpollCtl(epfd, unix.EPOLL_CTL_ADD, wakefd, &ev); err != nil {
		unix.Close(epfd)
		unix.Close(wakefd)
		return nil, err
	}
	if withRing {
		l.ring, _ = uring.New(ringEntries) // without it, a write(2) per stream
	}
	l.sentFn = l.sent
	return l, nil
}

// adopt makes the loop watch and write the stream; it ends the stream if
// it cannot.
func (l *pollLoop) adopt(s *stream, tk *tconn) {
	fd := tk.sock()
	tk.lw = loopWriter{tk: tk, s: s}
	// the loop may see the connection's events as soon as it is added:
	// the stream must be ready for them by then. Until it is added the
	// loop leaves it alone: ending it meanwhile (a close scheduled by a
	// reload) would close a descriptor this goroutine is about to add.
	tk.adopting.Store(true)
	s.out = &tk.lw
	s.tk.Store(tk)
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		// the loops are stopping (a reload or a stop, which told the
		// stream to close, or will): it ends here, with its last words.
		// The loop may have ended it already if it was scheduled meanwhile.
		if tk.ended.CompareAndSwap(false, true) {
			go s.endUnadopted(tk)
		}
		return
	}
	l.lastToken++
	tk.token = l.lastToken
	l.byToken[tk.token] = s
	l.mu.Unlock()
	l.count.Add(1)
	ev := tk.event(unix.EPOLLIN | unix.EPOLLRDHUP)
	if err := epollAddRaw(l.epfd, fd, &ev); err != nil {
		// the loop ends it: it may be writing or ending it already (the
		// stream could be scheduled as soon as tk was stored), and a
		// stream must end once
		tk.unwatched.Store(&err)
	}
	tk.adopting.Store(false)
	l.schedule(s) // whatever was queued while the stream started, or its end
}

// endUnadopted ends a stream whose loop stopped before it could adopt it,
// on a goroutine of its own: server_closing if it was told to close, the
// end of the body, and the connection.
func (s *stream) endUnadopted(tk *tconn) {
	var to sink = connSink{tk.tls, &s.closing}
	if tk.tls == nil {
		to = &fdSink{fd: tk.sock()}
	}
	cw := &connWriter{to: to, timeout: lastWordsTimeout}
	s.out = cw
	var err error
	if n := s.closing.Load(); n != nil {
		err = s.writeClosing(n)
	}
	if err == nil {
		err = cw.end()
	}
	s.releaseAdmission()
	tk.closeConn()
	s.finish(context.Background(), errors.Join(err, errStopping))
	s.release()
}

// closeConn closes the stream's connection: our descriptor, or a TLS
// stream's socket (without waiting to send close_notify: the chunked body
// has ended, or the client is gone).
func (tk *tconn) closeConn() {
	if tk.tls != nil {
		_ = tk.tls.NetConn().Close()
		return
	}
	unix.Close(tk.sock())
}

// detach takes the socket out of Go's hands: a duplicate of its file
// descriptor stays (non-blocking, as Go left it) and the net.TCPConn is
// closed, which frees its poll descriptor, addresses and buffers — a few
// hundred bytes per idle stream. The socket itself stays open through the
// duplicate.
func detach(tcp *net.TCPConn) (int, error) {
	raw, err := tcp.SyscallConn()
	if err != nil {
		return -1, err
	}
	dup, derr := -1, error(nil)
	if err := raw.Control(func(f uintptr) { dup, derr = dupRaw(f) }); err != nil {
		return -1, err
	}
	if derr != nil {
		return -1, derr
	}
	_ = tcp.Close()
	return dup, nil
}

// The hand-off's two system calls that cannot block are made raw, without
// telling the Go scheduler. During a burst of new streams the scheduler
// took each such call on a request goroutine for one that might block and
// handed its processor to another thread: after a ramp of 10k streams the
// server had 11 to 114 threads, whose stacks count in its memory; with
// raw calls it keeps 10 (docs/PERFORMANCE.md).

// dupRaw duplicates fd (close-on-exec).
func dupRaw(fd uintptr) (int, error) {
	r, _, errno := unix.RawSyscall(unix.SYS_FCNTL, fd, unix.F_DUPFD_CLOEXEC, 0)
	if errno != 0 {
		return -1, errno
	}
	return int(r), nil
}

// epollAddRaw adds fd to the epoll instance epfd.
func epollAddRaw(epfd, fd int, ev *unix.EpollEvent) error {
	_, _, errno := unix.RawSyscall6(unix.SYS_EPOLL_CTL, uintptr(epfd), unix.EPOLL_CTL_ADD, uintptr(fd),
		uintptr(unsafe.Pointer(ev)), 0, 0)
	if errno != 0 {
		return errno
	}
	return nil
}

// socketFD is the socket's descriptor, which Go keeps open until tcp is
// closed.
func socketFD(tcp *net.TCPConn) (int, error) {
	raw, err := tcp.SyscallConn()
	if err != nil {
		return -1, err
	}
	fd := -1
	if err := raw.Control(func(f uintptr) { fd = int(f) }); err != nil {
		return -1, err
	}
	return fd, nil
}

// schedule makes the loop service the stream soon; called by Deliver, the
// registry's ticker and closing. It does not block.
func (l *pollLoop) schedule(s *stream) {
	tk := s.tk.Load()
	if tk.scheduled.Swap(true) {
		return
	}
	l.mu.Lock()
	l.ready = append(l.ready, s)
	l.mu.Unlock()
	l.wake()
}

// wake makes the loop look at what was scheduled or returned.
func (l *pollLoop) wake() {
	select {
	case l.kick <- struct{}{}:
	default:
	}
}

// run is the loop. It waits on channels, not in epoll_wait: a goroutine
// blocked in a system call would cost every wake-up a hand-off to another
// thread; poll blocks there instead and passes the events on.
func (l *pollLoop) run() {
	defer close(l.done)
	go l.poll()
	for {
		select {
		case <-l.kick:
		case evs := <-l.events:
			for _, ev := range evs {
				l.handle(ev)
			}
			l.ack <- struct{}{}
		case <-l.stop:
			l.endAll()
			return
		}
		l.takeReturned()
		l.serviceReady()
	}
}

// poll waits for the connections' events and hands them to the loop,
// waiting until it has handled them (level-triggered events would come
// back otherwise).
//
// It ends once the loop is stopped: shutdown closes stop, then makes the
// eventfd readable, which it leaves so (level-triggered: every
// epoll_wait returns at once from then on), and endAll waits for poll to
// have ended before it closes the descriptors poll waits on (closing an
// epoll instance does not wake a thread blocked on it).
func (l *pollLoop) poll() {
	defer close(l.polled)
	buf := make([]unix.EpollEvent, 256)
	for {
		n, err := unix.EpollWait(l.epfd, buf, -1)
		if err != nil && !errors.Is(err, unix.EINTR) {
			return
		}
		select {
		case <-l.stop:
			return
		default:
		}
		if n <= 0 {
			continue
		}
		select {
		case l.events <- buf[:n]:
			<-l.ack
		case <-l.stop:
			return
		}
	}
}

// event is an epoll registration for the connection: its data is the
// connection's token (the 64 bits of Fd and Pad).
func (tk *tconn) event(events uint32) unix.EpollEvent {
	return unix.EpollEvent{Events: events, Fd: int32(uint32(tk.token)), Pad: int32(uint32(tk.token >> 32))}
}

func eventToken(ev unix.EpollEvent) uint64 {
	return uint64(uint32(ev.Fd)) | uint64(uint32(ev.Pad))<<32
}

// wakeToken marks the eventfd's events; connection tokens start at 1.
const wakeToken = 0

func (l *pollLoop) handle(ev unix.EpollEvent) {
	if eventToken(ev) == wakeToken {
		return // stopping: left readable, so that poll wakes and sees stop
	}
	l.mu.Lock()
	s := l.byToken[eventToken(ev)]
	l.mu.Unlock()
	if s == nil {
		return
	}
	tk := s.tk.Load()
	if tk.ended.Load() || tk.busy.Load() || tk.adopting.Load() {
		return
	}
	if ev.Events&(unix.EPOLLHUP|unix.EPOLLERR|unix.EPOLLRDHUP) != 0 {
		l.end(s, errClientGone)
		return
	}
	if ev.Events&unix.EPOLLIN != 0 && !l.discardInput(tk) {
		l.end(s, errClientGone)
		return
	}
	if ev.Events&unix.EPOLLOUT != 0 {
		if err := l.flushPending(tk); err != nil {
			l.end(s, err)
			return
		}
		if len(tk.pending) == 0 {
			l.schedule(s)
		}
	}
}

// discardInput reads what a client sends after its request (nothing, from
// a browser); false if the client closed.
func (l *pollLoop) discardInput(tk *tconn) bool {
	var buf [512]byte
	for range 8 {
		n, err := unix.Read(tk.sock(), buf[:])
		switch {
		case n > 0:
			continue
		case errors.Is(err, unix.EAGAIN), errors.Is(err, unix.EINTR):
			return true
		default:
			return false // 0 bytes: the client closed; or an error
		}
	}
	return true
}

func (l *pollLoop) serviceReady() {
	l.mu.Lock()
	batch := l.ready
	l.ready = l.spare[:0]
	l.spare = batch
	l.mu.Unlock()
	for i, s := range batch {
		s.tk.Load().scheduled.Store(false)
		l.service(s)
		batch[i] = nil
	}
	l.sendQueued()
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
		l.slow(s, rest, false)
	case errors.Is(err, errClosing):
		// told to close between two events (a reload): what it wrote of
		// the batch goes out with server_closing, as on net/http (run)
		l.close(s, s.closing.Load())
	case err != nil:
		l.end(s, err)
	}
}

// close ends a stream told to close: server_closing (or the slow-client
// comment) and the end of the body, if the socket takes them at once.
func (l *pollLoop) close(s *stream, n *closeNotice) {
	tk := s.tk.Load()
	if tk.tls != nil {
		l.closeTLS(s, n)
		return
	}
	if len(tk.pending) == 0 {
		lent := l.lendScratch(s)
		_ = s.writeClosing(n)
		l.takeScratch(s, lent)
		if len(tk.pending) == 0 { // else the end would land inside the unsent chunk
			_ = tk.send([]byte("0\r\n\r\n"))
		}
	}
	l.end(s, nil)
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

// closeTLS writes a TLS stream's last words on a goroutine, which then
// gives the stream back to the loop to end.
func (l *pollLoop) closeTLS(s *stream, n *closeNotice) {
	tk := s.tk.Load()
	l.lend(s)
	go func() {
		_ = tk.sayClosing(s, n)
		l.giveBack(slowResult{s: s, end: true})
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
		l.giveBack(slowResult{s: s, err: err})
	}()
}

// sayClosing writes a lent stream's last words on its goroutine:
// server_closing (or the slow-client comment) and the end of the body.
func (tk *tconn) sayClosing(s *stream, n *closeNotice) error {
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
		live, err := s.recover(ctx)
		if err != nil {
			return err
		}
		if !live {
			return s.heartbeatIfDue() // as drain does: proxies must not cut it
		}
		batch, overflowed = s.take()
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

// endAll ends every stream when the loop stops. A cleartext stream lent to
// a goroutine is only shut down: the goroutine may be in the middle of a
// write(2) on its descriptor, and a descriptor closed under it could be
// given to a new connection that would then receive this stream's bytes.
// Its write fails at once instead, and the goroutine ends it (giveBack).
func (l *pollLoop) endAll() {
	l.mu.Lock()
	l.stopped = true
	for _, r := range l.returned {
		r.s.tk.Load().busy.Store(false) // done with its goroutine: ended below
	}
	l.returned = nil
	streams := make([]*stream, 0, len(l.byToken))
	for _, s := range l.byToken {
		if tk := s.tk.Load(); tk.busy.Load() && tk.tls == nil {
			_ = unix.Shutdown(tk.sock(), unix.SHUT_RDWR)
			continue
		}
		streams = append(streams, s)
	}
	l.mu.Unlock()
	for _, s := range streams {
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
	close(l.stop)
	var one = [8]byte{1}
	_, _ = unix.Write(l.wakefd, one[:]) // wakes poll out of epoll_wait
	select {
	case <-l.done:
	case <-time.After(5 * time.Second):
	}
}

// send writes p without blocking; what the socket does not take is kept
// for when it is writable.
func (tk *tconn) send(p []byte) error {
	for len(p) > 0 {
		n, err := unix.Write(tk.sock(), p)
		if n > 0 {
			p = p[n:]
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
