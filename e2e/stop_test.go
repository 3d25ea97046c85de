package e2e

import (
	"syscall"
	"testing"
	"time"
)

// exitWithin is how soon caddy must exit once a stop begins, with open
// streams and the default eternal grace period.
const exitWithin = 5 * time.Second

// TestStopWithOpenStreamsExitsPromptly: on SIGTERM (and SIGINT) every
// open stream is told server_closing with reason shutdown and ends, and the
// process exits with code 0 within 5 s although the grace period is eternal.
func TestStopWithOpenStreamsExitsPromptly(t *testing.T) {
	for name, sig := range map[string]syscall.Signal{"SIGTERM": syscall.SIGTERM, "SIGINT": syscall.SIGINT} {
		t.Run(name, func(t *testing.T) {
			p, streamURL, publishURL := plainServer(t)
			client, pub := h1Client(t, true), h1Client(t, false)
			streams := openStreams(t, client, streamURL, 10)
			publish(t, pub, publishURL, testSecret, "news", "hello")
			deadline := time.Now().Add(waitFor)
			forAll(t, streams, func(_ int, c *sseConn) error { return c.expectData(deadline, "hello") })

			began := time.Now()
			p.signal(sig)
			expectShutdown(t, p, streams, began)
		})
	}
}

// TestStopViaAdminAPIWithOpenStreamsExitsPromptly is the same with
// `caddy stop` (the admin API's /stop): the command returns, the streams
// are told server_closing with reason shutdown, and the process exits.
func TestStopViaAdminAPIWithOpenStreamsExitsPromptly(t *testing.T) {
	p, streamURL, publishURL := plainServer(t)
	client, pub := h1Client(t, true), h1Client(t, false)
	streams := openStreams(t, client, streamURL, 10)
	publish(t, pub, publishURL, testSecret, "news", "hello")
	deadline := time.Now().Add(waitFor)
	forAll(t, streams, func(_ int, c *sseConn) error { return c.expectData(deadline, "hello") })

	began := time.Now()
	took := p.stopCLI()
	t.Logf("caddy stop returned in %s", took.Round(time.Millisecond))
	expectShutdown(t, p, streams, began)
}

// expectShutdown checks that every stream gets server_closing (shutdown)
// and ends, and that the process exits with 0 within exitWithin of began.
func expectShutdown(t *testing.T, p *caddyProc, streams []*sseConn, began time.Time) {
	t.Helper()
	deadline := time.Now().Add(waitFor)
	forAll(t, streams, func(_ int, c *sseConn) error {
		if _, err := c.expectClosing(deadline, "shutdown", closeJitter); err != nil {
			return err
		}
		return c.expectEnd(deadline)
	})
	p.waitExit(began.Add(exitWithin), began)
}
