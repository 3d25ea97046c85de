package caddysse

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"reflect"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// The two ways a stream's bytes reach its client (Handler.Writer).
const (
	// writerNetHTTP keeps every stream on net/http and Caddy's response
	// writer chain: a goroutine per stream blocked in the handler.
	writerNetHTTP = "net_http"
	// writerTakeover takes HTTP/1.1 connections over from net/http once
	// the stream's headers are decided: the handler returns, and one event
	// loop per CPU watches every taken-over stream (Linux). Cleartext
	// streams are written by the loop itself; TLS streams by a goroutine
	// started for each batch, since crypto/tls writes block. HTTP/2 and
	// HTTP/3 streams stay on net/http.
	writerTakeover = "takeover"
)

// Taking a connection over (SPEC S7, S8 still hold): the stream starts on
// net/http like any response (headers, preamble, replay), then the handler
// hijacks the connection and hands the stream to an event loop, and
// returns: the goroutine, its stack and net/http's buffers — most of what an
// idle stream costs — are freed. The response is chunked already; the loop
// goes on writing chunks, detects the client leaving, never blocks, and
// ends the stream. It is no longer in Caddy's response pipeline, so the
// module counts, closes and logs it itself (the access log records the
// hand-off). A TLS stream keeps its tls.Conn: the loop only watches the
// socket, and each batch is encrypted and written by a goroutine that lives
// for that write.

// takeOver hands a started stream to the takeover writer if the handler
// uses it and the request allows it: HTTP/1.1, cleartext or TLS. It reports
// whether it did; if not, the stream goes on on net/http.
func (h *Handler) takeOver(w http.ResponseWriter, r *http.Request, s *stream) bool {
	if h.loops == nil || r.ProtoMajor != 1 || r.ProtoMinor != 1 || s.closing.Load() != nil {
		return false
	}
	if strings.EqualFold(w.Header().Get("Transfer-Encoding"), "identity") {
		return false // net/http did not chunk this response: the loop writes chunks
	}
	sw, _ := s.out.(*httpStreamWriter)
	if sw != nil {
		s.net.Store(nil)
		sw.end() // the response's writer is about to go
	}
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		if sw != nil { // it goes on writing there
			sw.resume()
			s.net.Store(sw)
		}
		return false
	}
	s.setHurry(nil)
	// keep only the connection itself: Caddy's wrapper (which counts bytes
	// for the access log) holds the whole request and its buffers
	if r.TLS != nil {
		conn = h.adoptTLS(s, conn)
	} else if raw := innerConn[*net.TCPConn](conn); raw != nil {
		conn = raw
		if h.loops.adopt(s, raw, nil) {
			conn = nil
		}
	}
	if conn != nil {
		cw := &connWriter{to: connSink{conn, &s.closing}, timeout: time.Duration(h.SlowClientTimeout)}
		s.out = cw
		s.setHurry(hurryConn(conn))
		go s.serveHijacked(conn, cw)
	}
	return true
}

// hurryConn brings the deadline of a write in flight on conn down to
// lastWordsTimeout (a net.Conn's deadlines are safe from any goroutine).
func hurryConn(conn net.Conn) func() {
	return func() { _ = conn.SetWriteDeadline(time.Now().Add(lastWordsTimeout)) }
}

// adoptTLS gives a taken-over TLS stream to an event loop, which watches
// its socket; it returns the connection if no loop could take it (nil if
// one did).
func (h *Handler) adoptTLS(s *stream, conn net.Conn) net.Conn {
	tc := innerConn[*tls.Conn](conn)
	if tc == nil {
		return conn
	}
	raw := innerConn[*net.TCPConn](tc.NetConn())
	if raw == nil {
		return tc
	}
	// set before the loop has it: a close may come as soon as it does
	s.setHurry(hurryConn(tc))
	if !h.loops.adopt(s, raw, tc) {
		return tc
	}
	return nil
}

// endConn ends a taken-over stream on the calling goroutine, after run
// (which wrote its last words if it was told to close): the end of the
// chunked body, and the connection.
func (s *stream) endConn(conn net.Conn, cw *connWriter, err error) {
	switch {
	case err == nil:
		err = cw.end()
	case endsItsBody(err):
		_ = cw.endBody()
	}
	s.releaseAdmission() // before the client sees the end: it may come back at once
	_ = conn.Close()
	s.finish(context.Background(), err)
	s.release()
}

// endsItsBody tells whether a stream that ended with err ends its chunked
// body first, as net/http does when the handler returns: it ended because
// of its history, not because a write failed, and its client should get
// what it was written before the end, and a body that ends (not an
// unexpected EOF).
func endsItsBody(err error) bool {
	return errors.Is(err, errHistoryGap) || errors.Is(err, errHistoryRewritten)
}

// serveHijacked serves a taken-over stream whose connection the event loop
// cannot watch (not a plain TCP connection, e.g. behind a listener
// wrapper): the drainer writes it, a goroutine notices the client leaving.
func (s *stream) serveHijacked(conn net.Conn, cw *connWriter) {
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		_, _ = io.Copy(io.Discard, conn)
		cancel()
	}()
	err := s.h.drainer.serve(ctx, s)
	if ctx.Err() != nil {
		err = errors.Join(err, errClientGone)
	}
	s.endConn(conn, cw, err)
	cancel()
}

var errClientGone = errors.New("the client closed the connection")

// innerConn finds the connection of type T in a hijacked one (Caddy's
// response recorder wraps it to count bytes for the access log, listener
// wrappers may too); the zero T if there is none.
func innerConn[T net.Conn](c net.Conn) T {
	var none T
	for range 4 {
		if t, ok := c.(T); ok {
			return t
		}
		v := reflect.ValueOf(c)
		if v.Kind() != reflect.Pointer || v.Elem().Kind() != reflect.Struct {
			return none
		}
		f := v.Elem().FieldByName("Conn")
		if !f.IsValid() || !f.CanInterface() {
			return none
		}
		inner, ok := f.Interface().(net.Conn)
		if !ok {
			return none
		}
		c = inner
	}
	return none
}

// connWriter writes a taken-over stream with blocking writes in HTTP/1.1
// chunked encoding, each flush bounded by the slow-client timeout: on a
// goroutine of its own, whenever the stream needs one (a connection the
// event loop cannot watch, a TLS stream's writes, reading the history).
type connWriter struct {
	to      sink
	timeout time.Duration
	framed  []byte // bytes already in chunks, sent before the next chunk
	body    []byte // the next chunk's data
}

// connChunkSize is how much a connWriter gathers before it sends a chunk
// without waiting for Flush. A catch-up writes a page of history (up to
// history_bytes per channel, for every channel of the stream) before it
// flushes: gathered whole, it cost a copy of the page per stream (two,
// while it was framed) where net/http's writer holds 4 KiB.
const connChunkSize = 32 << 10

func (cw *connWriter) Write(p []byte) error {
	cw.body = append(cw.body, p...)
	if len(cw.body) < connChunkSize {
		return nil
	}
	return cw.send(nil, cw.timeout) // its buffers stay for the rest of the burst
}

func (cw *connWriter) Flush() error { return cw.sendAll(nil, cw.timeout) }

func (cw *connWriter) WriteLast(p []byte) error {
	cw.body = append(cw.body, p...)
	return cw.sendAll(nil, min(cw.timeout, lastWordsTimeout))
}

// MayBlock is true: its writes wait for the client, within the timeout.
func (cw *connWriter) MayBlock() bool { return true }

// end writes what is buffered and the last chunk of the body, within
// lastWordsTimeout: the last words of a stream told to close.
func (cw *connWriter) end() error { return cw.sendAll(lastChunk, lastWordsTimeout) }

// endBody writes what is buffered and the last chunk of the body of a
// stream that ends because of its history (endsItsBody): its client, behind
// by definition, has the slow-client timeout to take them, as any write
// (net/http's end of a body waits too); a close hurries it to
// lastWordsTimeout (the sink's hurry).
func (cw *connWriter) endBody() error { return cw.sendAll(lastChunk, cw.timeout) }

// lastChunk ends a chunked body.
var lastChunk = []byte("0\r\n\r\n")

// sendAll sends what is buffered, then tail, and lets go of a burst's
// buffers: most streams that write one (a catch-up) do not write another
// for a long time.
func (cw *connWriter) sendAll(tail []byte, timeout time.Duration) error {
	err := cw.send(tail, timeout)
	if cap(cw.body) > connKeptBuffer {
		cw.body = nil
	}
	if cap(cw.framed) > connKeptBuffer {
		cw.framed = nil
	}
	return err
}

// send sends the framed bytes, the body as a chunk, then tail.
func (cw *connWriter) send(tail []byte, timeout time.Duration) error {
	out := cw.framed
	if len(cw.body) > 0 {
		out = appendChunk(out, cw.body)
	}
	out = append(out, tail...)
	// out is the next send's framing buffer (the sinks keep nothing of it)
	cw.framed, cw.body = out[:0], cw.body[:0]
	if len(out) == 0 {
		return nil
	}
	err := cw.to.writeBy(out, time.Now().Add(timeout))
	if errors.Is(err, os.ErrDeadlineExceeded) {
		err = errors.Join(errSlowWrite, err)
	}
	return err
}

// connKeptBuffer is the largest buffer a connWriter keeps between sends:
// enough for a TLS stream's usual batch, which is written through it.
const connKeptBuffer = 4 << 10

// sink is where a connWriter's bytes go: a connection, or a socket the
// event loop holds (Linux).
type sink interface {
	// writeBy writes all of p, or fails once deadline has passed.
	writeBy(p []byte, deadline time.Time) error
}

// connSink writes to a connection, through Go's poller.
type connSink struct {
	net.Conn
	// closing is the stream's: a write of a stream told to close has at
	// most lastWordsTimeout, as hurryConn gives the one in flight then
	closing *atomic.Pointer[closeNotice]
}

func (c connSink) writeBy(p []byte, deadline time.Time) error {
	_ = c.SetWriteDeadline(deadline)
	// after setting it: a close that comes after this look hurries the
	// write (hurryConn) after the deadline above was set, so it wins
	if hurried := time.Now().Add(lastWordsTimeout); c.closing.Load() != nil && hurried.Before(deadline) {
		_ = c.SetWriteDeadline(hurried)
	}
	_, err := c.Write(p)
	_ = c.SetWriteDeadline(time.Time{})
	return err
}

// appendChunk appends body as one chunk of a chunked body.
func appendChunk(dst, body []byte) []byte {
	dst = strconv.AppendInt(dst, int64(len(body)), 16)
	dst = append(dst, '\r', '\n')
	dst = append(dst, body...)
	return append(dst, '\r', '\n')
}

// loopsPool holds the process's event loops, shared by every handler that
// takes connections over and kept across reloads.
var loopsPool = caddy.NewUsagePool()

const loopsKey = "takeover"

// acquireLoops returns the event loops (nil where there are none: not
// Linux). Creating them is cheap: their goroutines start with the first
// stream.
func acquireLoops() (*loopSet, error) {
	val, _, err := loopsPool.LoadOrNew(loopsKey, func() (caddy.Destructor, error) {
		return newLoopSet(), nil
	})
	if err != nil {
		return nil, err
	}
	ls, _ := val.(*loopSet)
	if !ls.supported() {
		return nil, nil
	}
	return ls, nil
}

func releaseLoops() {
	_, _ = loopsPool.Delete(loopsKey)
}
