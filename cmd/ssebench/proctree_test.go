package main

import (
	"bufio"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// procHelperCommand runs the test binary as one process of a tree the
// tests of this file start (and end) themselves; see runProcHelper.
const procHelperCommand = "proc-helper"

// runProcHelper is a process of a test tree:
//
//	master <workers> <keep>: listen on 127.0.0.1:0, start <workers> workers
//	  holding the listening socket (as nginx's do), close its own copy
//	  unless <keep> is "keep" (Pushpin's runner does not listen; nginx's
//	  master does), print "port <port> <worker pids, comma-separated>",
//	  and wait for its stdin to close.
//	worker: hold fd 3 until stdin (the master's pipe) closes.
//	reaper <reap>: start a spinner, print "child <pid>"; when it has
//	  exited, reap it (wait) at once if <reap> is "now", else only after
//	  a line on stdin; then print "reaped" and wait for stdin to close.
//	spinner: use about 300 ms of CPU and exit.
func runProcHelper(args []string) int {
	if len(args) == 0 {
		return 2
	}
	self, err := os.Executable()
	if err != nil {
		return 2
	}
	child := func(mode ...string) *exec.Cmd {
		cmd := exec.Command(self, append([]string{procHelperCommand}, mode...)...)
		cmd.Stderr = os.Stderr // a worker ends at EOF on its stdin: the master's end
		return cmd
	}
	in := bufio.NewReader(os.Stdin)
	switch args[0] {
	case "master":
		n, _ := strconv.Atoi(args[1])
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 1
		}
		f, err := ln.(*net.TCPListener).File()
		if err != nil {
			return 1
		}
		var pids []string
		for range n {
			cmd := child("worker")
			cmd.ExtraFiles = []*os.File{f}
			if _, err := cmd.StdinPipe(); err != nil { // open while the master lives
				return 1
			}
			if err := cmd.Start(); err != nil {
				return 1
			}
			pids = append(pids, strconv.Itoa(cmd.Process.Pid))
		}
		if len(args) < 3 || args[2] != "keep" {
			f.Close()
			ln.Close()
		}
		fmt.Printf("port %d %s\n", ln.Addr().(*net.TCPAddr).Port, strings.Join(pids, ","))
		_, _ = in.ReadString(0)
		return 0
	case "worker":
		_, _ = in.ReadString(0)
		return 0
	case "reaper":
		cmd := child("spinner")
		if err := cmd.Start(); err != nil {
			return 1
		}
		fmt.Printf("child %d\n", cmd.Process.Pid)
		if args[1] != "now" { // a zombie until told
			_, _ = in.ReadString('\n')
		}
		_ = cmd.Wait()
		fmt.Println("reaped")
		_, _ = in.ReadString(0)
		return 0
	case "spinner":
		for {
			var ru syscall.Rusage
			_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
			if time.Duration(ru.Utime.Nano()+ru.Stime.Nano()) >= 300*time.Millisecond {
				return 0
			}
			for i := 0; i < 1e6; i++ {
			}
		}
	}
	return 2
}

// helperTree starts a helper of mode in a process group of its own (as a
// shell with job control, or a daemon's setsid, does) and returns it, its
// stdin and its stdout; the test ends it.
func helperTree(t *testing.T, mode ...string) (*exec.Cmd, *os.File, *bufio.Reader) {
	t.Helper()
	if runtime.GOOS != "linux" {
		t.Skip("reads /proc")
	}
	cmd := exec.Command(os.Args[0], append([]string{procHelperCommand}, mode...)...)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	inR, inW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdin = inR
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	inR.Close()
	t.Cleanup(func() {
		inW.Close()
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	})
	return cmd, inW, bufio.NewReader(out)
}

// readLine reads one line of a helper, within 10 s.
func readLine(t *testing.T, r *bufio.Reader) []string {
	t.Helper()
	got := make(chan string, 1)
	go func() { s, _ := r.ReadString('\n'); got <- s }()
	select {
	case s := <-got:
		return strings.Fields(s)
	case <-time.After(10 * time.Second):
		t.Fatal("the helper said nothing within 10 s")
		return nil
	}
}

// A server found by its port is measured as its whole tree, whichever of
// its processes holds the socket: nginx's workers hold the listening
// socket as the master does (each its own with reuseport), Pushpin's
// runner holds none. The measured process was the first holder found,
// a worker alone.
func TestFoundServerIsMeasuredAsItsTree(t *testing.T) {
	for _, keep := range []string{"keep", "close"} {
		t.Run("master-"+keep, func(t *testing.T) {
			master, _, out := helperTree(t, "master", "2", keep)
			f := readLine(t, out)
			if len(f) != 3 || f[0] != "port" {
				t.Fatalf("master said %q", f)
			}
			port, _ := strconv.Atoi(f[1])
			var workers []int
			for p := range strings.SplitSeq(f[2], ",") {
				pid, _ := strconv.Atoi(p)
				workers = append(workers, pid)
			}
			pids, err := listenerPIDs([]*target{{addr: netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(port))}})
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(pids, []int{master.Process.Pid}) {
				t.Fatalf("measured %v; want the master %d (workers %v)", pids, master.Process.Pid, workers)
			}
			tree, err := readProcTree(pids[0])
			if err != nil {
				t.Fatal(err)
			}
			one, err := readProc(workers[0])
			if err != nil {
				t.Fatal(err)
			}
			if tree.threads < 3*one.threads/2 {
				t.Fatalf("tree of %d threads, one worker %d: the tree is not summed", tree.threads, one.threads)
			}
		})
	}
}

// serverRoot's rule, on process tables: up to the parent in the same
// process group, but not to init, a shell, this tool or its ancestors.
func TestServerRoot(t *testing.T) {
	// 1 init; 50 sshd; 100 an interactive bash (group 100); 200 the tool
	// (group 200), started from it; 300 nginx master (setsid: group 300),
	// 301, 302 its workers; 400 a script's sh (group 400), 401 pushpin's
	// runner it started without job control, 402 condure, the listener;
	// 500 sudo (group 500), 501 a server it runs; 600 a server this tool
	// started (group 200)
	procs := map[int]procInfo{
		1: {0, 1, "systemd"}, 50: {1, 50, "sshd"}, 100: {50, 100, "bash"}, 200: {100, 200, "ssebench"},
		300: {1, 300, "nginx"}, 301: {300, 300, "nginx"}, 302: {300, 300, "nginx"},
		400: {100, 400, "sh"}, 401: {400, 400, "pushpin"}, 402: {401, 400, "condure"},
		500: {100, 500, "sudo"}, 501: {500, 500, "centrifugo"},
		600: {200, 200, "caddy"},
		700: {100, 700, "caddy"},
	}
	for _, c := range []struct{ pid, want int }{
		{302, 300}, {301, 300}, {300, 300}, // nginx: the master, not below init
		{402, 401}, // Pushpin: the runner, not the shell above it
		{501, 500}, // a launcher that stays counts in
		{600, 600}, // not this tool
		{700, 700}, // not the interactive shell (another group)
		{999, 999}, // unreadable: itself
	} {
		if got := serverRoot(c.pid, 200, procs); got != c.want {
			t.Errorf("serverRoot(%d) = %d, want %d", c.pid, got, c.want)
		}
	}
	// a server started by the same script as the tool: not up to the script
	procs[800] = procInfo{400, 400, "ssebench"}
	procs[801] = procInfo{400, 400, "python3"}
	if got := serverRoot(801, 800, procs); got != 801 {
		t.Errorf("serverRoot beside the tool = %d, want 801", got)
	}
	in, ok := parseProcInfo([]byte("42 (a (strange) name) S 17 40 40 0 -1"))
	if !ok || in != (procInfo{17, 40, "a (strange) name"}) {
		t.Errorf("parseProcInfo = %+v %v", in, ok)
	}
}

// procState is the state letter of /proc/<pid>/stat ('Z' for a zombie),
// or 0 when the process is gone.
func procState(pid int) byte {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	return f[0][0]
}

// The CPU of a process of the tree that exits stays in the tree's sum:
// as a zombie from its own /proc/<pid>/stat, once reaped from its
// parent's cutime and cstime. It dropped out of the sum with the process,
// so a server whose workers come and go looked cheaper (a window's CPU
// could even be negative).
func TestProcTreeKeepsTheCPUOfExitedChildren(t *testing.T) {
	const spun = 0.3 // the spinner's CPU seconds, by its own getrusage
	// /proc counts user and system time in clock ticks (USER_HZ, 100 a
	// second), each rounded down: the spinner's 0.3 s may read 0.28
	const least = spun - 2*0.01
	for _, reap := range []string{"now", "later"} {
		t.Run("reap-"+reap, func(t *testing.T) {
			parent, in, out := helperTree(t, "reaper", reap)
			f := readLine(t, out)
			if len(f) != 2 || f[0] != "child" {
				t.Fatalf("reaper said %q", f)
			}
			kid, _ := strconv.Atoi(f[1])
			if reap == "later" {
				deadline := time.Now().Add(10 * time.Second)
				for procState(kid) != 'Z' {
					if time.Now().After(deadline) {
						t.Fatalf("child %d is not a zombie: state %q", kid, procState(kid))
					}
					time.Sleep(10 * time.Millisecond)
				}
				zombie, err := readProcTree(parent.Process.Pid)
				if err != nil {
					t.Fatal(err)
				}
				if zombie.cpuSec < least {
					t.Fatalf("tree CPU %.2f s with the child a zombie; it used %.1f s", zombie.cpuSec, spun)
				}
				if _, err := in.WriteString("reap\n"); err != nil {
					t.Fatal(err)
				}
			}
			if f := readLine(t, out); len(f) != 1 || f[0] != "reaped" {
				t.Fatalf("reaper said %q", f)
			}
			tree, err := readProcTree(parent.Process.Pid)
			if err != nil {
				t.Fatal(err)
			}
			// counted once: twice would be 2 × spun
			if tree.cpuSec < least || tree.cpuSec > 1.7*spun {
				t.Fatalf("tree CPU %.2f s after the reap; the child used %.1f s", tree.cpuSec, spun)
			}
		})
	}
}
