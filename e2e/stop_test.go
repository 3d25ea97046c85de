package e2e

import (
	"fmt"
	"strings"
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

// TestStopWaitsForTheShutdownDelay: with the http app's shutdown_delay
// (README, "Reload and stop"), a stopping server goes on serving for the
// delay, and its streams are told server_closing only once it ends and the
// listening socket is closed: an event published during the delay reaches
// them, and no stream is told before. Then the stop is as prompt as ever.
func TestStopWaitsForTheShutdownDelay(t *testing.T) {
	const delay = 2 * time.Second
	adminPort, port := freePort(t, false), freePort(t, false)
	site := strings.Replace(plainSite(adminPort, port), "auto_https off", "auto_https off\n\tshutdown_delay "+delay.String(), 1)
	p := startCaddy(t, fmt.Sprintf("127.0.0.1:%d", adminPort), site)
	base := fmt.Sprintf("http://127.0.0.1:%d/events", port)
	client, pub := h1Client(t, true), h1Client(t, false)
	streams := openStreams(t, client, base+"?channels=news", 3)

	began := time.Now()
	p.signal(syscall.SIGTERM)
	publish(t, pub, base, testSecret, "news", "during the delay")
	deadline := time.Now().Add(waitFor)
	forAll(t, streams, func(_ int, c *sseConn) error { return c.expectData(deadline, "during the delay") })
	forAll(t, streams, func(_ int, c *sseConn) error {
		if _, err := c.expectClosing(deadline, "shutdown", closeJitter); err != nil {
			return err
		}
		// a lower bound only: the delay must have passed
		if told := time.Since(began); told < delay-200*time.Millisecond {
			return fmt.Errorf("told server_closing %v after the signal, within the %v shutdown_delay", told, delay)
		}
		return c.expectEnd(deadline)
	})
	p.waitExit(began.Add(delay+exitWithin), began)
}
