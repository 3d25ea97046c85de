//go:build linux

package uring

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func newRing(t *testing.T, entries uint32) *Ring {
	t.Helper()
	r, err := New(entries)
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("io_uring is not available: %v", err)
		}
		t.Skipf("io_uring is not available here: %v", err) // the callers fall back to write(2)
	}
	t.Cleanup(r.Close)
	return r
}

// forEachMode runs test on rings whose system calls hand the goroutine's
// processor over, as Go does by default, and on rings that keep it
// (KeepProcessor, as the module's loops do).
func forEachMode(t *testing.T, test func(t *testing.T, ring func(entries uint32) *Ring)) {
	for _, keep := range []bool{false, true} {
		name := "handing over the processor"
		if keep {
			name = "keeping the processor"
		}
		t.Run(name, func(t *testing.T) {
			test(t, func(entries uint32) *Ring {
				r := newRing(t, entries)
				if keep {
					r.KeepProcessor()
				}
				return r
			})
		})
	}
}

// pair is a connected stream socket pair; the first end is non-blocking,
// as the sockets the loops write are.
func pair(t *testing.T) (int, int) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fds[0]); unix.Close(fds[1]) })
	return fds[0], fds[1]
}

// tcpPair is a loopback TCP connection: the non-blocking descriptor of one
// end, and the blocking one of the other.
func tcpPair(t *testing.T) (int, int) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	client, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	server, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	w := dupFD(t, client.(*net.TCPConn))
	r := dupFD(t, server.(*net.TCPConn))
	client.Close()
	server.Close()
	if err := unix.SetNonblock(w, true); err != nil {
		t.Fatal(err)
	}
	if err := unix.SetNonblock(r, false); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(w); unix.Close(r) })
	return w, r
}

func dupFD(t *testing.T, c *net.TCPConn) int {
	t.Helper()
	f, err := c.File()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fd, err := unix.Dup(int(f.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	return fd
}

// drain reads n bytes.
func drain(fd, n int) error {
	buf := make([]byte, 1<<16)
	for n > 0 {
		got, err := unix.Read(fd, buf[:min(n, len(buf))])
		if err != nil {
			return err
		}
		if got == 0 {
			return errors.New("the writer closed")
		}
		n -= got
	}
	return nil
}

type result struct {
	n   int
	err error
}

func submit(t *testing.T, r *Ring, ios []IO) []result {
	t.Helper()
	got := make([]result, len(ios))
	seen := make([]bool, len(ios))
	finished := make(chan error, 1)
	go func() {
		finished <- r.Submit(ios, func(i, n int, err error) {
			if seen[i] {
				t.Errorf("send %d completed twice", i)
			}
			seen[i] = true
			got[i] = result{n, err}
		})
	}()
	select {
	case err := <-finished:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Submit waited: a send did not complete at once")
	}
	for i, ok := range seen {
		if !ok {
			t.Fatalf("send %d never completed", i)
		}
	}
	return got
}

// More sends than the ring holds go out in several system calls, each to
// its socket, in full.
func TestSubmitSendsEveryBufferToItsSocket(t *testing.T) {
	forEachMode(t, func(t *testing.T, ring func(entries uint32) *Ring) {
		r := ring(8)
		const sockets = 50
		var ios []IO
		var readers []int
		for i := range sockets {
			w, rd := pair(t)
			readers = append(readers, rd)
			ios = append(ios, IO{FD: w, Buf: []byte(fmt.Sprintf("event %d\n", i))})
		}
		for i, res := range submit(t, r, ios) {
			if res.err != nil || res.n != len(ios[i].Buf) {
				t.Fatalf("send %d: %d bytes, %v; want %d", i, res.n, res.err, len(ios[i].Buf))
			}
		}
		for i, rd := range readers {
			buf := make([]byte, 64)
			n, err := unix.Read(rd, buf)
			if err != nil || !bytes.Equal(buf[:n], ios[i].Buf) {
				t.Fatalf("socket %d got %q, %v; want %q", i, buf[:n], err, ios[i].Buf)
			}
		}
	})
}

// A full socket answers EAGAIN at once (the event loop must never wait),
// and takes bytes again once its reader made room.
func TestSubmitNeverWaitsOnAFullSocket(t *testing.T) {
	forEachMode(t, func(t *testing.T, ring func(entries uint32) *Ring) {
		r := ring(4)
		w, rd := tcpPair(t)
		big := bytes.Repeat([]byte("x"), 1<<16)
		total := 0
		for range 1000 {
			res := submit(t, r, []IO{{FD: w, Buf: big}})[0]
			if errors.Is(res.err, unix.EAGAIN) {
				if total == 0 {
					t.Fatal("EAGAIN before the socket took anything")
				}
				// the reader makes room: the next send goes through, in part
				// or in full
				if err := drain(rd, total); err != nil {
					t.Fatal(err)
				}
				res = submit(t, r, []IO{{FD: w, Buf: big}})[0]
				if res.err != nil || res.n <= 0 {
					t.Fatalf("after the reader drained the socket: %d bytes, %v", res.n, res.err)
				}
				return
			}
			if res.err != nil {
				t.Fatal(res.err)
			}
			total += res.n
		}
		t.Fatalf("the socket took %d bytes without filling", total)
	})
}

// A send to a socket whose peer left, or to no socket, fails alone: the
// others in the same submission go through.
func TestSubmitReportsEachSendsError(t *testing.T) {
	forEachMode(t, func(t *testing.T, ring func(entries uint32) *Ring) {
		r := ring(8)
		gone, peer := pair(t)
		unix.Close(peer)
		ok, rd := pair(t)
		res := submit(t, r, []IO{{FD: gone, Buf: []byte("a")}, {FD: -1, Buf: []byte("b")}, {FD: ok, Buf: []byte("c")}})
		if !errors.Is(res[0].err, unix.EPIPE) && !errors.Is(res[0].err, unix.ECONNRESET) {
			t.Errorf("send to a closed peer: %d, %v; want EPIPE", res[0].n, res[0].err)
		}
		if !errors.Is(res[1].err, unix.EBADF) {
			t.Errorf("send to fd -1: %d, %v; want EBADF", res[1].n, res[1].err)
		}
		if res[2].err != nil || res[2].n != 1 {
			t.Errorf("send to a good socket: %d, %v", res[2].n, res[2].err)
		}
		buf := make([]byte, 8)
		if n, _ := unix.Read(rd, buf); string(buf[:n]) != "c" {
			t.Errorf("good socket got %q", buf[:n])
		}
	})
}

// Receives read what is there, say EAGAIN where nothing is, and 0 bytes
// where the peer closed.
func TestSubmitReceives(t *testing.T) {
	forEachMode(t, func(t *testing.T, ring func(entries uint32) *Ring) {
		r := ring(4)
		full, fullPeer := pair(t)
		empty, _ := pair(t)
		closed, closedPeer := pair(t)
		if _, err := unix.Write(fullPeer, []byte("hello")); err != nil {
			t.Fatal(err)
		}
		unix.Close(closedPeer)
		bufs := [][]byte{make([]byte, 64), make([]byte, 64), make([]byte, 64)}
		res := submit(t, r, []IO{{FD: full, Buf: bufs[0], Recv: true}, {FD: empty, Buf: bufs[1], Recv: true}, {FD: closed, Buf: bufs[2], Recv: true}})
		if res[0].err != nil || string(bufs[0][:res[0].n]) != "hello" {
			t.Errorf("socket with data: %q, %v", bufs[0][:res[0].n], res[0].err)
		}
		if !errors.Is(res[1].err, unix.EAGAIN) {
			t.Errorf("empty socket: %d bytes, %v; want EAGAIN", res[1].n, res[1].err)
		}
		if res[2].err != nil || res[2].n != 0 {
			t.Errorf("closed peer: %d bytes, %v; want 0 bytes", res[2].n, res[2].err)
		}
	})
}
