package main

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
)

// A server may be several processes: nginx's master and its workers
// (Nchan), Pushpin's runner and the services it starts. The figures of a
// server are those of its whole process tree, so that such servers are
// measured like a single Caddy process.

// readProcTree reads pid and every process descended from it, and sums
// them. With more than one process the RSS is the sum of their
// proportional set sizes (Pss, /proc/<pid>/smaps_rollup), so that the
// pages they share (code, a shared memory zone) count once, not once per
// process; a lone process keeps its plain RSS.
//
// The CPU of a process that exits stays in the sum: a zombie's from its
// own stat, a reaped one's from its parent's cutime and cstime (see
// cpuSeconds). Parents are read before their children (descendants'
// order), so a reap between the two reads can drop a child's CPU from
// one reading, never count it twice. What leaves the tree is lost: a
// child orphaned by its parent's exit is adopted by init (or a
// subreaper), and the CPU of a child reaped by the kernel (its parent
// ignores SIGCHLD) is added to no parent.
func readProcTree(pid int) (procSample, error) {
	kids := descendants(pid)
	if len(kids) == 0 {
		return readProc(pid)
	}
	sum, err := readProcPss(pid)
	if err != nil {
		return sum, err
	}
	for _, kid := range kids {
		s, err := readProcPss(kid)
		if err != nil {
			// a zombie (no memory, but its CPU until it is reaped),
			// or it ended meanwhile
			if st, ok := readZombie(kid); ok {
				sum.cpuSec += st.cpuSeconds()
				sum.userSec += st.userSeconds()
			}
			continue
		}
		sum.rssKiB += s.rssKiB
		sum.hwmKiB += s.hwmKiB
		sum.cpuSec += s.cpuSec
		sum.userSec += s.userSec
		sum.threads += s.threads
		sum.fds += s.fds
	}
	return sum, nil
}

// readZombie reads the stat of pid if it is a zombie.
func readZombie(pid int) (procStat, bool) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return procStat{}, false
	}
	st, err := parseProcStat(b)
	return st, err == nil && st.state == 'Z'
}

// readProcPss is readProc with the RSS replaced by the Pss.
func readProcPss(pid int) (procSample, error) {
	s, err := readProc(pid)
	if err != nil {
		return s, err
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", pid))
	if err != nil {
		return s, err
	}
	pss, err := parsePss(b)
	if err != nil {
		return s, err
	}
	s.rssKiB = pss
	return s, nil
}

// parsePss reads the Pss line of /proc/<pid>/smaps_rollup.
func parsePss(b []byte) (int64, error) {
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		name, value, ok := strings.Cut(sc.Text(), ":")
		if ok && name == "Pss" {
			return parseKB(strings.TrimSpace(value))
		}
	}
	return 0, errors.New("smaps_rollup: no Pss")
}

// descendants returns the processes descended from pid, from the parent
// pids in /proc/<pid>/stat.
func descendants(pid int) []int {
	children := map[int][]int{}
	for p, in := range readProcTable() {
		if p != pid {
			children[in.ppid] = append(children[in.ppid], p)
		}
	}
	var out []int
	queue := []int{pid}
	for len(queue) > 0 {
		p := queue[0]
		queue = queue[1:]
		slices.Sort(children[p]) // the table is a map: keep the pids' order
		for _, kid := range children[p] {
			out = append(out, kid)
			queue = append(queue, kid)
		}
	}
	return out
}

// procInfo is what descendants and serverRoot read of a process
// (/proc/<pid>/stat).
type procInfo struct {
	ppid, pgid int
	comm       string
}

// parseProcInfo reads the command name (field 2, in parentheses, which
// may hold anything), the parent pid (4) and the process group (5) of
// /proc/<pid>/stat.
func parseProcInfo(b []byte) (procInfo, bool) {
	i, j := bytes.IndexByte(b, '('), bytes.LastIndexByte(b, ')')
	if i < 0 || j < i {
		return procInfo{}, false
	}
	f := strings.Fields(string(b[j+1:]))
	if len(f) < 3 {
		return procInfo{}, false
	}
	ppid, err1 := strconv.Atoi(f[1])
	pgid, err2 := strconv.Atoi(f[2])
	return procInfo{ppid: ppid, pgid: pgid, comm: string(b[i+1 : j])}, err1 == nil && err2 == nil
}

// readProcTable reads every readable process's procInfo.
func readProcTable() map[int]procInfo {
	out := map[int]procInfo{}
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if b, err := os.ReadFile("/proc/" + e.Name() + "/stat"); err == nil {
			if in, ok := parseProcInfo(b); ok {
				out[pid] = in
			}
		}
	}
	return out
}

// shells are the command names of the shells a server may be started
// from: the walk of serverRoot stops below them (a script that runs a
// server in the foreground shares its process group without job control).
var shells = map[string]bool{"sh": true, "bash": true, "dash": true, "ash": true, "zsh": true, "ksh": true,
	"mksh": true, "fish": true, "csh": true, "tcsh": true, "busybox": true}

// serverRoot returns the process a server found by its port is measured
// as, with its tree: from pid, a process holding the listening socket,
// it goes up to the parent as long as the parent is part of the same
// server, that is:
//   - it is in the same process group: nginx's master makes a session of
//     its own (setsid) that its workers share, as Pushpin's runner and the
//     services it starts share the group a shell's job control gave them;
//     a shell with job control, init, a supervisor (systemd,
//     containerd-shim) are in other groups;
//   - it is not init (pid 1) or the kernel (0), nor a shell (see shells),
//     nor this tool or one of its ancestors (its tree holds the tool).
//
// A launcher that stays as the parent in the same group (sudo, timeout)
// counts in; -pid names the process to measure exactly.
func serverRoot(pid, self int, procs map[int]procInfo) int {
	tool := map[int]bool{} // this tool and its ancestors
	for p, n := self, 0; p > 0 && n < 1000; p, n = procs[p].ppid, n+1 {
		tool[p] = true
	}
	root := pid
	for range 1000 { // a cycle read across pid reuse ends
		me, ok := procs[root]
		if !ok {
			break
		}
		parent, ok := procs[me.ppid]
		if !ok || me.ppid <= 1 || tool[me.ppid] || parent.pgid != me.pgid || shells[parent.comm] {
			break
		}
		root = me.ppid
	}
	return root
}
