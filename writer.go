package caddysse

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// lastWordsTimeout bounds the write of a stream's last words to a slow
// client (the slow-client comment): it is worth a short try, not another
// full slow-client timeout.
const lastWordsTimeout = time.Second

// errSlowWrite marks a write that failed because the client did not take
// it within the slow-client timeout (SPEC S7).
var errSlowWrite = errors.New("write blocked for the slow-client timeout")

// streamWriter is where a stream's bytes go. Writes may be buffered until
// Flush. Each write and flush is bounded by the stream's slow-client
// timeout, fails once the client is gone, and fails with an error that
// wraps errSlowWrite when the bound is what stopped it.
//
// The net/http implementation below is the default; it is the seam for a
// writer that takes HTTP/1.1 connections over from net/http.
type streamWriter interface {
	Write(p []byte) error
	Flush() error
	// WriteLast writes and flushes p, the stream's last words, within a
	// bound shorter than the slow-client timeout.
	WriteLast(p []byte) error
	// MayBlock tells whether the writer's goroutine may wait (for the
	// client, or to read the history); an event loop's may not.
	MayBlock() bool
}

// httpStreamWriter writes a stream through net/http and Caddy's response
// writer chain.
//
// Its writes carry no deadline of their own: the handler's registry bounds
// them (SPEC S7) from its shared ticker, which cuts a write or flush that
// has been in flight for the slow-client timeout (cut). A deadline per call
// cost a timer update per write — on HTTP/2 a message to the connection's
// goroutine and a new timer each: a tenth of an HTTP/1.1 fan-out's CPU in
// user space, and on HTTP/2 a third of its p99 and a quarter of its memory
// under load (docs/PERFORMANCE.md). So Caddy's idle-timeout writer, which
// would arm one before every Write and Flush, is given a response
// controller whose deadlines go nowhere while the stream writes (end puts
// its own back).
type httpStreamWriter struct {
	w       http.ResponseWriter
	rc      *http.ResponseController // for flushes, through the whole chain
	timeout time.Duration
	// ctrl sets the connection's deadlines (hurry, cut, the last words).
	// With Caddy's idle-timeout writer (idle) it is that writer's own
	// controller (idles), which the writer gets back at the end; meanwhile
	// it has noDeadlines.
	ctrl  *http.ResponseController
	idle  *caddyhttp.IdleTimeoutWriter
	idles *http.ResponseController
	// since is when the write or flush in flight began (monoNanos, plus
	// one so that 0 means none is); cut marks a call the registry cut.
	since atomic.Int64
	cut   atomic.Bool
	// mu orders hurry and cut (any goroutine) against end: a deadline set
	// after the stream ended would linger on the connection's next
	// response (keep-alive).
	mu      sync.Mutex
	hurried bool // a deadline was set on the connection: end takes it back
	ended   bool
	// conn is the HTTP/2 connection the stream is on (nil on other
	// protocols, or where it is not known). A deadline that passes resets
	// an HTTP/2 stream with a frame written on that connection: a client
	// that stopped reading the connection itself (not only withholding a
	// stream's flow-control window) never lets the frame through, and the
	// write waits for ever — no slow-client cut, and a stop that waits for
	// the stream never ends. guard, armed with each deadline, closes conn
	// when a call is still in flight stuckGrace after its deadline passed
	// (breakIfStuck); deadline is the last one set.
	conn     net.Conn
	guard    *time.Timer
	deadline time.Time
	// acked is what the connection's peer had acknowledged (connAcked) at
	// ackedAt, when the deadline was set or breakIfStuck last looked;
	// ackedOK if it could be read. A connection whose peer acknowledges bytes is not
	// stuck, only slow and full: a large response on it (another stream)
	// holds the frame writer, and the reset waits behind its frame.
	acked   uint64
	ackedAt time.Time
	ackedOK bool
}

// stuckGrace is how long a write or flush may stay in flight past its
// deadline, with the peer acknowledging nothing meanwhile, before its
// HTTP/2 connection is deemed to take nothing at all and is closed. A
// connection that takes bytes may still hold the reset that long: it goes
// out after the frame being written, which waits for room in a full send
// buffer (seconds, on a slow link carrying a large response).
const stuckGrace = time.Second

// connKey holds, in a connection's context, the connection itself
// (rememberConn), for the streams of HTTP/2 connections.
type connKey struct{}

// rememberConn keeps c in its context (a caddyhttp.Server's ConnContext);
// every sse handler of a server registers it, the first one does it.
func rememberConn(ctx context.Context, c net.Conn) context.Context {
	if ctx.Value(connKey{}) != nil {
		return ctx
	}
	return context.WithValue(ctx, connKey{}, c)
}

// newHTTPStreamWriter prepares w for a long stream (SPEC S2): Caddy's
// server-wide write timeout is a hard ceiling on a response's writes, which
// would cut every stream after that long. It is lifted for this response
// only; the registry bounds each write by timeout instead. Read deadlines
// are left alone: moving them cancels the request's context.
func newHTTPStreamWriter(w http.ResponseWriter, r *http.Request, timeout time.Duration) *httpStreamWriter {
	rc := http.NewResponseController(w)
	sw := &httpStreamWriter{w: w, rc: rc, ctrl: rc, timeout: timeout}
	if _, idle := caddyhttp.IdleTimeoutsFromContext(r.Context()); idle != nil {
		idle.Deadline.HardDeadline = time.Time{} // also for its last flush, after the handler
		sw.idle, sw.idles, sw.ctrl = idle, idle.Ctrl, idle.Ctrl
		idle.Ctrl = noDeadlines
	}
	// what net/http or Caddy set so far (the server's write timeout)
	_ = sw.ctrl.SetWriteDeadline(time.Time{})
	if r.ProtoMajor == 2 {
		sw.conn, _ = r.Context().Value(connKey{}).(net.Conn)
	}
	return sw
}

// noDeadlines is a response controller whose deadlines go nowhere.
var noDeadlines = http.NewResponseController(deadlineSink{})

type deadlineSink struct{}

func (deadlineSink) Header() http.Header              { return http.Header{} }
func (deadlineSink) Write(p []byte) (int, error)      { return len(p), nil }
func (deadlineSink) WriteHeader(int)                  {}
func (deadlineSink) SetWriteDeadline(time.Time) error { return nil }

// monoNanos is a monotonic clock in nanoseconds (since the process began):
// cheaper to read than the wall clock.
func monoNanos() int64 { return int64(time.Since(processStart)) }

var processStart = time.Now()

// hurry brings the deadline of a write in flight, and of those to come,
// down to lastWordsTimeout; safe from any goroutine. A stream told to close
// must not wait the whole slow-client timeout on a client that stopped
// reading (a stop waits for it).
func (sw *httpStreamWriter) hurry() {
	sw.setDeadline(time.Now().Add(min(sw.timeout, lastWordsTimeout)))
}

// cutIfBlocked ends the write or flush in flight if it began at or before
// stuck (monoNanos) and is still the one in flight; safe from any
// goroutine. It fails at once, as a slow write.
func (sw *httpStreamWriter) cutIfBlocked(stuck int64) bool {
	since := sw.since.Load()
	if since == 0 || since-1 > stuck {
		return false
	}
	sw.mu.Lock()
	defer sw.mu.Unlock()
	if sw.ended || sw.since.Load() != since {
		return false // it ended, or another call began
	}
	sw.cut.Store(true)
	sw.setDeadlineLocked(time.Unix(1, 0))
	return true
}

func (sw *httpStreamWriter) setDeadline(t time.Time) {
	sw.mu.Lock()
	defer sw.mu.Unlock()
	sw.setDeadlineLocked(t)
}

func (sw *httpStreamWriter) setDeadlineLocked(t time.Time) {
	if sw.ended {
		return
	}
	sw.hurried = true
	_ = sw.ctrl.SetWriteDeadline(t)
	if sw.conn != nil {
		sw.deadline = t
		if now := time.Now(); t.Before(now) {
			sw.deadline = now // a cut: it passes now
		}
		sw.acked, sw.ackedOK = connAcked(sw.conn)
		sw.ackedAt = time.Now()
		sw.armGuardLocked(time.Until(sw.deadline) + stuckGrace)
	}
}

func (sw *httpStreamWriter) armGuardLocked(after time.Duration) {
	if sw.guard == nil {
		sw.guard = time.AfterFunc(after, sw.breakIfStuck)
		return
	}
	sw.guard.Reset(after)
}

// breakIfStuck closes the stream's HTTP/2 connection if a write or flush
// has been in flight for stuckGrace while its deadline had passed that
// long ago, and the peer acknowledged nothing for that long: the
// connection takes nothing (see conn). Every stream of that connection is
// stuck as well then. Otherwise it looks again while the stream has not
// ended.
func (sw *httpStreamWriter) breakIfStuck() {
	sw.mu.Lock()
	defer sw.mu.Unlock()
	if sw.ended {
		return
	}
	if left := time.Until(sw.deadline.Add(stuckGrace)); left > 0 {
		sw.armGuardLocked(left) // a later deadline was set meanwhile
		return
	}
	since := sw.since.Load()
	if since == 0 {
		sw.armGuardLocked(stuckGrace) // nothing in flight: one may begin and wait
		return
	}
	if left := time.Duration(since - 1 + int64(stuckGrace) - monoNanos()); left > 0 {
		sw.armGuardLocked(left) // began after the deadline: give it the grace too
		return
	}
	if sw.takesBytesLocked() {
		// the reset goes out once the frame being written before it has (a
		// slow link, full buffers); closing would cut the connection's
		// other streams
		sw.armGuardLocked(stuckGrace)
		return
	}
	_ = sw.conn.Close()
}

// minProgress is what the peer of a connection must acknowledge in
// stuckGrace for the connection to count as taking bytes: a frame. One
// that takes less (a client reading a trickle) would hold a stop for as
// long as it likes.
const minProgress = 16 << 10

// takesBytesLocked reports whether the stream's connection is slow rather
// than stuck: its peer acknowledged minProgress a stuckGrace since the
// count was taken, and
// the write has not been past its deadline for longer than a write may
// block (the slow-client timeout). It takes the count for the next look.
func (sw *httpStreamWriter) takesBytesLocked() bool {
	acked, ok := connAcked(sw.conn)
	if !ok || !sw.ackedOK {
		return false
	}
	// minProgress per stuckGrace since the count was taken (at the
	// deadline, or the last look)
	elapsed := min(time.Since(sw.ackedAt), time.Hour)
	moved := acked-sw.acked >= uint64(max(elapsed*minProgress/stuckGrace, minProgress))
	sw.acked, sw.ackedAt = acked, time.Now()
	if sw.timeout > 0 && time.Since(sw.deadline) >= sw.timeout {
		return false
	}
	return moved
}

// end is called on the handler's goroutine when the stream no longer
// writes here (it ended, or is taken over): hurry and cut do nothing from
// then on, a deadline they set is taken back, and Caddy's idle-timeout
// writer gets its controller back (for its last flush after the handler).
func (sw *httpStreamWriter) end() {
	sw.mu.Lock()
	defer sw.mu.Unlock()
	if sw.ended {
		return
	}
	if sw.hurried {
		_ = sw.ctrl.SetWriteDeadline(time.Time{})
	}
	if sw.guard != nil {
		sw.guard.Stop()
	}
	sw.ended = true
	if sw.idle != nil {
		sw.idle.Ctrl = sw.idles
	}
}

// resume undoes end: the stream goes on writing here after all.
func (sw *httpStreamWriter) resume() {
	sw.mu.Lock()
	defer sw.mu.Unlock()
	sw.ended = false
	if sw.idle != nil {
		sw.idle.Ctrl = noDeadlines
	}
}

// MayBlock is true: the stream has its handler's goroutine.
func (sw *httpStreamWriter) MayBlock() bool { return true }

func (sw *httpStreamWriter) Write(p []byte) error {
	sw.since.Store(monoNanos() + 1)
	_, err := sw.w.Write(p)
	sw.since.Store(0)
	return sw.classify(err)
}

func (sw *httpStreamWriter) Flush() error {
	sw.since.Store(monoNanos() + 1)
	err := sw.rc.Flush()
	sw.since.Store(0)
	return sw.classify(err)
}

// WriteLast writes and flushes p within lastWordsTimeout (or the
// slow-client timeout, if shorter).
func (sw *httpStreamWriter) WriteLast(p []byte) error {
	sw.setDeadline(time.Now().Add(min(sw.timeout, lastWordsTimeout)))
	sw.since.Store(monoNanos() + 1) // in flight, for cut and breakIfStuck
	defer sw.since.Store(0)
	if _, err := sw.w.Write(p); err != nil {
		return err
	}
	return sw.rc.Flush()
}

// classify marks an error as a slow write when a deadline ended it: the
// registry's cut (HTTP/2 and HTTP/3 reset the stream then, HTTP/1 reports
// the deadline), or hurry's on HTTP/1.
func (sw *httpStreamWriter) classify(err error) error {
	if err == nil {
		return nil
	}
	if sw.cut.Load() || errors.Is(err, os.ErrDeadlineExceeded) {
		return fmt.Errorf("%w: %w", errSlowWrite, err)
	}
	return err
}
