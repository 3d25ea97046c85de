//go:build linux

package caddysse

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/caddy-sse/caddy-sse/internal/waitfor"
	"github.com/caddy-sse/caddy-sse/pubsub"
	"github.com/caddy-sse/caddy-sse/replay"
)

// These tests drive one event loop by hand (no Caddy): streams on socket
// pairs, a round at a time, to reach interleavings that traffic rarely
// lines up — a stream told to close in the middle of its batch, a stream
// lent to a goroutine when the loops stop.

func loopTestHandler() *Handler {
	h := &Handler{Queue: 100000, QueueBytes: 1 << 30, SlowClientTimeout: caddy.Duration(time.Second)}
	h.metrics = newMetrics()
	h.logger = zap.NewNop()
	h.streams = newRegistry(h.logger, 0, 0, 0)
	return h
}

// testLoop is a loop that is never run: the test calls serviceReady and
// takeReturned itself.
func testLoop(t *testing.T, ring bool) *pollLoop {
	t.Helper()
	l, err := newPollLoop(ring)
	if err != nil {
		t.Fatal(err)
	}
	if ring && l.ring == nil {
		t.Skip("io_uring is not allowed here")
	}
	// poll never runs either: endAll need not wait for it to end (it
	// would give up after 4 s)
	close(l.polled)
	t.Cleanup(func() {
		l.mu.Lock()
		stopped := l.stopped
		l.mu.Unlock()
		if !stopped {
			l.endAll()
		}
	})
	return l
}

// socketPair returns the loop's end (non-blocking) and the client's.
func socketPair(t *testing.T) (int, int) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fds[1]) })
	return fds[0], fds[1]
}

// fillSocket writes to the loop's end of a socket pair until it is full:
// a client that does not read.
func fillSocket(fd int) {
	fill := make([]byte, 64<<10)
	for {
		if _, err := unix.Write(fd, fill); err != nil {
			return
		}
	}
}

// readAvailable reads what the client's end holds now.
func readAvailable(fd int) string {
	var sb strings.Builder
	buf := make([]byte, 64<<10)
	for {
		n, _ := unix.Read(fd, buf)
		if n <= 0 {
			return sb.String()
		}
		sb.Write(buf[:n])
	}
}

// readUntil reads the client's end until it holds want, or fails.
func readUntil(t *testing.T, fd int, want string) string {
	t.Helper()
	got := ""
	for deadline := time.Now().Add(5 * time.Second); !strings.Contains(got, want); {
		if time.Now().After(deadline) {
			t.Fatalf("no %q within the deadline; got %d bytes: %.300q", want, len(got), got)
		}
		got += readAvailable(fd)
		time.Sleep(time.Millisecond)
	}
	return got
}

func event(seq, at uint64, data string) *replay.Event {
	return &replay.Event{Pos: replay.Position{Epoch: 1, Seq: seq, Time: int64(at)}, Frame: []byte("data: " + data + "\n\n")}
}

// A stream that stops in the middle of its batch leaves what it wrote of it
// in the round's buffer. The next stream of the round must not send those
// bytes as its own: here P's second event rewrites the history (same seq,
// another time), which ends P mid-batch, and C, told to close, is next.
func TestLoopNeverSendsOneStreamsBytesToAnother(t *testing.T) {
	for _, ring := range []bool{false, true} {
		t.Run(fmt.Sprintf("io_uring=%v", ring), func(t *testing.T) {
			l, h := testLoop(t, ring), loopTestHandler()
			pfd, _ := socketPair(t)
			cfd, cpeer := socketPair(t)
			p := newStream(h, []string{"tenant-p"})
			p.cursor[0].Pos = replay.Position{Epoch: 1, Seq: 1, Time: 100}
			c := newStream(h, []string{"tenant-c"})
			l.adopt(p, &tconn{loop: l, fd: int32(pfd)})
			l.adopt(c, &tconn{loop: l, fd: int32(cfd)})
			p.Deliver(0, event(2, 200, "SECRET-OF-P"))
			p.Deliver(0, event(2, 300, "rewritten"))
			c.close(&closeNotice{reason: "reload"})
			l.serviceReady()
			got := readUntil(t, cpeer, "server_closing")
			if strings.Contains(got, "SECRET-OF-P") {
				t.Fatalf("C received P's event: %q", got)
			}
			if body := decodeChunks(t, got); !strings.Contains(body, "event: server_closing") {
				t.Fatalf("C's body: %q", body)
			}
		})
	}
}

// A stream told to close between two events of its batch (a reload while
// events flow) still gets server_closing, after what it was sent of the
// batch, as net/http streams do: on the loop, and on a goroutine.
func TestLoopStreamToldToCloseMidBatchGetsServerClosing(t *testing.T) {
	t.Run("on the loop", func(t *testing.T) {
		const events, closeAfter = 2000, 700
		l, h := testLoop(t, false), loopTestHandler()
		fd, peer := socketPair(t)
		_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_SNDBUF, 8<<20)
		s := newStream(h, []string{"a"})
		l.adopt(s, &tconn{loop: l, fd: int32(fd)})
		l.serviceReady()
		// The reload's close lands right after the closeAfter-th event is
		// written: where a concurrent close lands is up to the scheduler.
		s.out = &closingAfterEvents{loopWriter: s.out.(*loopWriter), s: s, after: closeAfter}
		for i := range events {
			s.Deliver(0, event(uint64(i+1), 1, "x"))
		}
		l.serviceReady()
		if !s.tk.Load().ended.Load() {
			t.Fatal("the stream told to close did not end")
		}
		body := decodeChunks(t, readUntil(t, peer, "\r\n0\r\n\r\n"))
		if !strings.HasSuffix(body, "event: server_closing\ndata: {\"reason\":\"reload\"}\n\n") {
			t.Fatalf("the body does not end with server_closing: %.200q", body[max(0, len(body)-200):])
		}
		if sent := strings.Count(body, "data: x\n"); sent != closeAfter {
			t.Fatalf("%d events sent before server_closing, want the %d written before the close", sent, closeAfter)
		}
	})
	t.Run("on a goroutine", func(t *testing.T) {
		l, h := testLoop(t, false), loopTestHandler()
		fd, peer := socketPair(t)
		s := newStream(h, []string{"a"})
		l.adopt(s, &tconn{loop: l, fd: int32(fd)})
		l.serviceReady()
		s.Deliver(0, event(1, 1, "x"))
		batch, _ := s.take()
		s.close(&closeNotice{reason: "reload"}) // before the goroutine writes its first event
		l.slow(s, batch, false)
		waitReturned(t, l)
		l.takeReturned()
		got := readUntil(t, peer, "\r\n0\r\n\r\n")
		if body := decodeChunks(t, got); !strings.Contains(body, "event: server_closing") {
			t.Fatalf("no server_closing in %q", body)
		}
		if !s.tk.Load().ended.Load() {
			t.Fatal("the stream was not ended")
		}
	})
}

// closingAfterEvents is a loop stream's writer that tells its stream to
// close once it has written a number of events' frames.
type closingAfterEvents struct {
	*loopWriter
	s            *stream
	after, wrote int
}

func (w *closingAfterEvents) Write(p []byte) error {
	if strings.HasPrefix(string(p), "data: ") {
		if w.wrote++; w.wrote == w.after {
			defer w.s.close(&closeNotice{reason: "reload"})
		}
	}
	return w.loopWriter.Write(p)
}

// decodeChunks decodes a chunked body that must end with its last chunk.
func decodeChunks(t *testing.T, raw string) string {
	t.Helper()
	var body strings.Builder
	for rest := raw; ; {
		line, after, ok := strings.Cut(rest, "\r\n")
		var size int
		if _, err := fmt.Sscanf(line, "%x", &size); !ok || err != nil || len(after) < size+2 || after[size:size+2] != "\r\n" {
			t.Fatalf("not a chunked body at %.80q (of %d bytes)", rest, len(raw))
		}
		if size == 0 {
			if after != "\r\n" {
				t.Fatalf("bytes after the last chunk: %q", after)
			}
			return body.String()
		}
		body.WriteString(after[:size])
		rest = after[size+2:]
	}
}

func waitReturned(t *testing.T, l *pollLoop) {
	t.Helper()
	waitfor.Until(t, "the goroutine to give the stream back", 5*time.Second, time.Millisecond, func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		return len(l.returned) > 0
	})
}

// When the loops stop (the last config with `writer takeover` goes), a
// stream lent to a goroutine blocked writing to its full socket must not
// have its descriptor closed under that write: the number would go to the
// next connection opened, which would then receive the old stream's bytes.
// It is shut down instead, and the goroutine ends it.
func TestLoopStoppingLeavesALentStreamsDescriptorToItsGoroutine(t *testing.T) {
	l, h := testLoop(t, false), loopTestHandler()
	fd, peer := socketPair(t)
	fillSocket(fd)
	s := newStream(h, []string{"a"})
	l.adopt(s, &tconn{loop: l, fd: int32(fd)})
	s.Deliver(0, event(1, 1, "OLD-STREAM-BYTES"))
	batch, _ := s.take()
	l.slow(s, batch, false) // blocks in poll(2) for the socket
	l.endAll()

	// new connections take the lowest free numbers, the old one's too once
	// it is closed; none of them may receive the old stream's bytes
	var opened []int
	defer func() {
		for _, fd := range opened {
			unix.Close(fd)
		}
	}()
	for deadline := time.Now().Add(2 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		p, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		opened = append(opened, p[0], p[1])
		for _, fd := range opened {
			if got := readAvailable(fd); strings.Contains(got, "OLD-STREAM-BYTES") {
				t.Fatalf("a new connection (descriptor %d) received the ended stream's bytes: %q", fd, got)
			}
		}
		if l.count.Load() == 0 {
			break
		}
	}
	if n := l.count.Load(); n != 0 {
		t.Fatalf("%d stream(s) still held after the loop stopped", n)
	}
	// the client sees its stream end
	for deadline := time.Now().Add(5 * time.Second); ; {
		n, err := unix.Read(peer, make([]byte, 64<<10))
		if n == 0 && err == nil {
			break // end of stream
		}
		if err != nil && !errors.Is(err, unix.EAGAIN) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the client's connection did not end")
		}
		if n <= 0 {
			time.Sleep(time.Millisecond)
		}
	}
}

// A stream told to close (a reload) that the loop had not serviced yet when
// it stopped — the loop's select took the stop before the kick — still gets
// its server_closing and the end of its body, not a bare close: the loop
// stopping must not cost a client its last words (SPEC S8).
func TestLoopStoppingSaysTheLastWordsOfAStreamToldToClose(t *testing.T) {
	l, h := testLoop(t, false), loopTestHandler()
	fd, peer := socketPair(t)
	s := newStream(h, []string{"a"})
	l.adopt(s, &tconn{loop: l, fd: int32(fd)})
	s.close(&closeNotice{reason: "reload", retry: 3 * time.Second}) // scheduled, never serviced
	l.endAll()
	got := readUntil(t, peer, "0\r\n\r\n")
	if !strings.Contains(got, "event: server_closing\n") || !strings.Contains(got, `"reason":"reload"`) {
		t.Fatalf("the stream ended with %q, without its server_closing", got)
	}
}

// A stream whose history was rewritten (a failover) ends on the loop as on
// net/http: what it wrote of its batch before the event that contradicts
// it, then the end of its body; not a connection cut mid-body with those
// events dropped. A gap the history no longer covers ends it the same way,
// found on the stream's goroutine (the loop hands such an event there,
// errNeedsHistory). When the client's socket is full, the rest of the body
// and its last chunk wait on a goroutine for the client, which has the
// slow-client timeout to take them, as any write, not a close's one second
// of last words (the client of a gap-ended stream is behind by definition).
func TestLoopStreamEndedByItsHistoryEndsItsBody(t *testing.T) {
	causes := []struct {
		name       string
		contradict *replay.Event
	}{
		{"rewritten", event(2, 300, "contradicting")},
		{"gap", event(5, 300, "contradicting")}, // the hub holds nothing of the channel
	}
	for _, cause := range causes {
		for _, ring := range []bool{false, true} {
			for _, full := range []bool{false, true} {
				name := fmt.Sprintf("%s,io_uring=%v,socket_full=%v", cause.name, ring, full)
				t.Run(name, func(t *testing.T) {
					l, h := testLoop(t, ring), loopTestHandler()
					h.hub = pubsub.NewMemoryHub()
					h.ReplayLimit = 100
					h.SlowClientTimeout = caddy.Duration(10 * time.Second)
					fd, peer := socketPair(t)
					if full {
						fillSocket(fd)
					}
					s := newStream(h, []string{"a"})
					s.cursor[0].Pos = replay.Position{Epoch: 1, Seq: 1, Time: 100}
					l.adopt(s, &tconn{loop: l, fd: int32(fd)})
					s.Deliver(0, event(2, 200, "WRITTEN-BEFORE"))
					s.Deliver(0, cause.contradict)
					l.serviceReady()
					if full {
						time.Sleep(2 * lastWordsTimeout) // the client reads again only now
					}
					got := readUntil(t, peer, "\r\n0\r\n\r\n")
					if !strings.Contains(got, "data: WRITTEN-BEFORE\n") || strings.Contains(got, "contradicting") {
						t.Fatalf("body ends %.300q", got[max(0, len(got)-300):])
					}
					if !full {
						decodeChunks(t, got) // the whole body is well formed
					}
					if full || cause.name == "gap" {
						waitReturned(t, l)
						l.takeReturned()
					}
					if !s.tk.Load().ended.Load() {
						t.Fatal("the stream did not end")
					}
				})
			}
		}
	}
}

// A stream whose goroutine said its last words (server_closing and the end
// of the body) and gave it back just before the loop stopped is only
// ended by the stop: it is not told server_closing a second time, after the
// end of its body, where its client would take the bytes for the start of
// another response.
func TestLoopStoppingDoesNotSayTheLastWordsOfAStreamGivenBackTwice(t *testing.T) {
	l, h := testLoop(t, false), loopTestHandler()
	fd, peer := socketPair(t)
	s := newStream(h, []string{"a"})
	l.adopt(s, &tconn{loop: l, fd: int32(fd)})
	l.serviceReady()
	s.Deliver(0, event(1, 1, "x"))
	batch, _ := s.take()
	s.close(&closeNotice{reason: "reload"})
	l.slow(s, batch, false) // says server_closing and ends the body, on its goroutine
	waitReturned(t, l)
	l.endAll() // before the loop took it back
	got := readUntil(t, peer, "0\r\n\r\n")
	time.Sleep(100 * time.Millisecond)
	got += readAvailable(peer)
	if body := decodeChunks(t, got); strings.Count(body, "event: server_closing") != 1 {
		t.Fatalf("body %q", body)
	}
	if !s.tk.Load().ended.Load() {
		t.Fatal("the stream was not ended")
	}
}
