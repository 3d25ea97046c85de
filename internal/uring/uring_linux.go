//go:build linux

// Package uring sends on many sockets with one system call, through an
// io_uring submission queue. It exists for one reason: on machines where
// every system call is expensive (page-table isolation in a VM costs about a
// microsecond per entry and exit), writing one small event to each of
// thousands of sockets costs a system call each; queued here they cost one
// per batch. Sends never wait: each is tried at once (MSG_DONTWAIT) and its
// result — bytes taken, EAGAIN, or an error — is there when Submit returns.
//
// A Ring is used by one goroutine at a time.
package uring

import (
	"errors"
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

// Send is one queued send: the bytes stay the caller's and must not change
// until Submit returns.
type Send struct {
	FD   int
	Data []byte
}

// Ring is an io_uring instance used only for sends.
type Ring struct {
	fd      int
	ringMem []byte // the submission and completion rings (one mapping)
	sqeMem  []byte

	sqHead, sqTail, cqHead, cqTail *uint32
	sqMask, cqMask, entries        uint32
	sqes                           []sqe
	cqes                           []cqe
}

// New sets up a ring that takes up to entries sends per system call. It
// fails where io_uring is missing or forbidden (old kernels, seccomp
// profiles of container runtimes, io_uring_disabled): callers then write as
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
	return r, nil
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

// Entries is how many sends one Submit takes at most.
func (r *Ring) Entries() int { return int(r.entries) }

// Submit tries every send once, in order, with one system call per Entries
// sends, and calls done with each one's index in sends and result: the
// bytes the socket took, or the error (unix.EAGAIN when it took none).
// Sends that share a socket are tried in order, but a send after a short
// one would still be tried: give each socket at most one send per Submit.
func (r *Ring) Submit(sends []Send, done func(i int, n int, err error)) error {
	for first := 0; first < len(sends); first += int(r.entries) {
		batch := sends[first:min(len(sends), first+int(r.entries))]
		if err := r.submitBatch(batch, first, done); err != nil {
			return err
		}
	}
	return nil
}

// submitBatch submits at most Entries sends; first is the index of the
// first one in what Submit was given.
func (r *Ring) submitBatch(sends []Send, first int, done func(i int, n int, err error)) error {
	tail := *r.sqTail
	for i, s := range sends {
		e := &r.sqes[(tail+uint32(i))&r.sqMask]
		*e = sqe{opcode: opSend, fd: int32(s.FD), len: uint32(len(s.Data)),
			msgFlags: unix.MSG_DONTWAIT | unix.MSG_NOSIGNAL, userData: uint64(i)}
		if len(s.Data) > 0 {
			e.addr = uint64(uintptr(unsafe.Pointer(&s.Data[0])))
		}
	}
	atomic.StoreUint32(r.sqTail, tail+uint32(len(sends)))
	err := r.enter(uint32(len(sends)))
	runtime.KeepAlive(sends) // the kernel has read the buffers by now
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
		got, _, errno := unix.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), uintptr(toSubmit),
			uintptr(n), enterGetEvents, 0, 0)
		switch {
		case errno == unix.EINTR || errno == unix.EAGAIN || errno == unix.EBUSY:
			continue
		case errno != 0:
			return errno
		}
		toSubmit -= min(uint32(got), toSubmit)
	}
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
