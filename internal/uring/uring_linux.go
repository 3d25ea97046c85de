//go:build linux

// Package uring sends on (or reads from) many sockets with one system
// call, through an io_uring submission queue. It exists for one reason: on machines where
// every system call is expensive (page-table isolation in a VM costs about a
// microsecond per entry and exit), writing one small event to each of
// thousands of sockets costs a system call each; queued here they cost one
// per batch. Nothing waits: each send or receive is tried at once
// (MSG_DONTWAIT) and its result — bytes moved, EAGAIN, or an error — is
// there when Submit returns.
//
// A Ring is used by one goroutine at a time.
package uring

import (
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The kernel ABI (include/uapi/linux/io_uring.h).
const (
	offSQRing = 0
	offSQEs   = 0x10000000

	featSingleMmap = 1 << 0

	setupSubmitAll   = 1 << 7
	setupCoopTaskrun = 1 << 8

	enterGetEvents = 1 << 0

	opSend = 26
	opRecv = 27

	sqeSize = 64
	cqeSize = 16
)

type sqringOffsets struct {
	head, tail, ringMask, ringEntries, flags, dropped, array, resv1 uint32
	userAddr                                                        uint64
}

type cqringOffsets struct {
	head, tail, ringMask, ringEntries, overflow, cqes, flags, resv1 uint32
	userAddr                                                        uint64
}

type params struct {
	sqEntries, cqEntries, flags, sqThreadCPU, sqThreadIdle, features, wqFD uint32
	resv                                                                   [3]uint32
	sqOff                                                                  sqringOffsets
	cqOff                                                                  cqringOffsets
}

type sqe struct {
	opcode   uint8
	flags    uint8
	ioprio   uint16
	fd       int32
	off      uint64
	addr     uint64
	len      uint32
	msgFlags uint32
	userData uint64
	bufIndex uint16
	persona  uint16
	fileIdx  int32
	addr3    uint64
	pad      uint64
}

type cqe struct {
	userData uint64
	res      int32
	flags    uint32
}

// IO is one queued send of Buf, or receive into it: the buffer stays the
// caller's and must not change until Submit returns.
type IO struct {
	FD   int
	Buf  []byte
	Recv bool
}

// Ring is an io_uring instance used only for sends and receives.
type Ring struct {
	fd      int
	ringMem []byte // the submission and completion rings (one mapping)
	sqeMem  []byte

	sqHead, sqTail, cqHead, cqTail *uint32
	sqMask, cqMask, entries        uint32
	sqes                           []sqe
	cqes                           []cqe
	// raw makes Submit's system calls keep the goroutine's processor
	// (KeepProcessor).
	raw bool
}

// New sets up a ring that takes up to entries operations per system call. It
// fails where io_uring is missing or forbidden (old kernels, seccomp
// profiles of container runtimes, io_uring_disabled), or where a send to a
// full socket would wait instead of failing at once: callers then write as
// before.
func New(entries uint32) (*Ring, error) {
	p := params{flags: setupSubmitAll | setupCoopTaskrun}
	fd, err := setup(entries, &p)
	if errors.Is(err, unix.EINVAL) { // a kernel older than 5.19 lacks those flags
		p = params{}
		fd, err = setup(entries, &p)
	}
	if err != nil {
		return nil, err
	}
	r := &Ring{fd: fd}
	if err := r.mapRings(&p); err != nil {
		r.Close()
		return nil, err
	}
	if err := r.selfCheck(); err != nil {
		r.Close()
		return nil, err
	}
	return r, nil
}

// selfCheck makes sure a send to a full socket completes at once with
// EAGAIN: a kernel that instead parked it until the socket drained would
// stall whoever submits (and one that lacks IORING_OP_SEND fails here too).
func (r *Ring) selfCheck() error {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fds[0])
	defer unix.Close(fds[1])
	fill := make([]byte, 64<<10)
	for {
		_, err := unix.Write(fds[0], fill)
		if errors.Is(err, unix.EAGAIN) {
			break
		}
		if err != nil {
			return err
		}
	}
	tail := *r.sqTail
	r.sqes[tail&r.sqMask] = sqe{opcode: opSend, fd: int32(fds[0]), addr: uint64(uintptr(unsafe.Pointer(&fill[0]))),
		len: 1, msgFlags: unix.MSG_DONTWAIT | unix.MSG_NOSIGNAL}
	atomic.StoreUint32(r.sqTail, tail+1)
	for { // submit, without waiting for the completion
		_, _, errno := unix.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), 1, 0, 0, 0, 0)
		if errno == unix.EINTR {
			continue
		}
		if errno != 0 {
			return errno
		}
		break
	}
	runtime.KeepAlive(fill)
	head := *r.cqHead
	if atomic.LoadUint32(r.cqTail) == head {
		return errors.New("io_uring: a send to a full socket waits here instead of failing at once")
	}
	res := r.cqes[head&r.cqMask].res
	atomic.StoreUint32(r.cqHead, head+1)
	if res != -int32(unix.EAGAIN) {
		return fmt.Errorf("io_uring: a send to a full socket returned %d, not EAGAIN", res)
	}
	return nil
}

func setup(entries uint32, p *params) (int, error) {
	fd, _, errno := unix.Syscall(unix.SYS_IO_URING_SETUP, uintptr(entries), uintptr(unsafe.Pointer(p)), 0)
	if errno != 0 {
		return -1, errno
	}
	return int(fd), nil
}

func (r *Ring) mapRings(p *params) error {
	if p.features&featSingleMmap == 0 {
		return errors.New("io_uring: the kernel is too old (no single mmap)")
	}
	sqSize := p.sqOff.array + p.sqEntries*4
	cqSize := p.cqOff.cqes + p.cqEntries*cqeSize
	size := max(sqSize, cqSize)
	mem, err := unix.Mmap(r.fd, offSQRing, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return err
	}
	r.ringMem = mem
	sqeMem, err := unix.Mmap(r.fd, offSQEs, int(p.sqEntries*sqeSize), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return err
	}
	r.sqeMem = sqeMem
	at := func(off uint32) *uint32 { return (*uint32)(unsafe.Pointer(&mem[off])) }
	r.sqHead, r.sqTail, r.sqMask = at(p.sqOff.head), at(p.sqOff.tail), *at(p.sqOff.ringMask)
	r.cqHead, r.cqTail, r.cqMask = at(p.cqOff.head), at(p.cqOff.tail), *at(p.cqOff.ringMask)
	r.entries = p.sqEntries
	r.sqes = unsafe.Slice((*sqe)(unsafe.Pointer(&sqeMem[0])), p.sqEntries)
	r.cqes = unsafe.Slice((*cqe)(unsafe.Pointer(&mem[p.cqOff.cqes])), p.cqEntries)
	// the indirection array maps slot i to entry i, once and for all
	array := unsafe.Slice((*uint32)(unsafe.Pointer(&mem[p.sqOff.array])), p.sqEntries)
	for i := range array {
		array[i] = uint32(i)
	}
	return nil
}

// KeepProcessor makes Submit keep the calling goroutine's Go processor
// during its system calls, as if they were short: Go's runtime otherwise
// treats a system call that lasts past its monitor's tick (20 µs; a
// submission of 128 sends to loopback sockets takes about half a
// millisecond) as blocked, hands the processor to another thread and
// takes one back when the call returns, and its monitor, finding that to
// do, keeps waking every 20 µs (docs/PERFORMANCE.md, sixteenth session:
// its share of a fan-out's samples halved, 3.8 → 2.0 %). Only for a caller
// whose submissions never wait: sends and receives here complete at once
// (MSG_DONTWAIT, checked by New), so a call lasts as long as the kernel's
// work on its batch; meanwhile the runtime cannot stop the world for a
// collection, which waits for the call to return.
func (r *Ring) KeepProcessor() { r.raw = true }

// Entries is how many operations one system call takes at most.
func (r *Ring) Entries() int { return int(r.entries) }

// Submit tries every operation once, in order, with one system call per
// Entries of them, and calls done with each one's index in ios and result:
// the bytes moved, or the error (unix.EAGAIN when the socket had no room,
// or nothing to read). Operations on one socket are tried in order, but a
// send after a short one would still be tried: give each socket at most one
// per Submit. An error is the ring's own (operations it returns without
// calling done for may or may not have happened): the ring must then be
// closed, not used again.
func (r *Ring) Submit(ios []IO, done func(i int, n int, err error)) error {
	for first := 0; first < len(ios); first += int(r.entries) {
		batch := ios[first:min(len(ios), first+int(r.entries))]
		if err := r.submitBatch(batch, first, done); err != nil {
			return err
		}
	}
	return nil
}

// submitBatch submits at most Entries operations; first is the index of
// the first one in what Submit was given.
func (r *Ring) submitBatch(ios []IO, first int, done func(i int, n int, err error)) error {
	tail := *r.sqTail
	for i, io := range ios {
		e := &r.sqes[(tail+uint32(i))&r.sqMask]
		*e = sqe{opcode: opSend, fd: int32(io.FD), len: uint32(len(io.Buf)),
			msgFlags: unix.MSG_DONTWAIT | unix.MSG_NOSIGNAL, userData: uint64(i)}
		if io.Recv {
			e.opcode, e.msgFlags = opRecv, unix.MSG_DONTWAIT
		}
		if len(io.Buf) > 0 {
			e.addr = uint64(uintptr(unsafe.Pointer(&io.Buf[0])))
		}
	}
	atomic.StoreUint32(r.sqTail, tail+uint32(len(ios)))
	err := r.enter(uint32(len(ios)))
	runtime.KeepAlive(ios) // the kernel is done with the buffers by now
	r.reap(first, done)
	return err
}

// enter submits n entries and waits for their n completions (the
// completion queue is empty before); a send with MSG_DONTWAIT completes
// while it is submitted, so this does not wait.
func (r *Ring) enter(n uint32) error {
	toSubmit := n
	for {
		if toSubmit == 0 && atomic.LoadUint32(r.cqTail)-*r.cqHead >= n {
			return nil
		}
		got, errno := r.enterCall(toSubmit, n)
		switch {
		case errno == unix.EINTR || errno == unix.EAGAIN || errno == unix.EBUSY:
			continue
		case errno != 0:
			return errno
		}
		toSubmit -= min(uint32(got), toSubmit)
	}
}

// enterCall is one io_uring_enter: submit toSubmit, wait for n.
func (r *Ring) enterCall(toSubmit, n uint32) (uintptr, unix.Errno) {
	if r.raw {
		got, _, errno := unix.RawSyscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), uintptr(toSubmit),
			uintptr(n), enterGetEvents, 0, 0)
		return got, errno
	}
	got, _, errno := unix.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), uintptr(toSubmit),
		uintptr(n), enterGetEvents, 0, 0)
	return got, errno
}

func (r *Ring) reap(first int, done func(i int, n int, err error)) {
	head := *r.cqHead
	tail := atomic.LoadUint32(r.cqTail)
	for ; head != tail; head++ {
		c := r.cqes[head&r.cqMask]
		if c.res < 0 {
			done(first+int(c.userData), 0, unix.Errno(-c.res))
			continue
		}
		done(first+int(c.userData), int(c.res), nil)
	}
	atomic.StoreUint32(r.cqHead, head)
}

// Close releases the ring.
func (r *Ring) Close() {
	if r.sqeMem != nil {
		_ = unix.Munmap(r.sqeMem)
		r.sqeMem = nil
	}
	if r.ringMem != nil {
		_ = unix.Munmap(r.ringMem)
		r.ringMem = nil
	}
	if r.fd >= 0 {
		_ = unix.Close(r.fd)
		r.fd = -1
	}
}
