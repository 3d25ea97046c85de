package main

import (
	"crypto/tls"
	"errors"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"syscall"
	"testing"
	"time"
)

// TestStopProcsKillsEveryStubbornServer stops two servers that ignore
// SIGTERM (as a Caddy still draining its streams may, past the grace): the
// grace is one for all of them, so once it is over the second must be
// killed as well instead of being waited for without a limit.
func TestStopProcsKillsEveryStubbornServer(t *testing.T) {
	var ps []*proc
	for i := range 2 {
		cmd := exec.Command("sh", "-c", `trap "" TERM; echo up; while :; do sleep 0.05; done`)
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		p, err := startProc("stubborn", cmd, "")
		if err != nil {
			t.Fatal(err)
		}
		ps = append(ps, p)
		// the trap is set once it says so
		if _, err := out.Read(make([]byte, 3)); err != nil {
			t.Fatalf("server %d: %v", i, err)
		}
	}
	t.Cleanup(func() {
		for _, p := range ps {
			_ = p.cmd.Process.Kill()
		}
	})
	stopped := make(chan struct{})
	go func() {
		stopProcs(ps, syscall.SIGTERM, 200*time.Millisecond)
		close(stopped)
	}()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("stopProcs still waiting 10 s after a 200 ms grace")
	}
	for i, p := range ps {
		if !p.exited() {
			t.Errorf("server %d (pid %d) still runs", i, p.pid())
		}
	}
}

// TestDialReadyWaitsForTheHandshakeOfATLSTarget: a server that accepts
// connections but has no certificate yet (a Caddy with `tls internal` just
// started) is not ready for an https target, and is for an http one; a
// server that completes the handshake is ready.
func TestDialReadyWaitsForTheHandshakeOfATLSTarget(t *testing.T) {
	noCert, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			return nil, errors.New("no certificate yet")
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer noCert.Close()
	srv := httptest.NewTLSServer(http.NotFoundHandler())
	defer srv.Close()
	go func() {
		for {
			c, err := noCert.Accept()
			if err != nil {
				return
			}
			go func() { _ = c.(*tls.Conn).Handshake(); c.Close() }()
		}
	}()
	if err := dialReady(noCert.Addr().String(), true); err == nil {
		t.Error("ready before the server could complete a handshake")
	}
	if err := dialReady(noCert.Addr().String(), false); err != nil {
		t.Errorf("a cleartext target is ready once something listens: %v", err)
	}
	if err := dialReady(srv.Listener.Addr().String(), true); err != nil {
		t.Errorf("not ready though the handshake works: %v", err)
	}
}
