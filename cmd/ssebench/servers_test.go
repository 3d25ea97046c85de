package main

import (
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
