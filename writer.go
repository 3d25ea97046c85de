package caddysse

import (
	"net/http"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// streamWriter is where a stream's bytes go. Writes may be buffered until
// Flush. Each write and flush is bounded by the stream's slow-client
// timeout, and fails once the client is gone.
//
// The net/http implementation below is the default; it is the seam for a
// writer that takes HTTP/1.1 connections over from net/http.
type streamWriter interface {
	Write(p []byte) error
	Flush() error
}

// httpStreamWriter writes a stream through net/http and Caddy's response
// writer chain.
type httpStreamWriter struct {
	w       http.ResponseWriter
	rc      *http.ResponseController
	timeout time.Duration
	// manual is set when no Caddy idle-timeout writer bounds our writes,
	// so this writer sets (and clears) the write deadline itself.
	manual bool
}

// newHTTPStreamWriter prepares w for a long stream (SPEC S2): Caddy's
// server-wide write timeout is a hard ceiling on a response's writes, which
// would cut every stream after that long. It is lifted for this response
// only and replaced by a per-write limit of timeout. Read deadlines are left
// alone: moving them cancels the request's context.
func newHTTPStreamWriter(w http.ResponseWriter, r *http.Request, timeout time.Duration) *httpStreamWriter {
	sw := &httpStreamWriter{w: w, rc: http.NewResponseController(w), timeout: timeout}
	if _, idle := caddyhttp.IdleTimeoutsFromContext(r.Context()); idle != nil {
		idle.Deadline.HardDeadline = time.Time{}
		idle.Override(timeout, 0, 0)
	} else {
		sw.manual = true
	}
	return sw
}

func (sw *httpStreamWriter) Write(p []byte) error {
	if sw.manual {
		_ = sw.rc.SetWriteDeadline(time.Now().Add(sw.timeout))
	}
	_, err := sw.w.Write(p)
	return err
}

func (sw *httpStreamWriter) Flush() error {
	if !sw.manual {
		return sw.rc.Flush()
	}
	_ = sw.rc.SetWriteDeadline(time.Now().Add(sw.timeout))
	err := sw.rc.Flush()
	// HTTP/2 arms a timer for a write deadline that resets the stream even
	// with no write in flight; clear it between writes.
	_ = sw.rc.SetWriteDeadline(time.Time{})
	return err
}
