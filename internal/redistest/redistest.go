// Package redistest starts real redis-server processes for tests, on free
// loopback ports, and stops them (by PID) when the test ends. Tests can kill
// and restart them to test faults. Without redis-server on PATH, tests are
// skipped — unless CI=true, where a missing redis-server fails the run.
package redistest

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-sse/caddy-sse/internal/clusterslot"
	"github.com/caddy-sse/caddy-sse/internal/freeport"
	"github.com/caddy-sse/caddy-sse/internal/waitfor"
)

// Require skips (or, with CI=true, fails) a test when redis-server or
// redis-cli is not installed.
func Require(t testing.TB) {
	t.Helper()
	for _, bin := range []string{"redis-server", "redis-cli"} {
		if _, err := exec.LookPath(bin); err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatalf("%s is required when CI=true: %v", bin, err)
			}
			t.Skipf("%s not installed: %v", bin, err)
		}
	}
}

// FreePort returns a port free for a redis-server (and its cluster bus at
// port+10000); see package freeport.
func FreePort(t testing.TB) int {
	t.Helper()
	return freeport.Get(t, false)
}

// Server is one redis-server process.
type Server struct {
	t    testing.TB
	Port int
	Dir  string
	// Password is what CLI authenticates with: the --requirepass given to
	// Start, or the sentinel's requirepass.
	Password string
	args     []string
	cmd      *exec.Cmd
	log      *os.File
}

// Addr is the server's host:port.
func (s *Server) Addr() string { return "127.0.0.1:" + strconv.Itoa(s.Port) }

// URL is the server's redis:// URL.
func (s *Server) URL() string { return "redis://" + s.Addr() }

// Start starts a redis-server on a free port with persistence off; extra
// arguments are added to its command line (e.g. "--cluster-enabled", "yes").
func Start(t testing.TB, extra ...string) *Server {
	t.Helper()
	Require(t)
	s := &Server{t: t, Dir: t.TempDir()}
	s.args = append([]string{
		"--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", s.Dir, "--daemonize", "no", "--loglevel", "warning",
		// a replica's first sync starts at once, not after the default 5 s
		"--repl-diskless-sync-delay", "0",
	}, extra...)
	for i, arg := range extra {
		if arg == "--requirepass" && i+1 < len(extra) {
			s.Password = extra[i+1]
		}
	}
	t.Cleanup(s.Stop)
	// a port free a moment ago may be taken meanwhile by another test
	// package running in parallel: try again with others
	for attempt := 1; ; attempt++ {
		s.Port = FreePort(t)
		err := s.start()
		if err == nil {
			return s
		}
		if attempt == 5 || !strings.Contains(err.Error(), "Address already in use") {
			t.Fatal(err)
		}
	}
}

// Restart starts the server again on the same port (after Kill or Stop).
func (s *Server) Restart() {
	s.t.Helper()
	if err := s.start(); err != nil {
		s.t.Fatal(err)
	}
}

func (s *Server) start() error {
	if s.cmd != nil {
		return errors.New("redistest: start of a running server")
	}
	log, err := os.OpenFile(filepath.Join(s.Dir, "redis.log"), os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	args := append([]string{"--port", strconv.Itoa(s.Port)}, s.args...)
	cmd := exec.Command("redis-server", args...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = dieWithParent()
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting redis-server: %v", err)
	}
	s.cmd, s.log = cmd, log
	if err := s.waitReady(); err != nil {
		s.Kill()
		return err
	}
	return nil
}

func (s *Server) waitReady() error {
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if out, err := s.CLI("PING"); err == nil && strings.TrimSpace(out) == "PONG" {
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	data, _ := os.ReadFile(filepath.Join(s.Dir, "redis.log"))
	return fmt.Errorf("redis-server on %d did not start:\n%s", s.Port, data)
}

// Kill ends the server abruptly (SIGKILL): a crash.
func (s *Server) Kill() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	_ = s.cmd.Wait()
	s.log.Close()
	s.cmd = nil
}

// Pause freezes the server (SIGSTOP): it neither answers nor replicates
// until Resume.
func (s *Server) Pause() { _ = s.cmd.Process.Signal(syscall.SIGSTOP) }

// Resume lets a paused server run again (SIGCONT).
func (s *Server) Resume() { _ = s.cmd.Process.Signal(syscall.SIGCONT) }

// Stop ends the server (used at cleanup).
func (s *Server) Stop() { s.Kill() }

// CLI runs redis-cli against the server and returns its output.
func (s *Server) CLI(args ...string) (string, error) {
	return cli(s.Port, s.Password, args...)
}

// MustCLI is CLI that fails the test on error or an error reply.
func (s *Server) MustCLI(args ...string) string {
	s.t.Helper()
	out, err := s.CLI(args...)
	if err != nil || strings.HasPrefix(out, "ERR") || strings.HasPrefix(out, "(error)") {
		s.t.Fatalf("redis-cli %v: %v %s", args, err, out)
	}
	return out
}

// CLI runs redis-cli against a port, with a time limit.
func CLI(port int, args ...string) (string, error) {
	return cli(port, "", args...)
}

func cli(port int, password string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	full := append([]string{"-h", "127.0.0.1", "-p", strconv.Itoa(port)}, args...)
	cmd := exec.CommandContext(ctx, "redis-cli", full...)
	if password != "" {
		// through the environment, not -a: redis-cli warns about -a on
		// every call, and the warning would be part of the output
		cmd.Env = append(os.Environ(), "REDISCLI_AUTH="+password)
	}
	out, err := cmd.CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

// Cluster is a Redis Cluster of local primaries (replicas are added with AddReplica).
type Cluster struct {
	Nodes []*Server
}

// Addrs returns the nodes' addresses.
func (c *Cluster) Addrs() []string {
	addrs := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		addrs[i] = n.Addr()
	}
	return addrs
}

// StartCluster starts n cluster-enabled redis-servers and joins them with
// `redis-cli --cluster create`, slots spread evenly.
func StartCluster(t testing.TB, n int) *Cluster {
	t.Helper()
	c := &Cluster{}
	for range n {
		c.Nodes = append(c.Nodes, Start(t, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
			"--cluster-node-timeout", "2000"))
	}
	args := append([]string{"--cluster", "create"}, c.Addrs()...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := CLI(c.Nodes[0].Port, args...); err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	c.WaitOK(t)
	return c
}

// AddReplica starts a node that replicates primary, and waits until it
// is in sync and every primary knows it (so that they accept its promotion).
// It is not one of c.Nodes.
func (c *Cluster) AddReplica(t testing.TB, primary *Server) *Server {
	t.Helper()
	r := Start(t, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000")
	for _, n := range c.Nodes {
		r.MustCLI("CLUSTER", "MEET", "127.0.0.1", strconv.Itoa(n.Port))
	}
	id, rid := primary.NodeID(), r.NodeID()
	waitFor(t, "the replica to replicate "+primary.Addr(), func() bool {
		out, _ := r.CLI("CLUSTER", "REPLICATE", id) // refused until the meeting has spread
		return out == "OK"
	})
	waitFor(t, "the replica to sync", func() bool {
		out, _ := r.CLI("INFO", "replication")
		return strings.Contains(out, "master_link_status:up")
	})
	for _, n := range c.Nodes {
		waitFor(t, n.Addr()+" to know the replica", func() bool {
			out, _ := n.CLI("CLUSTER", "NODES")
			return strings.Contains(out, rid) && strings.Contains(out, "slave "+id)
		})
	}
	return r
}

// waitFor polls cond until it holds, for at most 30 s.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	waitfor.Until(t, what, 30*time.Second, 50*time.Millisecond, cond)
}

// WaitOK waits until every node reports cluster_state:ok and agrees on
// the slots.
func (c *Cluster) WaitOK(t testing.TB) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		ok := true
		for _, node := range c.Nodes {
			out, err := node.CLI("CLUSTER", "INFO")
			if err != nil || !strings.Contains(out, "cluster_state:ok") {
				ok = false
				break
			}
		}
		if ok {
			if out, err := CLI(c.Nodes[0].Port, "--cluster", "check", c.Nodes[0].Addr()); err == nil && strings.Contains(out, "[OK] All 16384 slots covered") {
				return
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatal("redis cluster did not become ok")
}

// NodeOfSlot returns the node serving a slot, as node 0 sees the cluster.
func (c *Cluster) NodeOfSlot(t testing.TB, slot int) *Server {
	t.Helper()
	sc := bufio.NewScanner(strings.NewReader(c.Nodes[0].MustCLI("CLUSTER", "NODES")))
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 9 || !strings.Contains(fields[2], "master") {
			continue
		}
		for _, r := range fields[8:] {
			lo, hi, ranged := strings.Cut(r, "-")
			l, err := strconv.Atoi(lo)
			if err != nil {
				continue // a migrating/importing marker
			}
			h := l
			if ranged {
				h, _ = strconv.Atoi(hi)
			}
			if slot >= l && slot <= h {
				return c.nodeAt(t, fields[1])
			}
		}
	}
	t.Fatalf("no node serves slot %d", slot)
	return nil
}

// MigrateSlotByHand moves slot from one primary to another the way
// redis-cli --cluster reshard and every operator tool do it (SETSLOT
// IMPORTING / MIGRATING, MIGRATE the keys, SETSLOT NODE everywhere), with
// during(phase) called after each step. It reports a MIGRATE refused
// because the target already holds keys of the slot (and then migrates
// with REPLACE, what --cluster-replace does).
func (c *Cluster) MigrateSlotByHand(t testing.TB, slot int, from, to *Server, during func(phase string)) {
	t.Helper()
	fromID, toID := from.NodeID(), to.NodeID()
	slotArg := strconv.Itoa(slot)
	to.MustCLI("CLUSTER", "SETSLOT", slotArg, "IMPORTING", fromID)
	from.MustCLI("CLUSTER", "SETSLOT", slotArg, "MIGRATING", toID)
	during("migrating") // the operator's tool lists and moves keys meanwhile
	keys := strings.Fields(from.MustCLI("CLUSTER", "GETKEYSINSLOT", slotArg, "10000"))
	if len(keys) > 0 {
		args := append([]string{"MIGRATE", "127.0.0.1", strconv.Itoa(to.Port), "", "0", "5000", "KEYS"}, keys...)
		out, _ := from.CLI(args...)
		if out != "OK" {
			t.Errorf("MIGRATE of the slot's keys refused: %q (the target already holds keys of the channel: publishes during MIGRATING ran there, on an empty history)", out)
			args = append([]string{"MIGRATE", "127.0.0.1", strconv.Itoa(to.Port), "", "0", "5000", "REPLACE", "KEYS"}, keys...)
			if out, _ := from.CLI(args...); out != "OK" {
				t.Fatalf("MIGRATE REPLACE: %q", out)
			}
		}
	}
	during("migrated")
	for _, n := range c.Nodes {
		n.MustCLI("CLUSTER", "SETSLOT", slotArg, "NODE", toID)
	}
	c.WaitOK(t)
	during("moved")
}

// OtherPrimary returns a primary of the cluster other than not.
func (c *Cluster) OtherPrimary(not *Server) *Server {
	for _, n := range c.Nodes {
		if n != not {
			return n
		}
	}
	return nil
}

// FirstSlotOf returns the lowest slot a node serves, as node 0 sees it.
func (c *Cluster) FirstSlotOf(t testing.TB, node *Server) int {
	t.Helper()
	sc := bufio.NewScanner(strings.NewReader(c.Nodes[0].MustCLI("CLUSTER", "NODES")))
	lowest := -1
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 9 || c.nodeAt(t, fields[1]) != node {
			continue
		}
		for _, r := range fields[8:] {
			lo, _, _ := strings.Cut(r, "-")
			if l, err := strconv.Atoi(lo); err == nil && (lowest < 0 || l < lowest) {
				lowest = l
			}
		}
	}
	if lowest < 0 {
		t.Fatalf("%s serves no slot", node.Addr())
	}
	return lowest
}

// nodeAt finds the node of an address as CLUSTER NODES prints it
// (ip:port@busport).
func (c *Cluster) nodeAt(t testing.TB, addr string) *Server {
	t.Helper()
	hostPort, _, _ := strings.Cut(addr, "@")
	for _, n := range c.Nodes {
		if n.Addr() == hostPort {
			return n
		}
	}
	t.Fatalf("no node at %s", addr)
	return nil
}

// NodeID returns a node's cluster id.
func (s *Server) NodeID() string {
	s.t.Helper()
	return s.MustCLI("CLUSTER", "MYID")
}

// Sentinel is a primary, a replica and one sentinel watching them.
type Sentinel struct {
	Primary, Replica *Server
	Sentinel         *Server
	Master           string // the monitored master's name
}

// StartSentinel starts a primary, a replica of it and a sentinel that fails
// over after a second of silence.
func StartSentinel(t testing.TB) *Sentinel {
	t.Helper()
	return StartSentinelAuth(t, SentinelAuth{})
}

// SentinelAuth are the passwords of a Sentinel set-up; empty is none.
type SentinelAuth struct {
	Data     string // requirepass of the primary and the replica
	Sentinel string // requirepass of the sentinel itself
}

// StartSentinelAuth is StartSentinel with passwords.
func StartSentinelAuth(t testing.TB, auth SentinelAuth) *Sentinel {
	t.Helper()
	var dataArgs []string
	if auth.Data != "" {
		// masterauth too: the replica syncs from the primary, and after a
		// failover the old primary from the new one
		dataArgs = []string{"--requirepass", auth.Data, "--masterauth", auth.Data}
	}
	primary := Start(t, dataArgs...)
	replica := Start(t, append(dataArgs, "--replicaof", "127.0.0.1", strconv.Itoa(primary.Port))...)
	s := &Sentinel{Primary: primary, Replica: replica, Master: "ssemaster"}
	port := FreePort(t)
	dir := t.TempDir()
	conf := filepath.Join(dir, "sentinel.conf")
	content := fmt.Sprintf("port %d\nbind 127.0.0.1\ndir %s\nsentinel monitor %s 127.0.0.1 %d 1\n"+
		"sentinel down-after-milliseconds %s 1000\nsentinel failover-timeout %s 3000\nsentinel parallel-syncs %s 1\n",
		port, dir, s.Master, primary.Port, s.Master, s.Master, s.Master)
	if auth.Data != "" {
		content += fmt.Sprintf("sentinel auth-pass %s %s\n", s.Master, auth.Data)
	}
	if auth.Sentinel != "" {
		content += fmt.Sprintf("requirepass %s\n", auth.Sentinel)
	}
	if err := os.WriteFile(conf, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	sentinel := &Server{t: t, Port: port, Dir: dir, Password: auth.Sentinel, args: []string{"--sentinel"}}
	sentinel.startWithConfig(conf)
	t.Cleanup(sentinel.Stop)
	s.Sentinel = sentinel
	s.waitReplicating(t)
	return s
}

func (s *Server) startWithConfig(conf string) {
	s.t.Helper()
	log, err := os.OpenFile(filepath.Join(s.Dir, "redis.log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		s.t.Fatal(err)
	}
	cmd := exec.Command("redis-server", append([]string{conf}, s.args...)...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = dieWithParent()
	if err := cmd.Start(); err != nil {
		s.t.Fatalf("starting redis sentinel: %v", err)
	}
	s.cmd, s.log = cmd, log
	if err := s.waitReady(); err != nil {
		s.t.Fatal(err)
	}
}

func (s *Sentinel) waitReplicating(t testing.TB) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		info, _ := s.Replica.CLI("INFO", "replication")
		sentinelView, _ := s.Sentinel.CLI("SENTINEL", "REPLICAS", s.Master)
		if strings.Contains(info, "master_link_status:up") && strings.Contains(sentinelView, strconv.Itoa(s.Replica.Port)) {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatal("the replica did not start replicating, or the sentinel did not see it")
}

// MasterPort asks the sentinel which port the master is on now.
func (s *Sentinel) MasterPort(t testing.TB) int {
	t.Helper()
	out := s.Sentinel.MustCLI("SENTINEL", "GET-MASTER-ADDR-BY-NAME", s.Master)
	lines := strings.Fields(out)
	if len(lines) < 2 {
		t.Fatalf("sentinel answered %q", out)
	}
	port, _ := strconv.Atoi(lines[1])
	return port
}

// WaitFailedOver waits until the sentinel names the replica as the master
// (a failover after the primary was killed), within deadline.
func (s *Sentinel) WaitFailedOver(t testing.TB, deadline time.Time) {
	t.Helper()
	for s.MasterPort(t) != s.Replica.Port {
		if time.Now().After(deadline) {
			t.Fatal("the sentinel did not fail over")
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// ShardSubscribers is how many connections subscribe to the shard channel
// (PUBSUB SHARDNUMSUB); -1 if Redis did not answer.
func (s *Server) ShardSubscribers(channel string) int {
	out, err := s.CLI("PUBSUB", "SHARDNUMSUB", channel)
	f := strings.Fields(out)
	if err != nil || len(f) != 2 {
		return -1
	}
	n, err := strconv.Atoi(f[1])
	if err != nil {
		return -1
	}
	return n
}

// WaitShardSubscribers waits until n connections subscribe to the shard
// channel (ShardSubscribers); the module subscribes asynchronously.
func (s *Server) WaitShardSubscribers(t testing.TB, channel string, n int) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	got := -1
	for time.Now().Before(deadline) {
		if got = s.ShardSubscribers(channel); got == n {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("shard channel %s has %d subscribers (-1: no answer), want %d", channel, got, n)
}

// WaitStreamLength waits until the stream key holds n entries (XLEN): on a
// replica, what the primary acknowledged arrives a moment later.
func (s *Server) WaitStreamLength(t testing.TB, key string, n int) {
	t.Helper()
	want := strconv.Itoa(n)
	waitFor(t, fmt.Sprintf("%s on %s to hold %d entries", key, s.Addr(), n), func() bool {
		out, _ := s.CLI("XLEN", key)
		return out == want
	})
}

// WaitFunction waits until the server has the function name, before a
// test calls it itself as a backend would: a client loads the library that
// holds it, and a Redis that restarted empty gets it again only once that
// client next talks to it (a CI run called a function first and got
// "Function not found").
func (s *Server) WaitFunction(t testing.TB, name string) {
	t.Helper()
	waitFor(t, "the function "+name+" on "+s.Addr(), func() bool {
		out, _ := s.CLI("FUNCTION", "LIST")
		return slices.Contains(strings.Split(out, "\n"), name)
	})
}

// SlotOf is Redis Cluster's hash slot of a channel's keys: CRC-16/XMODEM
// of the hash tag, which is the channel.
func SlotOf(channel string) int { return int(clusterslot.Of(channel)) }
