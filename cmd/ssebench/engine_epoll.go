//go:build linux

package main

import (
	"container/heap"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/caddy-sse/caddy-sse/internal/uring"
)

// epollEngine holds HTTP/1.1 cleartext streams on raw non-blocking sockets
// driven by a few epoll loops (one per worker), without a goroutine, a
// bufio buffer or a net.Conn per connection: per event it costs the
// readiness notification, one read(2) into the worker's shared buffer, the
// chunked decoding and the SSE parsing, all in place. This keeps the load
// generator's CPU and memory small next to the server's on a shared box.
type epollEngine struct {
	k       *core
	workers []*worker
}

// connection states
const (
	stIdle = iota
	stConnecting
	stSending
	stHead
	stBody
)

type timerKind uint8

const (
	tReopen timerKind = iota
	tHold
	tHeadTimeout
)

type wtimer struct {
	at   int64
	c    *client
	gen  uint32
	kind timerKind
}

type timerHeap []wtimer

func (h timerHeap) Len() int           { return len(h) }
func (h timerHeap) Less(i, j int) bool { return h[i].at < h[j].at }
func (h timerHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *timerHeap) Push(x any)        { *h = append(*h, x.(wtimer)) }
func (h *timerHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

type worker struct {
	k     *core
	st    *stats
	epfd  int
	wakeR int
	wakeW int

	mu      sync.Mutex
	pending []*client
	woken   atomic.Bool
	stopReq atomic.Bool

	conns    map[int]*client
	timers   timerHeap
	buf      []byte
	stopping bool
	done     chan struct{}

	// ring, with -uring where the kernel allows it, reads the streams one
	// epoll_wait reported with one system call: a read(2) each costs the
	// tool more than the SSE parsing on a machine where system calls are
	// dear. ios and readers are that round's reads, slots their buffers.
	ring    *uring.Ring
	ios     []uring.IO
	readers []*client
	toEOF   []bool // the stream's end was reported with its readiness
	slots   []byte
	readFn  func(i, n int, err error)
}

// maxReady is how many readiness events one epoll_wait returns at most.
const maxReady = 512

// slotSize is one batched read's buffer; a read that fills it is followed
// by read(2) calls until the socket is empty.
const slotSize = 4096

// IP_BIND_ADDRESS_NO_PORT (linux/in.h): bind the source address but pick
// the port at connect time, per destination, so that many source addresses
// times ports do not run out under churn.
const ipBindAddressNoPort = 24

func newEpollEngine(opts engineOpts) (*epollEngine, error) {
	n := max(opts.workers, 1)
	e := &epollEngine{k: newCore(opts, n)}
	for i := range n {
		w, err := newWorker(e.k, e.k.shards[i])
		if err != nil {
			for _, w := range e.workers {
				w.stopReq.Store(true)
				w.wake()
			}
			return nil, err
		}
		e.workers = append(e.workers, w)
		go w.loop()
	}
	return e, nil
}

func (e *epollEngine) name() string {
	if len(e.workers) > 0 && e.workers[0].ring != nil {
		return "epoll+io_uring"
	}
	return "epoll"
}
func (e *epollEngine) core() *core { return e.k }

func (e *epollEngine) shardFor(id int) *stats {
	return e.workers[id%len(e.workers)].st
}

func (e *epollEngine) start(c *client) {
	w := e.workers[c.id%len(e.workers)]
	w.mu.Lock()
	w.pending = append(w.pending, c)
	w.mu.Unlock()
	w.wake()
}

func (e *epollEngine) closeAll(timeout time.Duration) error {
	for _, w := range e.workers {
		w.stopReq.Store(true)
		w.wake()
	}
	deadline := time.After(timeout)
	for _, w := range e.workers {
		select {
		case <-w.done:
		case <-deadline:
			return errors.New("epoll workers did not stop in time")
		}
	}
	return nil
}

func newWorker(k *core, st *stats) (*worker, error) {
	epfd, err := syscall.EpollCreate1(syscall.EPOLL_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("epoll_create1: %v", err)
	}
	var p [2]int
	if err := syscall.Pipe2(p[:], syscall.O_NONBLOCK|syscall.O_CLOEXEC); err != nil {
		syscall.Close(epfd)
		return nil, fmt.Errorf("pipe2: %v", err)
	}
	ev := syscall.EpollEvent{Events: syscall.EPOLLIN, Fd: int32(p[0])}
	if err := syscall.EpollCtl(epfd, syscall.EPOLL_CTL_ADD, p[0], &ev); err != nil {
		syscall.Close(epfd)
		syscall.Close(p[0])
		syscall.Close(p[1])
		return nil, fmt.Errorf("epoll_ctl: %v", err)
	}
	w := &worker{
		k: k, st: st, epfd: epfd, wakeR: p[0], wakeW: p[1],
		conns: map[int]*client{},
		buf:   make([]byte, 64<<10),
		done:  make(chan struct{}),
	}
	if k.opts.uring {
		var err error
		if w.ring, err = uring.New(maxReady); err != nil {
			k.noteErr("io_uring unavailable, reading with read(2): " + err.Error())
		} else {
			w.slots = make([]byte, maxReady*slotSize)
			w.readFn = w.readDone
		}
	}
	return w, nil
}

func (w *worker) wake() {
	if w.woken.CompareAndSwap(false, true) {
		_, _ = syscall.Write(w.wakeW, []byte{1})
	}
}

func (w *worker) loop() {
	defer close(w.done)
	events := make([]syscall.EpollEvent, maxReady)
	var drain [64]byte
	for {
		timeout := 100
		if len(w.timers) > 0 {
			d := (w.timers[0].at - monoNow() + 999_999) / 1e6
			timeout = int(min(max(d, 0), 100))
		}
		n, err := syscall.EpollWait(w.epfd, events, timeout)
		if err != nil && err != syscall.EINTR {
			w.k.noteErr("epoll_wait: " + err.Error())
			n = 0
			time.Sleep(10 * time.Millisecond)
		}
		if n > 0 {
			w.k.cnt.waits.Add(1)
			w.k.cnt.ready.Add(int64(n))
		}
		for i := range n {
			fd := int(events[i].Fd)
			if fd == w.wakeR {
				w.woken.Store(false)
				for {
					if m, _ := syscall.Read(w.wakeR, drain[:]); m <= 0 {
						break
					}
				}
				continue
			}
			c := w.conns[fd]
			switch {
			case c == nil:
			case w.ring != nil && (c.state == stHead || c.state == stBody):
				w.queueRead(c, events[i].Events&endEvents != 0)
			default:
				w.handle(c, events[i].Events)
			}
		}
		w.readQueued()
		now := monoNow()
		for len(w.timers) > 0 && w.timers[0].at <= now {
			w.fire(heap.Pop(&w.timers).(wtimer), now)
		}
		if w.stopReq.Load() {
			w.shutdown()
			return
		}
		w.mu.Lock()
		pending := w.pending
		w.pending = nil
		w.mu.Unlock()
		for _, c := range pending {
			w.open(c, monoNow())
		}
	}
}

func (w *worker) shutdown() {
	w.stopping = true
	for _, c := range w.conns {
		if c.state == stBody {
			w.k.cnt.closedByUs.Add(1)
		}
		w.closeFD(c)
	}
	w.timers = nil
	syscall.Close(w.epfd)
	syscall.Close(w.wakeR)
	syscall.Close(w.wakeW)
	if w.ring != nil {
		w.ring.Close()
	}
}

func (w *worker) push(c *client, at int64, kind timerKind) {
	heap.Push(&w.timers, wtimer{at: at, c: c, gen: c.gen, kind: kind})
}

func (w *worker) fire(t wtimer, now int64) {
	c := t.c
	if c.gen != t.gen {
		return // the connection it was for is gone
	}
	switch t.kind {
	case tReopen:
		if c.fd < 0 && !w.stopping {
			w.k.cnt.reconnects.Add(1)
			w.open(c, now)
		}
	case tHold:
		if c.state == stBody {
			w.k.cnt.closedByUs.Add(1)
			w.closeFD(c)
		}
	case tHeadTimeout:
		if c.fd >= 0 && c.state != stBody {
			w.attemptFailed(c, "timeout before the response head")
		}
	}
}

// open starts a connection attempt for c.
func (w *worker) open(c *client, now int64) {
	c.gen++
	c.opened = now
	// what an earlier stream cut mid-event left must not join this one
	c.parser.reset()
	w.k.cnt.attempts.Add(1)
	dst := c.tgt.addr
	var (
		fd  = -1
		err error
		sa  syscall.Sockaddr
	)
	if dst.Addr().Is4() {
		fd, err = syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_NONBLOCK|syscall.SOCK_CLOEXEC, 0)
		if err == nil {
			if src := w.k.nextSrc(); src.IsValid() {
				_ = syscall.SetsockoptInt(fd, syscall.IPPROTO_IP, ipBindAddressNoPort, 1)
				err = syscall.Bind(fd, &syscall.SockaddrInet4{Addr: src.As4()})
			}
		}
		sa = &syscall.SockaddrInet4{Port: int(dst.Port()), Addr: dst.Addr().As4()}
	} else {
		fd, err = syscall.Socket(syscall.AF_INET6, syscall.SOCK_STREAM|syscall.SOCK_NONBLOCK|syscall.SOCK_CLOEXEC, 0)
		sa = &syscall.SockaddrInet6{Port: int(dst.Port()), Addr: dst.Addr().As16()}
	}
	if err == nil {
		err = syscall.Connect(fd, sa)
		if err == syscall.EINPROGRESS {
			err = nil
		}
	}
	if err == nil {
		ev := syscall.EpollEvent{Events: syscall.EPOLLOUT | syscall.EPOLLIN | syscall.EPOLLRDHUP, Fd: int32(fd)}
		err = syscall.EpollCtl(w.epfd, syscall.EPOLL_CTL_ADD, fd, &ev)
	}
	if err != nil {
		if fd >= 0 {
			syscall.Close(fd)
		}
		w.k.noteErr("connect: " + err.Error())
		w.k.cnt.failed.Add(1)
		w.retryLater(c, now)
		return
	}
	c.fd = fd
	c.state = stConnecting
	c.req = appendRequest(c.req[:0], c)
	c.reqOff = 0
	c.head = c.head[:0]
	c.chunk = chunkDecoder{}
	w.conns[fd] = c
	if t := w.k.opts.headTimeout; t > 0 {
		w.push(c, now+int64(t), tHeadTimeout)
	}
}

// appendRequest appends the GET a browser's EventSource would send.
func appendRequest(dst []byte, c *client) []byte {
	dst = append(dst, "GET "...)
	dst = append(dst, c.uri...)
	dst = append(dst, " HTTP/1.1\r\nHost: "...)
	dst = append(dst, c.tgt.host...)
	dst = append(dst, "\r\nAccept: text/event-stream\r\nCache-Control: no-cache\r\nUser-Agent: ssebench\r\n"...)
	if id := c.parser.lastID; len(id) > 0 {
		dst = append(dst, "Last-Event-ID: "...)
		dst = append(dst, id...)
		dst = append(dst, "\r\n"...)
	}
	return append(dst, "\r\n"...)
}

func (w *worker) handle(c *client, ev uint32) {
	switch c.state {
	case stConnecting:
		if ev&(syscall.EPOLLOUT|syscall.EPOLLERR|syscall.EPOLLHUP) == 0 {
			return
		}
		v, err := syscall.GetsockoptInt(c.fd, syscall.SOL_SOCKET, syscall.SO_ERROR)
		if err == nil && v != 0 {
			err = syscall.Errno(v)
		}
		if err != nil {
			w.attemptFailed(c, "connect: "+err.Error())
			return
		}
		c.state = stSending
		fallthrough
	case stSending:
		for c.reqOff < len(c.req) {
			n, err := syscall.Write(c.fd, c.req[c.reqOff:])
			if err == syscall.EINTR {
				continue
			}
			if err == syscall.EAGAIN {
				return
			}
			if err != nil {
				w.attemptFailed(c, "write: "+err.Error())
				return
			}
			c.reqOff += n
		}
		// Edge-triggered: a level-triggered socket is polled again at the
		// next epoll_wait after its read emptied it, which cost about an
		// eighth of the tool's CPU in the fan-out (perf: sock_poll and
		// tcp_poll under ep_send_events). Every read now empties the socket.
		mod := syscall.EpollEvent{Events: syscall.EPOLLIN | syscall.EPOLLRDHUP | unix.EPOLLET, Fd: int32(c.fd)}
		if err := syscall.EpollCtl(w.epfd, syscall.EPOLL_CTL_MOD, c.fd, &mod); err != nil {
			w.attemptFailed(c, "epoll_ctl: "+err.Error())
			return
		}
		c.state = stHead
	case stHead, stBody:
		w.read(c, ev&endEvents != 0)
	}
}

// endEvents are the readiness events that report the stream's end (a FIN,
// a reset or an error).
const endEvents = syscall.EPOLLRDHUP | syscall.EPOLLHUP | syscall.EPOLLERR

// read reads c until its socket is empty (its readiness is edge-triggered).
// A short read means empty, unless the end was reported: a FIN that came
// with the last bytes stops the read that returns them, and is read (as 0)
// only by the next one; no readiness event reports it again.
func (w *worker) read(c *client, toEOF bool) {
	for {
		w.k.cnt.reads.Add(1)
		n, err := syscall.Read(c.fd, w.buf)
		if err == syscall.EINTR {
			continue
		}
		if !w.took(c, w.buf, n, err) || (n < len(w.buf) && !toEOF) {
			return
		}
	}
}

// took handles what a read into buf returned; false if the socket is
// empty or the connection gone.
func (w *worker) took(c *client, buf []byte, n int, err error) bool {
	if err == syscall.EAGAIN {
		return false
	}
	if err != nil {
		if c.state == stHead {
			w.attemptFailed(c, "read: "+err.Error())
		} else {
			w.ended(c, "read: "+err.Error())
		}
		return false
	}
	if n == 0 {
		if c.state == stHead {
			w.attemptFailed(c, "closed before the response head")
		} else if c.chunked || c.bodyLen > 0 {
			w.ended(c, "stream cut (no last chunk)")
		} else {
			w.ended(c, "")
		}
		return false
	}
	return w.process(c, buf[:n], monoNow())
}

// queueRead adds a ready stream to the round's batched reads.
func (w *worker) queueRead(c *client, toEOF bool) {
	at := len(w.ios) * slotSize
	w.ios = append(w.ios, uring.IO{FD: c.fd, Buf: w.slots[at : at+slotSize], Recv: true})
	w.readers = append(w.readers, c)
	w.toEOF = append(w.toEOF, toEOF)
}

// readQueued reads the round's ready streams with one system call.
func (w *worker) readQueued() {
	if len(w.ios) == 0 {
		return
	}
	if err := w.ring.Submit(w.ios, w.readFn); err != nil {
		// the ring is broken: read on with read(2) (a read it did and
		// could not report would show as lost events)
		w.k.noteErr("io_uring: " + err.Error())
		w.ring.Close()
		w.ring = nil
		for i, c := range w.readers {
			if c != nil && w.ios[i].FD == c.fd {
				w.read(c, w.toEOF[i])
			}
		}
	}
	clear(w.readers)
	w.ios, w.readers, w.toEOF = w.ios[:0], w.readers[:0], w.toEOF[:0]
}

// readDone handles the i-th batched read.
func (w *worker) readDone(i, n int, err error) {
	c, buf := w.readers[i], w.ios[i].Buf
	w.readers[i] = nil
	w.k.cnt.reads.Add(1)
	if err == syscall.EINTR || (w.took(c, buf, n, err) && (n == len(buf) || w.toEOF[i])) {
		w.read(c, w.toEOF[i]) // there may be more, or the end
	}
}

// process handles bytes read; it returns false once the connection is gone.
func (w *worker) process(c *client, b []byte, now int64) bool {
	if c.state == stHead {
		c.head = append(c.head, b...)
		k := headEnd(c.head)
		if k < 0 {
			if len(c.head) > 16<<10 {
				w.attemptFailed(c, "response head too large")
				return false
			}
			return true
		}
		h, err := parseResponseHead(c.head[:k])
		if err != nil {
			w.attemptFailed(c, err.Error())
			return false
		}
		if h.status != 200 {
			// EventSource gives up for good on any other status
			w.k.noteErr(fmt.Sprintf("status %d", h.status))
			w.k.cnt.failed.Add(1)
			w.k.cnt.gaveUp.Add(1)
			w.closeFD(c)
			return false
		}
		c.state = stBody
		c.chunked = h.chunked
		c.bodyLen = h.contentLength
		w.connected(c, now, h.truncated)
		b = c.head[k:]
		defer func() { c.head = nil }()
	}
	// no return on an empty b: a Content-Length: 0 body is whole (done)
	// with no byte after the head
	done := false
	if c.chunked {
		var err error
		b, done, err = c.chunk.Decode(b)
		if err != nil {
			w.ended(c, err.Error())
			return false
		}
	} else if c.bodyLen >= 0 {
		if int64(len(b)) >= c.bodyLen {
			b, done = b[:c.bodyLen], true
		}
		c.bodyLen -= int64(len(b))
	}
	// a read of chunk framing only decodes to no body bytes
	if len(b) > 0 {
		if err := c.feed(b, now); err != nil {
			w.ended(c, err.Error())
			return false
		}
	}
	if done {
		w.ended(c, "")
		return false
	}
	return true
}

func (w *worker) connected(c *client, now int64, truncated bool) {
	k := w.k
	k.cnt.connected.Add(1)
	k.cnt.live.Add(1)
	if c.everConnected.CompareAndSwap(false, true) {
		k.cnt.firstConnected.Add(1)
	}
	c.connects.Add(1)
	if truncated {
		k.cnt.truncatedHead.Add(1)
	}
	c.st.mu.Lock()
	c.st.connLat.Record(now - c.opened)
	c.st.mu.Unlock()
	if c.hold > 0 {
		w.push(c, now+int64(c.hold), tHold)
	}
}

func (w *worker) closeFD(c *client) {
	if c.fd >= 0 {
		delete(w.conns, c.fd)
		syscall.Close(c.fd) // also leaves the epoll set
		c.fd = -1
	}
	if c.state == stBody {
		w.k.cnt.live.Add(-1)
	}
	c.state = stIdle
	c.gen++
}

// attemptFailed: the attempt failed before the stream began; a browser
// tries again after the reconnection time.
func (w *worker) attemptFailed(c *client, kind string) {
	w.k.noteErr(kind)
	w.k.cnt.failed.Add(1)
	w.closeFD(c)
	w.retryLater(c, monoNow())
}

// ended: the stream ended (the server closed it, or it broke); a browser
// reconnects after the reconnection time with its Last-Event-ID.
func (w *worker) ended(c *client, kind string) {
	if kind != "" {
		w.k.noteErr(kind)
	}
	w.k.cnt.ended.Add(1)
	w.closeFD(c)
	w.retryLater(c, monoNow())
}

func (w *worker) retryLater(c *client, now int64) {
	if !c.reconnect || w.stopping || w.stopReq.Load() {
		return
	}
	w.push(c, now+int64(c.retryDelay(w.k.opts.defaultRetry)), tReopen)
}

func openEpollEngine(opts engineOpts) (engine, error) {
	e, err := newEpollEngine(opts)
	if err != nil {
		return nil, err
	}
	return e, nil
}
