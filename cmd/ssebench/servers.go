package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-sse/caddy-sse/internal/freeport"
)

// proc is a process this run started (a server, the Redis, a subscriber
// worker): it is stopped by its pid, and dies with the tool (PDEATHSIG).
type proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{} // closed when it has exited (and was reaped)
	log  string
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// startProc starts cmd and reaps it in the background.
func startProc(name string, cmd *exec.Cmd, log string) (*proc, error) {
	cmd.SysProcAttr = spawnAttrs()
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &proc{name: name, cmd: cmd, done: make(chan struct{}), log: log}
	go func() {
		_ = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// stopProcs sends sig to every process, waits up to grace for all of them,
// then kills (SIGKILL, by pid) those still running and waits a little more.
func stopProcs(ps []*proc, sig syscall.Signal, grace time.Duration) {
	for _, p := range ps {
		if !p.exited() {
			_ = p.cmd.Process.Signal(sig)
		}
	}
	left := waitExited(ps, grace)
	for _, p := range left {
		_ = p.cmd.Process.Kill()
	}
	waitExited(left, 5*time.Second)
}

// waitExited waits up to d for every process to exit and returns those
// still running. The limit is one for all: a time.After channel would fire
// for the first process waited past it and never again, leaving the wait
// for the next one without a limit.
func waitExited(ps []*proc, d time.Duration) (left []*proc) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	for _, p := range ps {
		select {
		case <-p.done:
		case <-ctx.Done():
			left = append(left, p)
		}
	}
	return left
}

var envWord = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*=`)

// splitSpawn splits a -spawn command line on spaces into its leading
// NAME=value words (environment) and the command.
func splitSpawn(line string) (env, args []string) {
	words := strings.Fields(line)
	i := 0
	for i < len(words) && envWord.MatchString(words[i]) {
		i++
	}
	return words[:i], words[i:]
}

// spawnLogFile creates the log of the i-th server.
func (r *runner) spawnLogFile(i int) (*os.File, error) {
	if r.cfg.spawnLog == "" {
		return os.CreateTemp("", fmt.Sprintf("ssebench-server%s-*.log", map[bool]string{true: "", false: strconv.Itoa(i)}[i == 0]))
	}
	path := r.cfg.spawnLog
	if i > 0 {
		path += "." + strconv.Itoa(i)
	}
	return os.Create(path)
}

// startServer starts the i-th -spawn command line, its output to logf
// (which it closes).
func (r *runner) startServer(i int, logf *os.File) (*proc, error) {
	defer logf.Close()
	line := r.cfg.spawns[i]
	env, args := splitSpawn(line)
	if len(args) == 0 {
		return nil, fmt.Errorf("-spawn %q: no command", line)
	}
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = os.Environ()
	if r.redisURL != "" {
		cmd.Env = append(cmd.Env, "SSEBENCH_REDIS="+r.redisURL)
	}
	cmd.Env = append(cmd.Env, env...) // the command line's own words win
	p, err := startProc(fmt.Sprintf("server %d", i), cmd, logf.Name())
	if err != nil {
		return nil, fmt.Errorf("-spawn: %v", err)
	}
	return p, nil
}

// spawn starts the Redis (-spawn-redis) and then the servers (-spawn) and
// waits until each listens: every target URL and admin address answers,
// and, with several servers, each of them holds a listening socket.
func (r *runner) spawn() error {
	cfg := r.cfg
	if cfg.spawnRedis != "" {
		if err := r.spawnRedisServer(); err != nil {
			return err
		}
	}
	if len(cfg.spawns) == 0 {
		return nil
	}
	setPhase("spawn")
	addrs := []string{}
	secure := map[string]bool{}
	for _, t := range r.targets {
		addrs = append(addrs, t.addr.String())
		secure[t.addr.String()] = t.tls
	}
	addrs = append(addrs, cfg.admins...)
	if err := nothingListens(addrs); err != nil {
		return err
	}
	for i := range cfg.spawns {
		logf, err := r.spawnLogFile(i)
		if err != nil {
			return err
		}
		p, err := r.startServer(i, logf)
		if err != nil {
			return err
		}
		r.mu.Lock()
		r.servers = append(r.servers, p)
		r.mu.Unlock()
		r.pids = append(r.pids, p.pid())
		r.serverLogPaths = append(r.serverLogPaths, p.log)
	}
	r.pid = r.pids[0]
	deadline := time.Now().Add(cfg.spawnWait)
	exited := func() error {
		for _, p := range r.servers {
			if p.exited() {
				return fmt.Errorf("-spawn: %s exited before listening (log: %s)", p.name, p.log)
			}
		}
		return nil
	}
	for _, a := range addrs {
		for {
			err := dialReady(a, secure[a])
			if err == nil {
				break
			}
			if err := exited(); err != nil {
				return fmt.Errorf("%v; waiting for %s", err, a)
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("-spawn: %s is not ready after %s: %v (logs: %s)", a, cfg.spawnWait, err, r.serverLogs())
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	if len(r.servers) > 1 {
		for _, p := range r.servers {
			for !treeListens(p.pid()) {
				if err := exited(); err != nil {
					return err
				}
				if time.Now().After(deadline) {
					return fmt.Errorf("-spawn: %s (pid %d) does not listen after %s (log: %s)", p.name, p.pid(), cfg.spawnWait, p.log)
				}
				time.Sleep(50 * time.Millisecond)
			}
		}
	}
	return nil
}

// dialReady connects to addr, with a TLS handshake if secure: a Caddy with
// `tls internal` listens before its certificate is ready, and refuses the
// handshakes of that moment (tls: internal error), which a ramp would count
// as failed attempts.
func dialReady(addr string, secure bool) error {
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	if !secure {
		return nil
	}
	tc := tls.Client(c, insecureTLS())
	_ = tc.SetDeadline(time.Now().Add(time.Second))
	return tc.Handshake()
}

// nothingListens fails if a server already listens on one of the addresses
// a spawned server is to take: Caddy binds with SO_REUSEPORT, so a server
// left from an earlier run would share the port with the new one, take
// part of the connections and answer part of the admin requests (a CPU
// profile of the wrong process), and the run would measure both.
func nothingListens(addrs []string) error {
	for _, a := range addrs {
		c, err := net.DialTimeout("tcp", a, 200*time.Millisecond)
		if err == nil {
			c.Close()
			return fmt.Errorf("-spawn: something already listens on %s (a server left from an earlier run?); stop it first", a)
		}
	}
	return nil
}

// treeListens reports whether pid or one of its descendants holds a
// listening TCP socket (Pushpin's runner does not; the condure it starts
// does).
func treeListens(pid int) bool {
	if listens(pid) {
		return true
	}
	for _, kid := range descendants(pid) {
		if listens(kid) {
			return true
		}
	}
	return false
}

// listens reports whether pid holds a listening TCP socket.
func listens(pid int) bool {
	want := map[uint64]bool{}
	for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		for _, n := range allListenInodes(b) {
			want[n] = true
		}
	}
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return false
	}
	for _, e := range ents {
		link, err := os.Readlink(dir + "/" + e.Name())
		if err != nil {
			continue
		}
		if n, ok := parseSocketLink(link); ok && want[n] {
			return true
		}
	}
	return false
}

// allListenInodes returns the inodes of every listening socket in the text
// of /proc/net/tcp{,6}.
func allListenInodes(b []byte) []uint64 {
	var out []uint64
	for i, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if i == 0 || len(f) < 10 || f[3] != "0A" {
			continue
		}
		if n, err := strconv.ParseUint(f[9], 10, 64); err == nil && n != 0 {
			out = append(out, n)
		}
	}
	return out
}

func (r *runner) serverLogs() string { return strings.Join(r.serverLogPaths, ", ") }

// freePort returns a free TCP port for a spawned Redis: below the kernel's
// ephemeral range, never 6379, and kept from other processes that take
// theirs the same way (the project's test binaries). A port the kernel
// handed out for port 0 was free again, until Redis bound it, for every
// other port-0 listener and outgoing connection.
func freePort() (int, error) { return freeport.Take(false) }

// spawnRedisServer starts a private redis-server on 127.0.0.1 without
// persistence (with an append-only file synced at every write if -chaos
// kills it) and waits until it answers PING.
func (r *runner) spawnRedisServer() error {
	cfg := r.cfg
	setPhase("spawn-redis")
	bin, err := exec.LookPath(cfg.spawnRedis)
	if err != nil {
		return fmt.Errorf("-spawn-redis: %v", err)
	}
	port := cfg.redisPort
	if port == 0 {
		if port, err = freePort(); err != nil {
			return fmt.Errorf("-spawn-redis: %v", err)
		}
	}
	if port == 6379 {
		return errors.New("-spawn-redis: refusing port 6379")
	}
	dir, err := os.MkdirTemp("", "ssebench-redis-*")
	if err != nil {
		return err
	}
	r.redisDir = dir
	aof := []string{"--appendonly", "no"}
	if strings.Contains(cfg.chaos, "kill-redis") {
		aof = []string{"--appendonly", "yes", "--appendfsync", "always"}
	}
	r.redisCmd = append([]string{bin, "--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--protected-mode", "no",
		"--daemonize", "no", "--dir", dir, "--logfile", ""}, aof...)
	r.redisURL = "redis://" + net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	return r.startRedis()
}

// startRedis starts the spawned Redis' command line (again, after -chaos
// killed it) on its free port and waits until it answers PING and holds
// the listening socket.
func (r *runner) startRedis() error {
	addr := strings.TrimPrefix(r.redisURL, "redis://")
	// another Redis there would answer the PING of one that could not
	// listen: the run would measure a dead process and -chaos would kill
	// nothing
	if c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond); err == nil {
		c.Close()
		return fmt.Errorf("-spawn-redis: something already listens on %s; stop it first", addr)
	}
	logf, err := os.OpenFile(r.redisLogPathOrNew(), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.Command(r.redisCmd[0], r.redisCmd[1:]...)
	cmd.Stdout, cmd.Stderr = logf, logf
	p, err := startProc("redis", cmd, logf.Name())
	if err != nil {
		return fmt.Errorf("-spawn-redis: %v", err)
	}
	r.mu.Lock()
	r.redis = p
	r.mu.Unlock()
	r.redisLogPath = p.log
	rdb := redis.NewClient(&redis.Options{Addr: addr, DialTimeout: time.Second, ReadTimeout: time.Second, MaxRetries: -1, PoolSize: 1})
	defer rdb.Close()
	deadline := time.Now().Add(r.cfg.spawnWait)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := rdb.Ping(ctx).Err()
		cancel()
		if err == nil && listens(p.pid()) {
			break
		}
		if p.exited() {
			return fmt.Errorf("-spawn-redis: redis-server exited (log: %s)", p.log)
		}
		if time.Now().After(deadline) {
			if err == nil {
				return fmt.Errorf("-spawn-redis: %s answers, but redis-server pid %d does not listen after %s (log: %s)", addr, p.pid(), r.cfg.spawnWait, p.log)
			}
			return fmt.Errorf("-spawn-redis: no PONG from %s after %s: %v (log: %s)", addr, r.cfg.spawnWait, err, p.log)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return nil
}

// redisLogPathOrNew is the spawned Redis' log file: the one it had, or a
// new temporary file.
func (r *runner) redisLogPathOrNew() string {
	if r.redisLogPath != "" {
		return r.redisLogPath
	}
	f, err := os.CreateTemp("", "ssebench-redis-*.log")
	if err != nil {
		return os.DevNull
	}
	f.Close()
	return f.Name()
}

// stopServer stops what this run started, each by its pid: the subscriber
// workers (SIGKILL: their figures were read already, or the run is being
// aborted), the servers (SIGTERM, then SIGKILL after 15 s) and then the
// Redis (SIGTERM, then SIGKILL after 5 s). It is safe to call twice and
// from the watchdog.
func (r *runner) stopServer() {
	r.mu.Lock()
	workers, servers, rds := r.workers, r.servers, r.redis
	r.workers, r.servers, r.redis = nil, nil, nil
	r.mu.Unlock()
	var wp []*proc
	for _, w := range workers {
		wp = append(wp, w.p)
	}
	stopProcs(wp, syscall.SIGKILL, 5*time.Second)
	stopProcs(servers, syscall.SIGTERM, 15*time.Second)
	if rds != nil {
		stopProcs([]*proc{rds}, syscall.SIGTERM, 5*time.Second)
	}
	if rds != nil && r.redisDir != "" {
		_ = os.RemoveAll(r.redisDir)
	}
}
