package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/freeport"
	"github.com/caddy-sse/caddy-sse/internal/testwriter"
)

// caddyBin is the caddy binary built by TestMain.
var caddyBin string

// TestMain builds ./cmd/caddy once for all the tests and removes it at the
// end. A failed build fails the run: these tests are never skipped.
func TestMain(m *testing.M) {
	os.Exit(runTests(m))
}

func runTests(m *testing.M) int {
	root, err := moduleRoot()
	if err != nil {
		fmt.Fprintf(os.Stderr, "e2e: finding the module root: %v\n", err)
		return 1
	}
	dir, err := os.MkdirTemp("", "caddy-sse-e2e-bin-")
	if err != nil {
		fmt.Fprintf(os.Stderr, "e2e: %v\n", err)
		return 1
	}
	defer os.RemoveAll(dir)

	bin := filepath.Join(dir, "caddy")
	args := []string{"build", "-o", bin}
	if os.Getenv("CADDY_SSE_E2E_RACE") != "" {
		args = append(args, "-race")
	}
	args = append(args, "./cmd/caddy")
	build := exec.Command("go", args...)
	build.Dir = root
	began := time.Now()
	out, err := build.CombinedOutput()
	if err != nil {
		fmt.Fprintf(os.Stderr, "e2e: go %s (in %s) failed: %v\n%s\n", strings.Join(args, " "), root, err, out)
		return 1
	}
	fmt.Fprintf(os.Stderr, "e2e: built %s in %s\n", bin, time.Since(began).Round(time.Millisecond))
	caddyBin = bin
	return m.Run()
}

// moduleRoot is the directory of the go.mod of the package under test.
func moduleRoot() (string, error) {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %v", err)
	}
	gomod := strings.TrimSpace(string(out))
	if gomod == "" || gomod == os.DevNull {
		return "", errors.New("not inside a Go module")
	}
	return filepath.Dir(gomod), nil
}

// freePort returns a port free on every interface (and, with udp, for UDP
// too, which HTTP/3 needs), never the same twice in a run; see
// internal/freeport.
func freePort(t *testing.T, udp bool) int {
	t.Helper()
	return freeport.Get(t, udp)
}

// lockedBuffer collects a process's output from several goroutines.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// caddyProc is a running caddy binary started by a test.
type caddyProc struct {
	t         *testing.T
	cmd       *exec.Cmd
	config    string // path of the Caddyfile
	adminAddr string // host:port of the admin endpoint
	env       []string
	out       *lockedBuffer

	exited  chan struct{} // closed once Wait returned
	waitErr error         // Wait's result, set before exited is closed
}

// startCaddy writes caddyfile to a temporary file and runs the binary on
// it, with its data and config directories in temporary directories (so
// that nothing is written to $HOME), then waits until the admin endpoint
// answers. The caddyfile must set `admin <adminAddr>` in its global
// options. The process is killed when the test ends if it still runs, and
// its output is logged if the test failed.
func startCaddy(t *testing.T, adminAddr, caddyfile string) *caddyProc {
	t.Helper()
	dir := t.TempDir()
	config := filepath.Join(dir, "Caddyfile")
	if err := os.WriteFile(config, []byte(testwriter.Apply(caddyfile)), 0o600); err != nil {
		t.Fatal(err)
	}
	home := filepath.Join(dir, "home")
	if err := os.MkdirAll(home, 0o700); err != nil {
		t.Fatal(err)
	}
	p := &caddyProc{
		t:         t,
		config:    config,
		adminAddr: adminAddr,
		out:       new(lockedBuffer),
		exited:    make(chan struct{}),
		env: append(os.Environ(),
			"HOME="+home,
			"XDG_DATA_HOME="+filepath.Join(home, "data"),
			"XDG_CONFIG_HOME="+filepath.Join(home, "config"),
		),
	}
	p.cmd = exec.Command(caddyBin, "run", "--config", config, "--adapter", "caddyfile")
	p.cmd.Dir = dir
	p.cmd.Env = p.env
	p.cmd.Stdout = p.out
	p.cmd.Stderr = p.out
	// registered first, so it runs last: after the kill below
	t.Cleanup(func() {
		if t.Failed() || os.Getenv("CADDY_SSE_E2E_LOG") != "" {
			t.Logf("caddy output:\n%s", p.out.String())
		}
	})
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("starting caddy: %v", err)
	}
	go func() {
		p.waitErr = p.cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(p.kill)
	p.waitReady()
	return p
}

// kill ends the process (only this one, by its PID) if it still runs.
func (p *caddyProc) kill() {
	select {
	case <-p.exited:
		return
	default:
	}
	_ = p.cmd.Process.Kill()
	select {
	case <-p.exited:
	case <-time.After(10 * time.Second):
		p.t.Errorf("caddy (pid %d) did not exit after SIGKILL", p.cmd.Process.Pid)
	}
}

// waitReady waits until the admin endpoint answers GET /config/.
func (p *caddyProc) waitReady() {
	p.t.Helper()
	client := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(20 * time.Second)
	for {
		select {
		case <-p.exited:
			p.t.Fatalf("caddy exited before it was ready: %v", p.waitErr)
		default:
		}
		resp, err := client.Get("http://" + p.adminAddr + "/config/")
		if err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("caddy's admin endpoint %s did not answer within 20s (last error: %v)", p.adminAddr, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// cli runs `caddy <args...>` (reload, stop) with a timeout and returns how
// long it took; it fails the test if the command fails or times out.
func (p *caddyProc) cli(timeout time.Duration, args ...string) time.Duration {
	p.t.Helper()
	took, out, err := p.tryCLI(timeout, args...)
	if err != nil {
		p.t.Fatalf("caddy %s failed after %s: %v\n%s", strings.Join(args, " "), took, err, out)
	}
	return took
}

// tryCLI runs `caddy <args...>` with a timeout and returns how long it
// took, its output and its error; it fails the test only on the timeout.
func (p *caddyProc) tryCLI(timeout time.Duration, args ...string) (time.Duration, string, error) {
	p.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, caddyBin, args...)
	cmd.Env = p.env
	cmd.Dir = filepath.Dir(p.config)
	cmd.WaitDelay = time.Second
	began := time.Now()
	out, err := cmd.CombinedOutput()
	took := time.Since(began)
	if ctx.Err() != nil {
		p.t.Fatalf("caddy %s did not return within %s:\n%s", strings.Join(args, " "), timeout, out)
	}
	return took, string(out), err
}

// writeConfig replaces the process's Caddyfile (for a later reload).
func (p *caddyProc) writeConfig(caddyfile string) {
	p.t.Helper()
	if err := os.WriteFile(p.config, []byte(testwriter.Apply(caddyfile)), 0o600); err != nil {
		p.t.Fatal(err)
	}
}

// reload runs `caddy reload --force` on the same Caddyfile; it must return
// within 10 s.
func (p *caddyProc) reload() time.Duration {
	p.t.Helper()
	return p.cli(10*time.Second, p.reloadArgs()...)
}

func (p *caddyProc) reloadArgs() []string {
	return []string{"reload", "--config", p.config, "--adapter", "caddyfile", "--address", p.adminAddr, "--force"}
}

// stopCLI runs `caddy stop` against the admin endpoint (its /stop).
func (p *caddyProc) stopCLI() time.Duration {
	p.t.Helper()
	return p.cli(10*time.Second, "stop", "--address", p.adminAddr)
}

func (p *caddyProc) signal(sig syscall.Signal) {
	p.t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		p.t.Fatalf("sending %v to caddy: %v", sig, err)
	}
}

// waitExit waits until the process has exited, at the latest at deadline,
// and checks that it exited with code 0.
func (p *caddyProc) waitExit(deadline time.Time, since time.Time) {
	p.t.Helper()
	select {
	case <-p.exited:
	case <-time.After(time.Until(deadline)):
		p.t.Fatalf("caddy did not exit within %s", deadline.Sub(since).Round(time.Millisecond))
	}
	p.t.Logf("caddy exited %s after the stop began", time.Since(since).Round(time.Millisecond))
	if code := p.cmd.ProcessState.ExitCode(); code != 0 || p.waitErr != nil {
		p.t.Fatalf("caddy exited with code %d (%v), want 0", code, p.waitErr)
	}
}
