package caddysse

import (
	"errors"
	"fmt"
	"net/http"
	"os"
	"sync"
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
type httpStreamWriter struct {
	w       http.ResponseWriter
	rc      *http.ResponseController
	timeout time.Duration
	// idle is Caddy's idle-timeout writer that bounds each write, if any;
	// without it (manual), this writer sets (and clears) the write
	// deadline itself.
	idle   *caddyhttp.IdleTimeoutWriter
	manual bool
	// resets is set on HTTP/2 and HTTP/3, where a write deadline that
	// passes resets the stream instead of being reported (classify)
	resets bool
	// began is when the write or flush in progress began, noted only where
	// classify needs it (resets): the clock is not read per write on
	// HTTP/1 with Caddy's idle writer.
	began time.Time
	// hurryMu orders hurry (any goroutine) against end: a deadline that
	// hurry set after the stream ended would linger on the connection's
	// next response (keep-alive).
	hurryMu sync.Mutex
	hurried bool
	ended   bool
}

// newHTTPStreamWriter prepares w for a long stream (SPEC S2): Caddy's
// server-wide write timeout is a hard ceiling on a response's writes, which
// would cut every stream after that long. It is lifted for this response
// only and replaced by a per-write limit of timeout. Read deadlines are left
// alone: moving them cancels the request's context.
func newHTTPStreamWriter(w http.ResponseWriter, r *http.Request, timeout time.Duration) *httpStreamWriter {
	sw := &httpStreamWriter{w: w, rc: http.NewResponseController(w), timeout: timeout, resets: r.ProtoMajor >= 2}
	if _, idle := caddyhttp.IdleTimeoutsFromContext(r.Context()); idle != nil {
		idle.Deadline.HardDeadline = time.Time{}
		idle.Override(timeout, 0, 0)
		sw.idle = idle
	} else {
		sw.manual = true
	}
	return sw
}

// hurry brings the deadline of a write in flight down to lastWordsTimeout;
// safe from any goroutine. It sets the connection's deadline below Caddy's
// idle-timeout writer (whose own bookkeeping is its goroutine's): that
// writer arms it again at the next write, which is then the stream's last
// words, bounded the same.
func (sw *httpStreamWriter) hurry() {
	sw.hurryMu.Lock()
	defer sw.hurryMu.Unlock()
	if sw.ended {
		return
	}
	sw.hurried = true
	_ = sw.conn().SetWriteDeadline(time.Now().Add(min(sw.timeout, lastWordsTimeout)))
}

// end is called when the stream no longer writes here (it ended, or was
// taken over): hurry does nothing from then on, and a deadline it set is
// taken back.
func (sw *httpStreamWriter) end() {
	sw.hurryMu.Lock()
	defer sw.hurryMu.Unlock()
	if !sw.ended && sw.hurried {
		_ = sw.conn().SetWriteDeadline(time.Time{})
	}
	sw.ended = true
}

// conn controls the connection's deadlines below Caddy's idle-timeout
// writer, if there is one.
func (sw *httpStreamWriter) conn() *http.ResponseController {
	if sw.idle != nil {
		return sw.idle.Ctrl
	}
	return sw.rc
}

// MayBlock is true: the stream has its handler's goroutine.
func (sw *httpStreamWriter) MayBlock() bool { return true }

func (sw *httpStreamWriter) Write(p []byte) error {
	sw.beginCall()
	_, err := sw.w.Write(p)
	return sw.classify(err)
}

// beginCall notes when a write or flush begins, where classify needs it,
// and, without Caddy's idle writer, sets its deadline. Each call has a
// deadline of its own (Caddy's idle writer arms one per call too), so only
// a call that lasted the timeout can have been cut by it.
func (sw *httpStreamWriter) beginCall() {
	if !sw.manual && !sw.resets {
		return
	}
	now := time.Now()
	sw.began = now
	if sw.manual {
		_ = sw.rc.SetWriteDeadline(now.Add(sw.timeout))
	}
}

func (sw *httpStreamWriter) Flush() error {
	sw.beginCall()
	if !sw.manual {
		return sw.classify(sw.rc.Flush())
	}
	err := sw.rc.Flush()
	// HTTP/2 arms a timer for a write deadline that resets the stream even
	// with no write in flight; clear it between writes.
	_ = sw.rc.SetWriteDeadline(time.Time{})
	return sw.classify(err)
}

// WriteLast writes and flushes p within lastWordsTimeout (or the
// slow-client timeout, if shorter).
func (sw *httpStreamWriter) WriteLast(p []byte) error {
	bound := min(sw.timeout, lastWordsTimeout)
	if sw.idle != nil {
		defer sw.idle.Override(bound, 0, 0)()
	} else {
		_ = sw.rc.SetWriteDeadline(time.Now().Add(bound))
		defer func() { _ = sw.rc.SetWriteDeadline(time.Time{}) }()
	}
	if _, err := sw.w.Write(p); err != nil {
		return err
	}
	return sw.rc.Flush()
}

// classify marks an error as a slow write when the write deadline ended it:
// HTTP/1 reports the deadline, but HTTP/2 resets the stream when it passes,
// so there a call that failed after (nearly) the whole timeout counts too.
// The call's, not its batch's: a client that reads slowly but steadily
// through a long batch, then leaves, was not slow (no call waited the
// timeout) and must not be throttled.
func (sw *httpStreamWriter) classify(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, os.ErrDeadlineExceeded) || (sw.resets && time.Since(sw.began) >= sw.timeout-sw.timeout/10) {
		return fmt.Errorf("%w: %w", errSlowWrite, err)
	}
	return err
}
