package main

import (
	"crypto/tls"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/freeport"
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

// A run against several servers it did not start (scaleout on servers
// started by hand) measures each of them, as it does spawned ones: the
// server figures are divided by the deliveries of every stream, so the
// first server's CPU alone made the CPU per delivery look several times
// smaller than it was.
func TestServersFoundOnEveryURL(t *testing.T) {
	var urls []string
	var pids []int
	for range 2 {
		addr := "127.0.0.1:" + strconv.Itoa(freeport.Get(t, false))
		cmd := exec.Command(os.Args[0], "floor-server", "-addr", addr)
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		deadline := time.Now().Add(10 * time.Second)
		for dialReady(addr, false) != nil {
			if time.Now().After(deadline) {
				t.Fatalf("floor server on %s does not listen", addr)
			}
			time.Sleep(20 * time.Millisecond)
		}
		urls = append(urls, "http://"+addr+"/events")
		pids = append(pids, cmd.Process.Pid)
	}
	// the second URL twice, and a publish URL on the first server: one
	// process each, counted once
	cfg, err := parseArgs([]string{"scaleout", "-q", "-conns", "2",
		"-url", strings.Join(append(urls, urls[1]), ","), "-publish-url", urls[0]})
	if err != nil {
		t.Fatal(err)
	}
	r := newRunner(cfg, io.Discard, io.Discard)
	if err := r.setup(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = r.eng.closeAll(5 * time.Second) }()
	s, ok := r.sample()
	if !ok {
		t.Fatalf("no server sample; notes %q", r.res.Notes)
	}
	sum := r.serverSummary(s, s, s, 1, 1)
	if r.pid != pids[0] || !slices.Equal(sum.PIDs, pids) || len(sum.Processes) != 2 {
		t.Fatalf("measured pid %d, pids %v (%d processes); want %d, %v", r.pid, sum.PIDs, len(sum.Processes), pids[0], pids)
	}
}
