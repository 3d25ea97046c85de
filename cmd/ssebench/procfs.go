package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// clockTicks is USER_HZ, the unit of /proc/<pid>/stat times. It is 100 on
// every Linux architecture Go supports (the kernel exports that value to
// user space regardless of CONFIG_HZ).
const clockTicks = 100

// procStat is what the tool reads from /proc/<pid>/stat.
type procStat struct {
	state      byte // 'R', 'S', … 'Z' for a zombie
	utimeTicks int64
	stimeTicks int64
	// cutime, cstime: the CPU of the children the process has waited
	// for (reaped), theirs included, recursively. A child's CPU leaves
	// the /proc of the living with it, into these fields of its parent
	// when the parent reaps it; a living child is in neither.
	cutimeTicks int64
	cstimeTicks int64
	threads     int64
	rssPages    int64
}

// cpuSeconds is the CPU time of the process and of the children it has
// reaped: summed over the living processes of a tree, every process that
// ran in it counts once, whether it still runs or has exited and been
// reaped by a process of the tree.
func (s procStat) cpuSeconds() float64 {
	return float64(s.utimeTicks+s.stimeTicks+s.cutimeTicks+s.cstimeTicks) / clockTicks
}

// userSeconds is the CPU time spent in user space (with the reaped
// children's): the server's own code, without the kernel's work for its
// system calls (on loopback most of a delivery's cost, and what drifts
// most from one run to the next).
func (s procStat) userSeconds() float64 { return float64(s.utimeTicks+s.cutimeTicks) / clockTicks }

// parseProcStat parses /proc/<pid>/stat. The command name (field 2) is in
// parentheses and may hold spaces and parentheses, so fields are counted
// from the last ')'.
func parseProcStat(b []byte) (procStat, error) {
	var s procStat
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return s, errors.New("/proc stat: no ')'")
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state); utime is field 14, stime 15, cutime 16,
	// cstime 17, num_threads 20, rss 24.
	if len(f) < 22 {
		return s, fmt.Errorf("/proc stat: %d fields after the name, want ≥ 22", len(f))
	}
	var err error
	get := func(field int) int64 {
		if err != nil {
			return 0
		}
		var n int64
		n, err = strconv.ParseInt(f[field-3], 10, 64)
		return n
	}
	s.state = f[0][0]
	s.utimeTicks = get(14)
	s.stimeTicks = get(15)
	s.cutimeTicks = get(16)
	s.cstimeTicks = get(17)
	s.threads = get(20)
	s.rssPages = get(24)
	if err != nil {
		return s, fmt.Errorf("/proc stat: %v", err)
	}
	return s, nil
}

// procStatus is what the tool reads from /proc/<pid>/status.
type procStatus struct {
	rssKiB  int64 // VmRSS
	hwmKiB  int64 // VmHWM, the peak RSS
	threads int64
}

func parseProcStatus(b []byte) (procStatus, error) {
	var s procStatus
	found := false
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		name, value, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		value = strings.TrimSpace(value)
		switch name {
		case "VmRSS":
			n, err := parseKB(value)
			if err != nil {
				return s, err
			}
			s.rssKiB, found = n, true
		case "VmHWM":
			n, err := parseKB(value)
			if err != nil {
				return s, err
			}
			s.hwmKiB = n
		case "Threads":
			n, err := strconv.ParseInt(value, 10, 64)
			if err != nil {
				return s, fmt.Errorf("/proc status Threads: %v", err)
			}
			s.threads = n
		}
	}
	if !found {
		return s, errors.New("/proc status: no VmRSS (a kernel thread or a zombie?)")
	}
	return s, nil
}

func parseKB(v string) (int64, error) {
	num, unit, _ := strings.Cut(v, " ")
	n, err := strconv.ParseInt(strings.TrimSpace(num), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("/proc status: %q: %v", v, err)
	}
	if u := strings.TrimSpace(unit); u != "" && u != "kB" {
		return 0, fmt.Errorf("/proc status: unit %q, want kB", u)
	}
	return n, nil
}

// procSample is one reading of a process (or the sum over several
// servers, each in per), with the spawned Redis if any.
type procSample struct {
	rssKiB  int64
	hwmKiB  int64
	cpuSec  float64
	userSec float64 // of cpuSec, in user space
	threads int64
	fds     int

	per   []procSample // several servers: each one
	redis *procSample  // the spawned redis-server
}

// redisCPU is the spawned Redis' CPU seconds (0 without one).
func (s procSample) redisCPU() float64 {
	if s.redis == nil {
		return 0
	}
	return s.redis.cpuSec
}

// readProc reads a process's RSS, CPU time (with that of the children it
// has reaped), threads and open files.
func readProc(pid int) (procSample, error) {
	dir := fmt.Sprintf("/proc/%d", pid)
	st, err := os.ReadFile(dir + "/status")
	if err != nil {
		return procSample{}, err
	}
	status, err := parseProcStatus(st)
	if err != nil {
		return procSample{}, err
	}
	sb, err := os.ReadFile(dir + "/stat")
	if err != nil {
		return procSample{}, err
	}
	stat, err := parseProcStat(sb)
	if err != nil {
		return procSample{}, err
	}
	fds := -1
	if ents, err := os.ReadDir(dir + "/fd"); err == nil {
		fds = len(ents)
	}
	return procSample{rssKiB: status.rssKiB, hwmKiB: status.hwmKiB, cpuSec: stat.cpuSeconds(), userSec: stat.userSeconds(), threads: stat.threads, fds: fds}, nil
}

// listenInodes returns the socket inodes of the listening TCP sockets on
// port found in the text of /proc/net/tcp or /proc/net/tcp6.
func listenInodes(b []byte, port int) ([]uint64, error) {
	var out []uint64
	sc := bufio.NewScanner(bytes.NewReader(b))
	first := true
	for sc.Scan() {
		if first { // the header line
			first = false
			continue
		}
		f := strings.Fields(sc.Text())
		if len(f) < 10 {
			continue
		}
		_, hexPort, ok := strings.Cut(f[1], ":")
		if !ok {
			return nil, fmt.Errorf("/proc/net/tcp: local address %q", f[1])
		}
		p, err := strconv.ParseUint(hexPort, 16, 16)
		if err != nil {
			return nil, fmt.Errorf("/proc/net/tcp: port %q: %v", hexPort, err)
		}
		if int(p) != port || f[3] != "0A" { // 0A: TCP_LISTEN
			continue
		}
		inode, err := strconv.ParseUint(f[9], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("/proc/net/tcp: inode %q: %v", f[9], err)
		}
		if inode != 0 {
			out = append(out, inode)
		}
	}
	return out, sc.Err()
}

// parseSocketLink returns the inode of a /proc/<pid>/fd link "socket:[N]".
func parseSocketLink(link string) (uint64, bool) {
	rest, ok := strings.CutPrefix(link, "socket:[")
	if !ok || !strings.HasSuffix(rest, "]") {
		return 0, false
	}
	n, err := strconv.ParseUint(rest[:len(rest)-1], 10, 64)
	return n, err == nil
}

// findListenerPIDs returns the servers listening on TCP port, each as the
// root of its process tree (serverRoot): the processes (other than this
// one) that hold a listening socket on port, from /proc/net/tcp{,6} and
// /proc/*/fd, each taken up to its root. Usually one; several when
// servers that are not of one tree share the port (SO_REUSEPORT), each of
// which takes part of the connections. Processes of other users cannot
// be read without privileges.
func findListenerPIDs(port int) ([]int, error) {
	holders, err := listenerHolders(port, true)
	if err != nil {
		return nil, err
	}
	procs := readProcTable()
	var roots []int
	for _, pid := range holders {
		if root := serverRoot(pid, os.Getpid(), procs); !slices.Contains(roots, root) {
			roots = append(roots, root)
		}
	}
	slices.Sort(roots)
	return roots, nil
}

// listenerPIDs returns the processes listening on the targets' ports (as
// the roots of their trees), each once, in the order of the targets,
// without those descended from another one (the tree of a process is
// measured with it). It fails if a port has no readable listener: the
// figures of some of the servers, divided by the deliveries of all, would
// flatter them.
func listenerPIDs(targets []*target) ([]int, error) {
	var pids []int
	for _, t := range targets {
		found, err := findListenerPIDs(int(t.addr.Port()))
		if err != nil {
			return nil, err
		}
		for _, pid := range found {
			if !slices.Contains(pids, pid) {
				pids = append(pids, pid)
			}
		}
	}
	var out []int
	for _, pid := range pids {
		nested := false
		for _, other := range pids {
			if other != pid && slices.Contains(descendants(other), pid) {
				nested = true
			}
		}
		if !nested {
			out = append(out, pid)
		}
	}
	return out, nil
}

// listenerHolders returns the processes that hold a listening TCP socket
// on port, in the order of their pids (a multi-process server's workers
// hold it as its master does; with reuseport each worker its own).
func listenerHolders(port int, skipSelf bool) ([]int, error) {
	want := map[uint64]bool{}
	for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		inodes, err := listenInodes(b, port)
		if err != nil {
			return nil, err
		}
		for _, n := range inodes {
			want[n] = true
		}
	}
	if len(want) == 0 {
		return nil, fmt.Errorf("no process listens on TCP port %d", port)
	}
	self := os.Getpid()
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	var out []int
	for _, d := range dirs {
		pid, err := strconv.Atoi(filepath.Base(d))
		if err != nil || (skipSelf && pid == self) {
			continue
		}
		ents, err := os.ReadDir(d + "/fd")
		if err != nil {
			continue
		}
		for _, e := range ents {
			link, err := os.Readlink(d + "/fd/" + e.Name())
			if err != nil {
				continue
			}
			if n, ok := parseSocketLink(link); ok && want[n] {
				out = append(out, pid)
				break
			}
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("a socket listens on port %d but no readable process holds it", port)
	}
	slices.Sort(out) // Glob's order is the names': 10000 before 9999
	return out, nil
}

// loadavg returns the first three fields of /proc/loadavg.
func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return ""
	}
	return strings.Join(f[:3], " ")
}

// cpuTimes is the whole machine's CPU time so far, in seconds.
type cpuTimes struct {
	// busy: user, nice, system, irq and softirq time (not idle or iowait)
	busy float64
	// steal: time this VM's CPUs wanted to run while the hypervisor ran
	// others. Counted as busy, a slowed host read as "other processes"
	// on a box where nothing else ran (top showed 38 % steal in a spread
	// run whose p99 was six times the usual).
	steal float64
}

// parseCPUTimes reads the "cpu" line of /proc/stat.
func parseCPUTimes(b []byte) (cpuTimes, error) {
	line, _, _ := bytes.Cut(b, []byte("\n"))
	f := strings.Fields(string(line))
	if len(f) < 8 || f[0] != "cpu" {
		return cpuTimes{}, errors.New("/proc/stat: no cpu line")
	}
	var busy, steal int64
	for i, v := range f[1:] {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return cpuTimes{}, fmt.Errorf("/proc/stat: %v", err)
		}
		switch i {
		case 0, 1, 2, 5, 6: // user, nice, system, irq, softirq
			busy += n
		case 7:
			steal = n
		}
	}
	return cpuTimes{busy: float64(busy) / clockTicks, steal: float64(steal) / clockTicks}, nil
}

// machineCPU reads the machine's CPU times so far.
func machineCPU() (cpuTimes, bool) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return cpuTimes{}, false
	}
	v, err := parseCPUTimes(b)
	return v, err == nil
}

// softirqCPU is the CPU seconds the kernel's softirq threads (ksoftirqd/N)
// have used so far. On loopback the receiving side's network work runs in
// the sender's system call unless the kernel defers it to these threads (a
// long system call, a busy box): it is the traffic's cost all the same,
// so runs report it beside the server's instead of counting it as others'.
func softirqCPU() float64 {
	dirs, err := os.ReadDir("/proc")
	if err != nil {
		return 0
	}
	var sec float64
	for _, d := range dirs {
		if d.Name()[0] < '0' || d.Name()[0] > '9' {
			continue
		}
		comm, err := os.ReadFile("/proc/" + d.Name() + "/comm")
		if err != nil || !strings.HasPrefix(string(comm), "ksoftirqd/") {
			continue
		}
		if b, err := os.ReadFile("/proc/" + d.Name() + "/stat"); err == nil {
			if st, err := parseProcStat(b); err == nil {
				sec += st.cpuSeconds()
			}
		}
	}
	return sec
}
