//go:build linux

package caddysse

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
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

// clockEvery is how many streams of a round share a reading of the clock:
// a stream's delivery takes a few µs, so their writes' stamps (the latency
// metric, in ms; the heartbeat's last write) are off by well under 0.1 ms.
const clockEvery = 16

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
			l.shard = loopShard(len(ls.loops))
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
	shard uint8 // its copy of the per-delivery metrics, which its streams write
	// clock is the time (Unix ns) its streams stamp their writes with
	// during a round, read once every clockEvery streams rather than
	// twice per stream (about 0.1 µs per delivery here); 0 between rounds.
	clock int64
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
	leaseWait bool                  // told to close, it waits for its lease to leave the shared store (pollLoop.close); under loop.mu
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
		if l.ring != nil {
			l.ring.KeepProcessor() // the loop's sends never wait
		}
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
	s.shard = l.shard
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
	l.count.Add(1)
	// added under the lock: endAll, which ends every stream of byToken
	// (closing its descriptor), must not end this one between the two, or
	// this would add a closed descriptor, or one the kernel has given to
	// a new connection meanwhile, to the epoll instance
	ev := tk.event(unix.EPOLLIN | unix.EPOLLRDHUP)
	if err := epollAddRaw(l.epfd, fd, &ev); err != nil {
		// the loop ends it: it may be writing or ending it already (the
		// stream could be scheduled as soon as tk was stored), and a
		// stream must end once
		tk.unwatched.Store(&err)
	}
	l.mu.Unlock()
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
		s.releaseBeforeClosing(n)
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
// It ends once the loop is stopped: shutdown makes the eventfd readable,
// which it leaves so (level-triggered: every epoll_wait returns at once
// from then on), then closes stop; endAll waits for poll to have ended
// before it closes the descriptors poll waits on (closing an epoll
// instance does not wake a thread blocked on it).
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
